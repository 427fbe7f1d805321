"""The serving engine: staggered requests decode exactly what each gives alone; fixed programs."""

import jax
import numpy as np
import pytest

from flaxgpt.decode.sampler import select_rows
from flaxgpt.decode.sampling import Rows, Sampling, generate
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import LLAMA_STYLE, GPTConfig, init_params
from flaxgpt.models.gpt import step_fn as gpt_step_fn
from flaxgpt.serve.engine import Engine, prompt_buckets
from tests.serve import references

W = 64
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=W, vocab_size=40)
# (temperature, top_k, top_p): greedy, plain, top-k, nucleus, both, and a top_k past max_k (sorts all V)
SETTINGS = [(0, 0, 1), (0.8, 0, 1), (1.0, 5, 1), (1.0, 0, 0.9), (0.7, 20, 0.8), (1.2, 3, 0.5), (0, 0, 1)]


@pytest.fixture(scope="module")
def step():
    return gpt_step_fn(CFG, init_params(CFG, jax.random.key(0)))


def new_engine(step, slots, windows=False):  # slots 3 or 1, chunk 3: the tests share the compiled programs
    return Engine(step, CFG, slots=slots, chunk=3, max_k=8, slot_windows=windows)


def hit_of(engine, prompt, rows) -> int:
    """The prompt tokens a request would take from the prefix cache now (its pages given back)."""
    job = engine.start_prefill(prompt, rows)
    engine.cancel(job)
    return job.hit


def run(engine, requests, arrive_every=1, steps=None):
    """Feed requests into free slots, one new request every `arrive_every` generate(steps) calls."""
    out = {i: [] for i in range(len(requests))}
    waiting, owner, calls = list(range(len(requests))), {}, 0
    while waiting or owner:
        free = [s for s in range(engine.slots) if s not in owner]
        if waiting and free and calls % arrive_every == 0:
            i = waiting.pop(0)
            prompt, rows = requests[i]
            prefix = engine.prefill(prompt, rows)
            out[i].append(int(prefix.first))
            if not bool(prefix.done):
                engine.insert(prefix, free[0])
                owner[free[0]] = i
        if owner:
            tokens_BC, new_B, done_B = engine.generate(steps)
            for s, i in list(owner.items()):
                out[i] += tokens_BC[s, : new_B[s]].tolist()
                if done_B[s]:
                    del owner[s]
        calls += 1
    return [out[i] for i in range(len(requests))]


