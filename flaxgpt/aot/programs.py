"""A recipe's real programs with abstract arguments: flaxgpt's own jitted functions, traced with
`jax.ShapeDtypeStruct`s that carry shardings over a target's abstract devices. Nothing is allocated.

    programs = build(config, devices, groups=("train", "eval", "sample", "serve"))
    compiled = programs[0].trace().lower().compile()

- train: flaxgpt.train.steps.make_steps' train step (micro-batches, optimizer, donation, shardings) on
  the recipe's (data, fsdp) mesh over all the target's devices; eval: its eval step (one micro-batch).
- sample (GPT): flaxgpt.decode.sampling's prefill (a full-window prompt) and decode loop over
  gpt.step_fn and a KVCache, on one device, as sample.py runs (batch 1, temperature 0.8, top-k 200).
- serve (GPT): flaxgpt.serve.runner's prefill (the largest prompt bucket) and generate step for all
  `slots` slots (chunk 4) over the engine's page pool (flaxgpt.models.paged: JAX's Pallas
  paged-attention kernel on TPU and GPU), on one device as flaxgpt.serve.launch runs it, or over
  `serve_devices` devices (Engine(mesh=...): weights split by sharding.SERVE_RULES, the pool by heads).
- rollout (GRPO recipes, grpo.rollout = engine): the engine's prefill and generate step as the
  trainer's rollouts run them (train.grpo_rollout): batch_size slots over the policy's weights
  (LoRA: adapters unmerged over the base in lora.base_dtype, int8 included), over the training
  mesh's devices, or with grpo.engine_devices = n over the target's last n (the train step over the
  rest); the generate step's note says what crosses between trainer and engine each step.
- sample and serve take int8 / bf16 weights (`quantize`): gpt.quantize_params traced over the abstract
  parameters gives their layout and placement (`abstract_quantized`). Both are traced under their
  mesh (one device of the target's, or the serving mesh), so the kernels are the target's (no CPU
  qmatmul custom call).

A recipe that fine-tunes a pretrained model takes the architecture loader.resolve_init reads without the
weights: a flaxgpt run's saved model section, a Hugging Face config.json, or the preset of a name the
family table knows (hf.families.preset_for: gpt2*, smollm2-135m, Meta-Llama-3-8B, ...).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, NamedSharding

from flaxgpt import loader, sharding
from flaxgpt.decode import sampling
from flaxgpt.models import attention, gpt, lora
from flaxgpt.models import registry as models
from flaxgpt.models.cache import AdapterCache, KVCache
from flaxgpt.models.flops import flops_per_token
from flaxgpt.models.paged import PagedKVCache, paged_impl
from flaxgpt.serve import runner
from flaxgpt.train import grpo_rollout, policy, sections
from flaxgpt.train.config_check import micro_batch
from flaxgpt.train.steps import make_steps
from flaxgpt.train.tasks import Task

PAGE = grpo_rollout.PAGE  # the engine's page size: serve.py's --prefix_block default, GRPO's engine

GROUPS = ("train", "eval", "sample", "serve", "rollout")  # rollout: GRPO recipes only
DEFAULT_VOCAB = 50257  # GPT-2's BPE: the vocabulary assumed when neither the recipe nor its data says


@dataclasses.dataclass
class Program:
    name: str  # train | eval | sample.prefill | sample.decode | serve.prefill | serve.generate[_paged]
    # | rollout.prefill | rollout.generate
    jitted: Any  # flaxgpt's own jax.jit-wrapped function
    args: tuple  # abstract arguments (ShapeDtypeStructs with shardings; pytrees of them)
    kwargs: dict  # static arguments
    devices: int  # devices the program runs on
    model_flops: float  # flaxgpt's FLOP count per call, all devices together
    state_bytes: dict  # per device: {"parameters": ..., "optimizer": ...}
    note: str = ""
    min_bytes: float = 0.0  # HBM bytes a call must at least read (decoding: weights + cache per token)
    mesh: Any = None  # traced under this mesh context, as flaxgpt.train.trainer.train runs the steps

    def trace(self):
        if self.mesh is None:
            return self.jitted.trace(*self.args, **self.kwargs)
        with jax.set_mesh(self.mesh):  # Pallas attention splits its kernel per device under it
            return self.jitted.trace(*self.args, **self.kwargs)


def model_config(config, vocab_size: int = 0):
    """The recipe's model config, without reading its data or checkpoint (loader.resolve_init, abstract),
    and where it came from. Vocabulary: the recipe's, else its data's meta.json, else GPT-2's."""
    vocab, source = vocab_size, "--vocab_size"
    if not vocab and config.model.get("vocab_size"):
        vocab, source = config.model.vocab_size, "the recipe"
    meta = Path(sections.of(config).data.dir) / "meta.json"
    if not vocab and meta.is_file():
        vocab, source = json.loads(meta.read_text()).get("vocab_size", 0), str(meta)
    if not vocab:
        vocab, source = DEFAULT_VOCAB, f"assumed (GPT-2's; no {meta}: set --vocab_size)"
    recipe = models.config_from(config.model, vocab)
    try:
        init = loader.resolve_init(config.get("init_from", "auto"), recipe, abstract=True)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    return init.config, f"vocab {recipe.vocab_size}: {source}" if init.kind == "fresh" else init.where


