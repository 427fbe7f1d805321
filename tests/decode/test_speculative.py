"""Speculative decoding: greedy equals plain greedy; sampling keeps the target's distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.decode.sampling import generate
from flaxgpt.decode.speculative import check_draft, speculative_generate
from flaxgpt.models.cache import KVCache
from flaxgpt.models.gpt import LLAMA_STYLE, GPTConfig, init_params, step_fn

TARGET = GPTConfig(vocab_size=13, block_size=64, n_layer=2, n_head=2, n_embd=32)
DRAFT = GPTConfig(vocab_size=13, block_size=64, n_layer=1, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def steps():
    target = init_params(TARGET, jax.random.key(0))
    draft = init_params(DRAFT, jax.random.key(1))
    # larger weights than the 0.02 init: peaked logits, so the models disagree often
    target = jax.tree_util.tree_map(lambda x: x * 8, target)
    draft = jax.tree_util.tree_map(lambda x: x * 8, draft)
    return step_fn(TARGET, target), step_fn(DRAFT, draft)


@pytest.mark.parametrize("k,eos", [(3, 5)])
def test_greedy_equals_plain_greedy(steps, k, eos):
    target, draft = steps
    prompt = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 0, 0], [5, 0, 0, 0, 0]], np.int32)
    lengths = [5, 3, 1]
    want, want_len = generate(
        target,
        KVCache.for_config(TARGET, 3, 64),
        prompt,
        lengths,
        max_new_tokens=30,
        rng=jax.random.key(0),
        temperature=0,
        eos_id=eos,
    )
    got, got_len, stats = speculative_generate(
        target,
        KVCache.for_config(TARGET, 3, 64),
        draft,
        KVCache.for_config(DRAFT, 3, 64),
        prompt,
        lengths,
        max_new_tokens=30,
        rng=jax.random.key(0),
        draft_tokens=k,
        temperature=0,
        eos_id=eos,
    )
    np.testing.assert_array_equal(got_len, want_len)
    np.testing.assert_array_equal(got, want)
    assert 0 < stats.accepted < stats.drafted  # the draft is right sometimes, not always
    assert stats.rounds < 30


def test_self_draft_accepts_everything(steps):
    target, _ = steps
    prompt = np.array([[1, 2, 3]], np.int32)
    got, n, stats = speculative_generate(
        target,
        KVCache.for_config(TARGET, 1, 64),
        target,
        KVCache.for_config(TARGET, 1, 64),
        prompt,
        [3],
        max_new_tokens=21,
        rng=jax.random.key(0),
        draft_tokens=1,
        temperature=0,
    )
    assert stats.acceptance == 1.0 and stats.rounds == 10 and n[0] == 21  # 1 + 10 rounds of 2


# a Mixtral-shaped mixture of experts: 4 experts, top-2, every layer sparse
MIXTRAL = GPTConfig(
    **LLAMA_STYLE, vocab_size=13, block_size=64, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
    num_experts=4, experts_per_token=2, expert_hidden=32,
)  # fmt: skip


def test_mixture_of_experts_target(steps):
    """An MoE target verifies k + 1 positions per row in one call (the rows' tokens routed together,
    rejected drafts taken back): with the dense draft it gives its own greedy tokens."""
    _, draft = steps
    params = jax.tree_util.tree_map(lambda x: x * 8, init_params(MIXTRAL, jax.random.key(2)))
    target = step_fn(MIXTRAL, params)
    prompt = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 0, 0], [5, 0, 0, 0, 0]], np.int32)
    lengths = [5, 3, 1]
    want, want_len = generate(
        target, KVCache.for_config(MIXTRAL, 3, 64), prompt, lengths, max_new_tokens=24,
        rng=jax.random.key(0), temperature=0,
    )  # fmt: skip
    got, got_len, stats = speculative_generate(
        target, KVCache.for_config(MIXTRAL, 3, 64), draft, KVCache.for_config(DRAFT, 3, 64), prompt,
        lengths, max_new_tokens=24, rng=jax.random.key(0), draft_tokens=3, temperature=0,
    )  # fmt: skip
    np.testing.assert_array_equal(got_len, want_len)
    np.testing.assert_array_equal(got, want)
    assert 0 < stats.accepted < stats.drafted


V = 4
# bigram models: the next token's logits depend on the current token only
TARGET_PROBS = [[0.1, 0.6, 0.2, 0.1], [0.3, 0.1, 0.5, 0.1], [0.25] * 4, [0.7, 0.1, 0.1, 0.1]]
DRAFT_PROBS = [[0.4, 0.1, 0.1, 0.4], [0.1, 0.7, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7], [0.25] * 4]
TARGET_LOGITS, DRAFT_LOGITS = np.log(TARGET_PROBS), np.log(DRAFT_PROBS)


def bigram_step(table):
    table = jnp.asarray(table, jnp.float32)

    def step(tokens_BT, positions_BT, cache, logits_at=None):  # prefills ask for one position per row
        logits_BTV = table[tokens_BT]
        if logits_at is not None:
            logits_BTV = jnp.take_along_axis(logits_BTV, logits_at[:, None, None], axis=1)
        return logits_BTV, cache

    return step


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_sampling_keeps_the_target_distribution(temperature, top_k):
    """The first three new tokens, over 6000 rows, follow the target's chain (chi-square)."""
    B, N = 6000, 3
    prompt = np.zeros((B, 1), np.int32)
    tokens, _, stats = speculative_generate(
        bigram_step(TARGET_LOGITS),
        KVCache.init(1, B, 8, 1, 1),
        bigram_step(DRAFT_LOGITS),
        KVCache.init(1, B, 8, 1, 1),
        prompt,
        np.ones(B, np.int32),
        max_new_tokens=N,
        rng=jax.random.key(1),
        draft_tokens=2,
        temperature=temperature,
        top_k=top_k,
    )
    assert 0.1 < stats.acceptance < 0.9  # rejections happen: the rule is exercised
    logits = TARGET_LOGITS / temperature
    if top_k:
        logits = np.where(logits >= np.sort(logits, axis=1)[:, -top_k][:, None], logits, -np.inf)
    trans = np.exp(logits - logits.max(1, keepdims=True))
    trans /= trans.sum(1, keepdims=True)
    # exact probability of each of the 64 sequences (t1, t2, t3) after token 0
    seqs = np.array(np.meshgrid(*[np.arange(V)] * N, indexing="ij")).reshape(N, -1).T
    probs = trans[0, seqs[:, 0]] * trans[seqs[:, 0], seqs[:, 1]] * trans[seqs[:, 1], seqs[:, 2]]
    counts = np.bincount(tokens @ (V ** np.arange(N)[::-1]), minlength=V**N)
    seen = probs > 0
    assert counts[~seen].sum() == 0  # never a token top-k removed
    expected = B * probs[seen]
    chi2 = np.sum((counts[seen] - expected) ** 2 / expected)
    dof = seen.sum() - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)  # ~5 sigma: fails for a wrong rule


def test_errors(steps):
    target, draft = steps
    with pytest.raises(ValueError, match="does not slide the window"):
        short, long = KVCache.for_config(TARGET, 1, 16), KVCache.for_config(DRAFT, 1, 64)
        speculative_generate(
            target,
            short,
            draft,
            long,
            np.ones((1, 4), np.int32),
            [4],
            max_new_tokens=10,
            rng=jax.random.key(0),
        )
    with pytest.raises(ValueError, match="vocabulary has 50257 tokens, the target's 65"):
        check_draft(target_vocab=65, draft_vocab=50257, target_params=10, draft_params=5)
    with pytest.raises(ValueError, match="not fewer than the target's"):
        check_draft(target_vocab=65, draft_vocab=65, target_params=10, draft_params=10)
    with pytest.raises(ValueError, match=r"draft.s tokenizer \(char\) differs from the target.s \(gpt2\)"):
        check_draft(
            target_vocab=65,
            draft_vocab=65,
            target_params=10,
            draft_params=5,
            target_tokenizer={"kind": "tiktoken", "name": "gpt2"},
            draft_tokenizer={"kind": "char"},
        )