def requests(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, (t, k, p) in enumerate(SETTINGS):
        prompt = rng.integers(0, CFG.vocab_size, size=int(rng.integers(1, 20))).tolist()
        n = int(rng.integers(1, 30))
        rows = Rows.of(Sampling(temperature=t, top_k=k, top_p=p), max_new_tokens=n, seed=i)
        out.append((prompt, rows))
    return out


def test_staggered_requests_equal_each_alone_and_generate(step):
    reqs = requests()
    together = run(new_engine(step, slots=3), reqs, arrive_every=2)
    # each slot's window its own pages, read in place (GRPO's rollouts): the same tokens
    assert run(new_engine(step, slots=3, windows=True), reqs, arrive_every=2) == together
    for (prompt, rows), got in zip(reqs, together, strict=True):
        assert len(got) == int(rows.max_new_B[0])
        # generate alone, with the request's seed as its rng: the same tokens, sampled ones included
        assert got == references.alone(step, CFG, W, prompt, rows)


def test_one_prefill_serves_several_requests_by_fork_and_insert_group(step):
    """A prompt prefilled once, then given to 3 requests with their own settings and lengths (GRPO's
    group: train/grpo_rollout.py): by fork + insert, and by insert_group in one call, over shared
    pages or copied into each slot's own window, each decodes the tokens it decodes prefilled alone."""
    reqs = requests()
    prompt, rows = reqs[1][0], [r for _, r in reqs[1:4]]  # sampled: plain, top-k, nucleus
    alone = run(new_engine(step, slots=3), [(prompt, r) for r in rows])

    for grouped, windows in ((False, False), (True, False), (False, True), (True, True)):
        engine = new_engine(step, slots=3, windows=windows)
        prefix = engine.prefill(prompt, rows[0])
        out = {s: [] for s in range(3)}
        if grouped:
            firsts, _ = engine.insert_group(prefix, rows, [2, 0, 1])  # request r in slot (r + 2) % 3
            slot_of = [2, 0, 1]
        else:
            forks = [prefix] + [engine.fork(prefix, r) for r in rows[1:]]
            for s, f in enumerate(forks):
                engine.insert(f, s)
            firsts, slot_of = [f.first for f in forks], [0, 1, 2]
        busy = True
        while busy:
            tokens_BC, new_B, done_B = engine.generate()
            for s in range(3):
                out[s] += tokens_BC[s, : new_B[s]].tolist()
            busy = not all(done_B)
        got = [[int(firsts[r]), *out[slot_of[r]]] for r in range(3)]
        assert got == alone, (grouped, windows)
    # the first tokens' log-probs (a row asking for 2 alternatives): insert_group's are fork's
    asking = [r.replace(logprobs_B=np.full_like(r.logprobs_B, 2)) for r in rows]
    engine = new_engine(step, slots=3, windows=True)
    prefix = engine.prefill(prompt, asking[0], hold=True)
    forks = [engine.fork(prefix, r).logprobs for r in asking]
    firsts, lp_R = engine.insert_group(prefix, asking, [0, 1, 2])
    for r, lp in enumerate(forks):
        for field, want in zip(lp_R, lp, strict=True):
            np.testing.assert_allclose(np.asarray(field)[r], np.asarray(want), rtol=1e-6)
    assert np.asarray(lp_R.chosen).max() < 0 and [int(f) for f in firsts] == [t[0] for t in alone]
    with pytest.raises(ValueError, match="2 requests for 1 slots"):
        engine.insert_group(prefix, rows[:2], [0])


# a Qwen3-MoE-shaped mixture of experts: 4 experts, top-2 without renormalising, QK-norm, layer 1 dense
MOE = GPTConfig(
    **LLAMA_STYLE, vocab_size=40, block_size=W, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, head_size=8,
    qk_norm=True, mlp_hidden=48, num_experts=4, experts_per_token=2, expert_hidden=16,
    norm_topk_prob=False, mlp_only_layers=(1,),
)  # fmt: skip


def test_mixture_of_experts_serves_what_generate_gives():
    """Staggered requests, prompts prefilled in chunks of 8: each row is routed on its own (a
    prefill's padding and idle slots go through the router and experts too, adding nothing to the
    real tokens), so the engine decodes the greedy tokens `generate` gives the whole batch."""
    params = jax.tree_util.tree_map(lambda x: x * 8, init_params(MOE, jax.random.key(0)))  # peaked router
    step = gpt_step_fn(MOE, params)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, MOE.vocab_size, n).tolist() for n in (3, 13, 1, 20, 7)]
    engine = Engine(step, MOE, slots=2, chunk=3, max_k=8, prefill_chunk=8, buckets=(8,))
    greedy = Rows.of(Sampling(temperature=0), max_new_tokens=12)
    got = run(engine, [(p, greedy) for p in prompts], arrive_every=2)
    batch_BP = np.array([p + [0] * (20 - len(p)) for p in prompts])
    want, n = generate(
        step, KVCache.for_config(MOE, len(prompts), W), batch_BP, [len(p) for p in prompts],
        max_new_tokens=12, rng=jax.random.key(0), temperature=0,
    )  # fmt: skip
    assert got == [want[i, : n[i]].tolist() for i in range(len(prompts))]
    assert len({tuple(g) for g in got}) == len(prompts)