def per_device_bytes(tree) -> int:
    """Bytes one device holds of an abstract, sharded tree (the largest shard of each leaf; a leaf
    found twice counts once: a tied head's quantized table is the embedding's)."""
    total = 0
    for a in {id(a): a for a in jax.tree.leaves(tree)}.values():
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += int(np.prod(shape)) * jnp.dtype(a.dtype).itemsize
    return total


def _batch(shapes: dict, sharding_of, leading=()):
    """{name: ShapeDtypeStruct} placed as the trainer places batches (sharding_of: ndim -> sharding)."""
    out = {}
    for k, (shape, dtype) in shapes.items():
        shape = tuple(leading) + shape
        out[k] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_of(len(shape)))
    return out


def train_programs(config, mc, devices, groups) -> list[Program]:
    task = Task.abstract(config, mc)
    m = sections.of(config).mesh
    mesh = sharding.make_mesh(m.data, m.fsdp, devices, expert=m.expert, context=m.context)
    attention.check_context_mesh(models.kind_of(mc), mc, mesh)
    micro = micro_batch(config)
    sharding.check_batch(micro, mesh, "batch_size // grad_accum")
    steps = make_steps(config, task, mesh)
    state = sharding.shapes_on(steps.abstract_state, steps.state_shardings)
    state = state.replace(frozen=steps.frozen)  # Frozen
    n = len(devices)
    sizes = {"parameters": per_device_bytes(state.params), "optimizer": per_device_bytes(state.opt_state)}
    fpt = flops_per_token(mc, task.tokens_per_row)
    mesh_note = f"mesh data {mesh.shape['data']} x fsdp {mesh.shape['fsdp']}"
    if mesh.shape.get("expert", 1) > 1:
        mesh_note += f" x expert {mesh.shape['expert']}"
    if mesh.shape.get("context", 1) > 1:
        mesh_note += f" x context {mesh.shape['context']} ({mc.context_impl} attention)"
    out = []
    if "train" in groups:
        batch = _batch(task.batch_shapes(micro), steps.train_batch_sharding, (config.grad_accum,))
        flops = fpt["train"] * config.batch_size * task.tokens_per_row
        note = f"{mesh_note}, {config.grad_accum} x {micro} rows x {task.tokens_per_row} tokens"
        out.append(Program("train", steps.train_step, (state, batch), {}, n, flops, sizes, note, mesh=mesh))
    if "eval" in groups:
        batch = _batch(task.batch_shapes(micro), steps.eval_batch_sharding)
        flops = fpt["forward"] * micro * task.tokens_per_row
        params = {"parameters": sizes["parameters"]}
        note = f"{mesh_note}, {micro} rows"
        out.append(
            Program(
                "eval",
                steps.eval_step,
                (state.params, batch, state.frozen),
                {},
                n,
                flops,
                params,
                note,
                mesh=mesh,
            )
        )
    return out