def test_eos_release_and_bad_requests(step):
    engine = new_engine(step, slots=3)
    GREEDY = Sampling(temperature=0)
    greedy = run(new_engine(step, slots=1), [([1, 2, 3], Rows.of(GREEDY, max_new_tokens=20))])[0]
    eos = greedy[5]
    rows = Rows.of(Sampling(temperature=0, eos_id=eos), max_new_tokens=20)
    got = run(engine, [([1, 2, 3], rows)])[0]
    assert got == greedy[: greedy.index(eos) + 1]
    # a released slot stops at once and its row is reusable
    engine.insert(engine.prefill([4, 5], Rows.of(Sampling(temperature=0), max_new_tokens=30)), 1)
    engine.release(1)
    assert engine.generate()[1][1] == 0
    with pytest.raises(ValueError, match="context window of 64"):
        engine.prefill([1] * 60, Rows.of(max_new_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        engine.prefill([], Rows.of(max_new_tokens=5))
    assert prompt_buckets(64) == (16, 24, 32, 48, 64) and engine.n_programs == 10
    assert prompt_buckets(100) == (16, 24, 32, 48, 64, 96, 100)


def test_select_rows_filters_and_rows_are_independent():
    select = jax.jit(select_rows, static_argnames="max_k")
    logits_BV = jax.random.normal(jax.random.key(1), (4, 50)) * 3
    keys_B = jax.vmap(jax.random.key)(np.arange(4, dtype=np.uint32))
    temp_B, k_B, p_B = np.float32([0, 1, 1, 0.5]), np.int32([0, 3, 0, 30]), np.float32([1, 1, 0.6, 0.9])
    tok_B = select(keys_B, logits_BV, temp_B, k_B, p_B, max_k=8)
    assert int(tok_B[0]) == int(np.argmax(logits_BV[0]))
    assert int(tok_B[1]) in np.argsort(-np.asarray(logits_BV[1]))[:3]
    for b in range(4):  # each row alone gives the same token, whatever path the batch took
        one = [x[b : b + 1] for x in (keys_B, logits_BV, temp_B, k_B, p_B)]
        assert int(select(*one, max_k=8)[0]) == int(tok_B[b])
    # nucleus support: draws only from the smallest set reaching p
    R = 64
    x_RV = np.tile(np.float32([[3.0, 2.0, 1.0, 0.0, -1.0]]), (R, 1))
    keys_R = jax.vmap(jax.random.key)(np.arange(R, dtype=np.uint32))
    draws = select(
        keys_R, x_RV, np.ones(R, np.float32), np.zeros(R, np.int32), np.full(R, 0.7, np.float32), max_k=8
    )
    assert set(np.asarray(draws).tolist()) == {0, 1}  # p(0) = 0.64 < 0.7, p(0) + p(1) = 0.87


@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_quantized_weights_serve_what_generate_gives(mode, tmp_path):
    """serve.py --quantize: server.load quantizes, and the engine decodes what generate does with them."""
    import json

    from flaxgpt.data.tokenizers import CharTokenizer
    from flaxgpt.models import quantize
    from flaxgpt.models.gpt import quantize_params
    from flaxgpt.runs.checkpoint import Checkpointer
    from flaxgpt.serve import launch

    params = init_params(CFG, jax.random.key(0))
    (tmp_path / "config.json").write_text(json.dumps({"model": {"kind": "gpt", **CFG.to_dict()}}))
    chars = [chr(ord("a") + i) if i < 26 else chr(ord("A") + i - 26) for i in range(CFG.vocab_size)]
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": CharTokenizer(chars).to_meta()}))
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, {"params": params}, extra={})
    ckpt.close()
    loaded, _ = launch.load(str(tmp_path), quantize=mode)
    assert quantize.is_quantized(loaded.params)
    qconfig, qparams = quantize_params(CFG, params, mode)
    step = gpt_step_fn(loaded.config, loaded.params)
    engine = Engine(step, loaded.config, slots=2, chunk=3, max_k=8)
    prompt = [3, 1, 4, 1, 5]
    got = run(engine, [(prompt, Rows.of(Sampling(temperature=0), max_new_tokens=12))])[0]
    want, _ = generate(
        gpt_step_fn(qconfig, qparams), KVCache.for_config(qconfig, 1, W), np.array([prompt]), [5],
        max_new_tokens=12, rng=jax.random.key(0), temperature=0,
    )  # fmt: skip
    assert got == np.asarray(want)[0].tolist()


def chat_requests(seed=1):
    """Prompts sharing a 13-token system prompt, some also an earlier turn; greedy and sampled."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, CFG.vocab_size, 13).tolist()
    turn = rng.integers(0, CFG.vocab_size, 9).tolist()
    out = []
    for i, (t, k, p) in enumerate(SETTINGS[:5]):
        tail = rng.integers(0, CFG.vocab_size, int(rng.integers(1, 12))).tolist()
        prompt = system + (turn if i % 2 else []) + tail
        rows = Rows.of(
            Sampling(temperature=t, top_k=k, top_p=p), max_new_tokens=int(rng.integers(3, 15)), seed=i
        )
        out.append((prompt, rows))
    return out


def test_prefix_cache_and_chunked_prefill_decode_what_generate_gives(step):
    """Prompts taken partly from the prefix cache (blocks of 4, 6 of them: evictions happen) and
    prefilled in chunks of 8 give each request the tokens of generate alone."""
    reqs = chat_requests()
    alone = run(new_engine(step, slots=1), reqs)
    engine = Engine(step, CFG, slots=3, chunk=3, max_k=8, prefill_chunk=8, page=4, prefix_blocks=6)
    assert engine.buckets == (8,) and engine.n_programs == 6
    first = run(engine, reqs, arrive_every=2)
    hits = [hit_of(engine, p, rows) for p, rows in reqs]  # a second round: what it reuses
    second = run(engine, reqs, arrive_every=2, steps=1)  # one decode step per call
    assert first == second == alone
    assert max(hits) >= 12 and len(engine.blocks.blocks) == 6  # bounded: LRU evicted the rest
    # a hit never covers the last prompt token, whose logits the prefill must compute
    p = reqs[0][0][:12]
    engine.drop(engine.prefill(p, Rows.of(max_new_tokens=2)))
    assert hit_of(engine, p, Rows.of(max_new_tokens=2)) == 8
    engine.blocks.check()
    for (prompt, rows), got in zip(reqs, alone, strict=True):
        assert got == references.alone(step, CFG, W, prompt, rows)


def test_reply_kv_is_kept_for_the_next_turn(step):
    """A finished request's slot offers its prompt + reply to the prefix cache (`keep`): the next
    turn (prompt, reply, a new message) reuses the reply's blocks and decodes what generate gives."""
    engine = Engine(step, CFG, slots=3, chunk=3, max_k=8, prefill_chunk=8, page=4, prefix_blocks=16)
    rng = np.random.default_rng(3)
    prompt, kept, asked = rng.integers(0, CFG.vocab_size, 10).tolist(), 0, 0
    for turn in range(3):
        rows = Rows.of(Sampling(temperature=0.9, top_k=8), max_new_tokens=9, seed=turn)
        hit = hit_of(engine, prompt, rows)
        assert hit == kept // 4 * 4 and (turn == 0 or hit > asked)  # past the last turn's prompt
        asked = len(prompt)
        [reply] = run(engine, [(prompt, rows)])
        assert reply == references.alone(step, CFG, W, prompt, rows)
        slot = 0  # run() put the request in the first free slot; it has not been reused since
        assert engine.keep(slot, prompt + reply[:-1]) >= 1  # the reply's blocks are new
        kept = len(prompt) + len(reply) - 1  # reused up to here next turn (past this turn's prompt)
        prompt = prompt + reply + rng.integers(0, CFG.vocab_size, 3).tolist()


# float weights under SERVE_RULES: tests/serve/test_sharded_serving.py serves them through serve.py --mesh 8
@pytest.mark.parametrize("mode,rules", [("int8", "SERVE_RULES"), (None, "LOGICAL_RULES")])
def test_sharded_engine_gives_the_one_device_tokens(mode, rules):
    """Engine(mesh=...) over the 8 CPU devices: weights split by a logical-axis rules table (serving's
    MLP / vocabulary split, or training's FSDP; int8 ones placed by quantize_params on their abstract
    layout), the slots cache by rows; every request gets the tokens of the one-device engine."""
    from flax import linen as nn

    from flaxgpt import sharding
    from flaxgpt.models import gpt

    mesh = sharding.make_mesh(1, 8)
    cfg, params = CFG, init_params(CFG, jax.random.key(0))
    boxed = gpt.abstract_params(CFG)
    shardings = sharding.param_shardings(boxed, mesh, getattr(sharding, rules))
    if mode:
        cfg, params = gpt.quantize_params(CFG, params, mode)
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings
        )
        from flaxgpt.aot.programs import abstract_quantized

        shardings = jax.tree.map(lambda a: a.sharding, abstract_quantized(CFG, abstract, mesh, mode))
    placed = jax.device_put(params, shardings)
    w = jax.tree.leaves(placed["h_0"]["mlp"]["c_fc"]["kernel"])[0]
    assert w.addressable_shards[0].data.size == w.size // 8  # an eighth of each weight per device
    kw = dict(slots=8, chunk=3, max_k=8, prefill_chunk=24, buckets=(24,))  # few programs to compile
    one = Engine(gpt_step_fn(cfg, params), cfg, **kw)
    many = Engine(gpt_step_fn(cfg, placed), cfg, mesh=mesh, **kw)
    reqs = requests()
    assert run(many, reqs) == run(one, reqs)
    fill = many.state.fill_B  # the slots' arrays still split: the donated state kept its placement
    assert fill.sharding.is_equivalent_to(sharding.batch_sharding(mesh), fill.ndim)