def _decoding(mc, devices, quantize=None):
    """(config, abstract step_fn, mesh, parameter bytes per device) as gpt.step_fn decodes over
    `devices`: layers unrolled, the weights placed by sharding.SERVE_RULES on a (data 1, fsdp n) mesh
    (one device: whole), int8 / bf16 weights from quantize_params on their abstract layout."""
    mesh = sharding.make_mesh(1, len(devices), devices)
    cfg = dataclasses.replace(mc, scan_layers=False, remat="none")
    boxed = gpt.abstract_params(cfg)
    params = sharding.shapes_on(nn.unbox(boxed), sharding.param_shardings(boxed, mesh, sharding.SERVE_RULES))
    if quantize:
        cfg, params = gpt.quantized_config(cfg), abstract_quantized(cfg, params, mesh, quantize)
    return cfg, gpt.step_fn(cfg, params), mesh, per_device_bytes(params)


def abstract_quantized(cfg, params, mesh, mode: str):
    """gpt.quantize_params' weights of abstract, placed parameters, nothing computed: the real function
    traced (jax.make_jaxpr) over a copy of the mesh whose axes are Explicit, so JAX's sharding rules
    place each result as its computation goes (a kernel's transpose placed transposed, scales as the
    rows they scale, as models/quantize.py places weights split over a real mesh), then put back on
    `mesh`. An output returned twice (a tied head's table) stays one leaf, as in the concrete tree."""
    explicit = mesh.abstract_mesh.update_axis_types({a: AxisType.Explicit for a in mesh.axis_names})
    on = lambda m, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(m, a.sharding.spec))  # noqa: E731
    with jax.sharding.use_abstract_mesh(explicit):
        traced, out = jax.make_jaxpr(lambda p: gpt.quantize_params(cfg, p, mode)[1], return_shape=True)(
            jax.tree.map(lambda a: on(explicit, a), params)
        )
    leaves, tree = jax.tree.flatten(out)
    first = {}  # each output variable's one leaf
    leaves = [first.setdefault(v, on(mesh, a)) for v, a in zip(traced.jaxpr.outvars, leaves, strict=True)]
    return jax.tree.unflatten(tree, leaves)


def _scalar(dtype, mesh):
    return jax.ShapeDtypeStruct((), dtype, sharding=sharding.replicated(mesh))


def _weights(quantize) -> str:
    return f", {quantize} weights" if quantize else ""


def sample_programs(mc, devices, batch: int = 1, chunk: int = 256, quantize=None) -> list[Program]:
    cfg, step, mesh, param_bytes = _decoding(mc, devices[:1], quantize)
    one = sharding.replicated(mesh)
    W = P = cfg.block_size
    cache = sharding.shapes_on(jax.eval_shape(lambda: KVCache.for_config(cfg, batch, W)), one)
    how = sampling.Sampling(temperature=0.8, top_k=200)  # sample.py's defaults (settings are arrays)
    rows = sharding.shapes_on(
        jax.eval_shape(lambda: sampling.Rows.same(jax.random.key(0), batch, how, 1)), one
    )
    prompt = jax.ShapeDtypeStruct((batch, P), jnp.int32, sharding=one)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=one)
    args = (step, cache, prompt, lengths, rows)
    # traced under the target's one-device mesh: kernels (attention, qmatmul) chosen for its device
    prefill = Program(
        "sample.prefill", sampling._prefill, args, {"max_k": 256}, 1,
        flops_per_token(cfg, P)["forward"] * batch * P, {"parameters": param_bytes},
        f"batch {batch}, prompt {P}, cache {W}{_weights(quantize)}", mesh=mesh,
    )  # fmt: skip
    state = sharding.shapes_on(prefill.trace().out_info[0], one)
    stop = jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=one)
    decode = Program(
        "sample.decode", sampling.decode_chunk, (step, state, stop),
        {"chunk": chunk, "keep": W // 2, "max_k": 256}, 1,
        flops_per_token(cfg, W)["forward"] * batch * chunk, {"parameters": param_bytes},
        f"batch {batch}, {chunk} tokens per call, cache {W}{_weights(quantize)}",
        chunk * (param_bytes + per_device_bytes(cache)), mesh=mesh,
    )  # fmt: skip
    return [prefill, decode]


def greedy_token(mc, target, chunk: int = 256, quantize=None):
    """A greedy decoding token's kernels (an hlo_cost.Cost): sample.decode with max_k 0 (the argmax
    alone, no filter or draw, as gpu_lease.py's decode parts) compiled for `target` (targets.Target),
    its token loop costed at the target's peaks, each conditional by its smallest branch (what a
    greedy row runs); `quantize`: sample.py's --quantize mode of the weights."""
    from flaxgpt.aot import hlo_cost

    decode = sample_programs(mc, target.devices(), chunk=chunk, quantize=quantize)[1]
    decode = dataclasses.replace(decode, kwargs=dict(decode.kwargs, max_k=0))
    hlo = decode.trace().lower().compile().as_text()
    body = hlo_cost.loop_body(hlo)
    return hlo_cost.estimate(hlo, target.peak_flops, target.bandwidth, computation=body, branch=min)


def serve_programs(
    mc, devices, slots: int = 8, max_len: int = 0, chunk: int = 4, prefill_chunk: int = 128, quantize=None,
    decoding=None, speculative_tokens: int = 0,
) -> list[Program]:  # fmt: skip
    """The engine's programs as serve.py runs them (serve.runner): a prefill chunk (its largest bucket:
    serve.py's --prefill_chunk; docs/aot.md's figures were compiled at 128) into the page pool through
    one request's table, and the generate step for every slot over the pool (pages of 16: JAX's Pallas
    paged-attention kernel where the target has one). Over several `devices`: Engine(mesh=...)'s, the
    weights split by sharding.SERVE_RULES (MLP and vocabulary over the devices), the pool by its heads
    where they divide. decoding: _decoding's (config, step_fn, mesh, parameter bytes) if not the GPT's
    own."""
    cfg, step, mesh, param_bytes = decoding or _decoding(mc, devices, quantize)
    progs = runner.programs(mesh)
    n = len(devices)
    W = -(-min(max_len or cfg.block_size, cfg.block_size) // PAGE) * PAGE  # whole pages, as the engine
    P = min(prefill_chunk, W)

    def placed(make):
        tree = jax.eval_shape(make)
        return sharding.shapes_on(tree, sharding.row_shardings(tree, mesh))

    impl = paged_impl(devices[0].platform, cfg.head_dim, n)
    pool = lambda: AdapterCache.wrap(
        PagedKVCache.for_slots(cfg, slots, W, page=PAGE, impl=impl, extra_pages=1)
    )  # noqa: E731
    state = placed(lambda: runner.empty_state(pool(), slots, cfg.vocab_size))
    rows = placed(lambda: jax.tree.map(jnp.asarray, sampling.Rows.of(max_new_tokens=1)))
    rep = sharding.replicated(mesh)
    prompt = jax.ShapeDtypeStruct((1, P), jnp.int32, sharding=rep)  # the largest prompt bucket
    table = jax.ShapeDtypeStruct((1, W // PAGE), jnp.int32, sharding=rep)
    adapter, start, size = (_scalar(jnp.int32, mesh) for _ in range(3))
    seen = jax.ShapeDtypeStruct((1, cfg.vocab_size), jnp.bool_, sharding=rep)
    mask = jax.ShapeDtypeStruct((1, -(-cfg.vocab_size // 32)), jnp.int32, sharding=rep)
    where = f"{_weights(quantize)}" + (f", over {n} devices (SERVE_RULES)" if n > 1 else "")
    prefill = Program(
        "serve.prefill", progs["prefill"],
        (step, state, table, adapter, prompt, start, size, rows, seen, mask),
        {"max_k": 256}, n, flops_per_token(cfg, W)["forward"] * P, {"parameters": param_bytes},
        f"prompt chunk {P} into a window of {W}{where}", mesh=mesh,
    )  # fmt: skip
    stop = jax.ShapeDtypeStruct((slots,), jnp.bool_, sharding=sharding.row_shardings(state.done_B, mesh))
    # KV bytes one slot's whole window takes (the pool's pages over its page count), as /metrics'
    # flaxgpt_kv_bytes_per_slot says of the running server: what one more slot costs
    shapes = jax.eval_shape(pool).inner  # shapes only: the pool of an 8B model is gigabytes
    kv = [*shapes.k, *shapes.v]
    slot_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in kv) // kv[0].shape[1] * (W // PAGE)
    generate = Program(
        "serve.generate", progs["generate"], (step, state, stop),
        {"chunk": chunk, "max_k": 256, "logprobs": True}, n,
        flops_per_token(cfg, W)["forward"] * slots * chunk, {"parameters": param_bytes},
        f"{slots} slots x window {W} in pages of {PAGE} ({impl}), KV {slot_bytes / 2**20:.1f} MiB a slot"
        f"{where}, {chunk} tokens per call",
        chunk * (param_bytes + per_device_bytes(state.cache)), mesh=mesh,
    )  # fmt: skip
    if not speculative_tokens:
        return [prefill, generate]
    K = speculative_tokens  # serve.py --speculative_ngram K / --draft: K drafts and the step's own token
    drafts = jax.ShapeDtypeStruct((slots, K), jnp.int32, sharding=sharding.row_shardings(state.last_B, mesh))
    n = jax.ShapeDtypeStruct((slots,), jnp.int32, sharding=sharding.row_shardings(state.last_B, mesh))
    speculate = Program(
        "serve.speculate", progs["speculate"], (step, state, stop, drafts, n), {"max_k": 256}, len(devices),
        flops_per_token(cfg, W)["forward"] * slots * (K + 1), {"parameters": param_bytes},
        f"{slots} slots x {K + 1} positions (the pending token and {K} drafts){where}",
        param_bytes + per_device_bytes(state.cache), mesh=mesh,
    )  # fmt: skip
    return [prefill, generate, speculate]


def rollout_programs(config, mc, devices, separate: bool = False) -> list[Program]:
    """GRPO's rollouts (data.format = prompts, grpo.rollout = engine) as train.grpo_rollout runs them:
    the engine's prefill (a whole window's prompt) and generate step, batch_size slots (a step's
    completions), a window of block_size, over the policy's weights: the parameters, or with LoRA the
    base with the adapters merged (grpo_rollout.merged: a float32 base; the engine holds the base and
    the merged copy) or the base in lora.base_dtype and the adapters unmerged (models.lora.step_fn).
    Over one process's devices of the training mesh (grpo_online.Rollouts._engine_over), or the
    engine's own (`separate`: grpo.engine_devices): the weights placed by SERVE_RULES, the slots by
    rows. The generate step's note says what crosses between trainer and engine each step (`traffic`)."""
    s = sections.of(config)
    lora_on = bool(s.lora.rank)
    # as the trainer runs them: one engine a process, over that process's devices (process 0's here),
    # slots for that process's share of a step's completions
    processes = len({d.process_index for d in devices})
    devices = grpo_rollout.engine_devices(devices, devices[0].process_index)
    replicas, slots = int(s.grpo.engine_replicas), max(config.batch_size // processes, 1)
    holders = len(devices)  # the devices the pushed weights go to
    if replicas > 1:  # grpo_rollout.Replicas: the programs of one device's replicas, their slots together
        per_device = -(-replicas // len(devices))
        devices, slots, holders = devices[:1], per_device * -(-slots // replicas), min(replicas, len(devices))
    cfg, step, mesh, param_bytes = _decoding(mc, devices)
    merged = False
    if lora_on:  # the GRPO task's policy (train.policy.LoraPolicy) over the decoding config
        pol = policy.make_policy(config, cfg)
        boxed = gpt.abstract_params(cfg)
        base = policy.ABSTRACT.run(pol.base, nn.unbox(boxed))  # in lora.base_dtype
        serve = sharding.param_shardings(boxed, mesh, sharding.SERVE_RULES)
        base = sharding.shapes_on(base, lora.base_shardings(serve, base))
        adapters = sharding.shapes_on(pol.abstract_params(), sharding.replicated(mesh))
        merged = grpo_rollout.merged(pol, s.grpo.merge_lora)
        if merged:  # the decoding program is the plain parameters' (_decoding's); the base stays too
            param_bytes += per_device_bytes(base)
        else:
            step = lora.step_fn(cfg, pol.lora, base, adapters)
            param_bytes = per_device_bytes((base, adapters))
    W, chunk = cfg.block_size, min(s.grpo.max_completion_length, grpo_rollout.CHUNK)
    progs = serve_programs(
        mc, devices, slots=slots, max_len=W, chunk=chunk, prefill_chunk=W,
        decoding=(cfg, step, mesh, param_bytes),
    )  # fmt: skip
    what = "the parameters"
    if lora_on:
        what = f"LoRA r {s.lora.rank} {'merged into' if merged else 'over'} a {s.lora.base_dtype} base"
    # what each rollout receives: the adapters, or the parameters (replicas: the merged ones too)
    adapters_sent = lora_on and not (merged and replicas > 1)
    pushed = adapters if adapters_sent else nn.unbox(gpt.abstract_params(cfg))
    sent = traffic(config, mc, pushed, adapters_sent, holders, separate, whole=replicas > 1)
    if replicas > 1:
        what += f"; {replicas} replicas over {holders} device{'s' * (holders > 1)}, {per_device} a device"
    return [
        dataclasses.replace(
            p,
            name=p.name.replace("serve.", "rollout."),
            note=f"{p.note}; {what}" + (f"; {sent}" if p.name == "serve.generate" else ""),
        )
        for p in progs
    ]


def traffic(
    config, mc, pushed, lora_on: bool, engine_devices: int, separate: bool, whole: bool = False
) -> str:
    """What crosses between the trainer and the engine each GRPO step: the trained weights pushed to
    the engine (LoRA's adapters whole on each engine device; full fine-tuning's parameters split by
    SERVE_RULES; `whole`: grpo.engine_replicas, whole on each replica's device), and the rollouts
    back (the step's batch_size rows of prompt + completion tokens and their per-token fields,
    through the host: grpo_task's batch)."""
    w = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(pushed))
    copies = engine_devices if lora_on or whole else 1  # replicated: each device receives them all
    task = Task.abstract(config, mc)
    shapes = task.batch_shapes(config.batch_size)
    rows, T = shapes["inputs"][0]
    batch = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in shapes.values())
    where = f"to the engine's own {engine_devices} devices" if separate else "to the engine (same devices)"
    weights = "LoRA adapters" if lora_on else "parameters"
    return (
        f"each step {weights} {w:,} bytes x {copies} {where}, rollouts back {rows} rows x {T} tokens "
        f"({rows * T:,} tokens; {batch:,} bytes with masks, advantages and log-probs)"
    )


def build(
    config, devices, groups=GROUPS, mc=None, slots: int = 8, max_len: int = 0, quantize=None, serve_devices=1,
    speculative_tokens: int = 0,
) -> list[Program]:  # fmt: skip
    """The programs of `groups` for `config` on `devices` (sample and serve: GPT models only, with
    `quantize` int8 / bf16 weights; serve over the first `serve_devices` devices, with the speculative
    step checking `speculative_tokens` drafts per slot when > 0)."""
    mc = mc if mc is not None else model_config(config)[0]
    s = sections.of(config)
    grpo = s.data.format == "prompts" and s.grpo.rollout == "engine"
    trainer = engine = devices  # grpo.engine_devices: the engine's own, the trainer's mesh the rest
    if grpo and s.grpo.engine_devices:
        trainer, engine = grpo_rollout.split_devices(devices, s.grpo.engine_devices)
    # the training batch and mesh are the train / eval programs' alone (--programs serve ignores them)
    out = train_programs(config, mc, trainer, groups) if {"train", "eval"} & set(groups) else []
    if models.kind_of(mc) == "gpt":
        if "sample" in groups:
            out += sample_programs(mc, devices, quantize=quantize)
        if "serve" in groups:
            if not 1 <= serve_devices <= len(devices):
                raise ValueError(f"--serve_devices {serve_devices} must be in [1, {len(devices)}]")
            out += serve_programs(
                mc,
                devices[:serve_devices],
                slots,
                max_len,
                quantize=quantize,
                speculative_tokens=speculative_tokens,
            )
        if "rollout" in groups and grpo:
            out += rollout_programs(config, mc, engine, separate=engine is not devices)
    return out
