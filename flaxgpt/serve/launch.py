"""What serve.py builds before the HTTP layer starts: the model (a run, pretrained weights or a preset's
random weights) and an engine thread over it, on one device or over a mesh (serving_mesh: the weights
split by sharding.SERVE_RULES as they load, the KV cache by slots). On a job of several processes
(`flaxgpt.cluster.join`) the mesh spans all their devices: process 0 serves, the others replay its
engine calls (`follows`, serve/replay.py). The HTTP layer (server.py) never imports a model."""

from __future__ import annotations

from flaxgpt.serve.scheduler import Scheduler


def load(
    out_dir=None,
    init_from=None,
    *,
    step=None,
    dtype="float32",
    random_init=False,
    quantize=None,
    adapter=None,
    mesh=None,
):
    """-> (Run, model name) from a run directory, pretrained weights (flaxgpt.load), or a preset's
    random weights; `dtype` and `quantize` ("int8" | "bf16") as flaxgpt.load (cast, then quantize);
    `adapter`: a PEFT LoRA directory merged into init_from's weights (a LoRA run merges its own);
    `mesh` (serving_mesh): each weight loaded straight into its devices' slices by SERVE_RULES."""
    from pathlib import Path

    from flaxgpt import loader, sharding

    dtype = None if dtype == "float32" else dtype
    place = sharding.Placement(mesh, sharding.SERVE_RULES) if mesh is not None else None
    try:
        if random_init:  # random weights of a preset's shape: load tests without a download
            return loader.init(init_from, dtype=dtype, quantize=quantize, place=place), init_from
        if not init_from:
            loader.require_run(out_dir)
        source = init_from or out_dir
        run = loader.load(source, step=step, dtype=dtype, quantize=quantize, adapter=adapter, place=place)
    except sharding.IndivisibleError as e:
        raise ValueError(
            f"--mesh {e.devices} does not divide this model: {e.parameter} has {e.dim} along the axis "
            f"serving splits (MLP hidden size, vocabulary); serve it over a --mesh that divides {e.dim}"
        ) from None
    if run.kind != "gpt":
        raise SystemExit(f"error: {source} holds a {run.kind!r} model; the server serves GPT models")
    return run, Path(init_from).name if init_from else Path(out_dir).resolve().name


def scheduler_for(
    config,
    params,
    tokenizer,
    *,
    slots=8,
    max_len=None,
    chunk=4,
    max_queue=64,
    max_tokens=None,
    prefill_chunk=None,
    max_num_batched_tokens=None,
    prefix_cache_tokens=0,
    prefix_block=16,
    adapters=(),
    max_adapters=0,
    max_lora_rank=16,
    adapter_root=None,
    max_cpu_adapters=None,
    mesh=None,
    speculate=0,
    draft=None,
    mixed=0,
) -> Scheduler:
    """The engine (a window of max_len, default block_size, in pages of prefix_block positions) and its
    thread, not started. prefill_chunk: prompt tokens per prefill call (None: a whole prompt);
    max_num_batched_tokens: the scheduler's token budget a turn; prefix_cache_tokens: the prefix
    cache's budget in positions (0: off), rounded down to pages.
    adapters: (name, directory) LoRA adapters served unmerged (a PEFT directory or a LoRA run), with
    max_adapters of them resident at once, each of rank <= max_lora_rank (max_adapters 0: no adapters,
    none loadable later); the scheduler's `adapters` is then their AdapterPool. adapter_root: the one
    directory clients may load adapters from at run time (None: runtime loads and unloads refused);
    max_cpu_adapters: adapters kept in host memory (None: all; the rest read again when requested).
    mesh (serving_mesh, params placed over it by `load`): the engine's programs run over its devices.
    speculate: drafted tokens checked per step for greedy requests (0: off), by prompt lookup
    (serve/ngram.py) or, with draft = (config, params) of a smaller model with the same vocabulary,
    by that model (its own page pool over the same block tables; it drafts for adapters' rows too).
    mixed: the most prompt tokens a request's last part may run in a decode step (serve/mixed.py; 0: off).
    Every pair composes: adapters with the prefix cache (its blocks hashed with the adapter), with a
    mesh, over int8 / bf16 weights; chunked prefill with all of them."""
    from flaxgpt.models import gpt
    from flaxgpt.serve.engine import Engine

    W = min(max_len or config.block_size, config.block_size)
    kw = dict(
        slots=slots, max_len=W, chunk=chunk, prefill_chunk=prefill_chunk, page=prefix_block,
        prefix_blocks=prefix_cache_tokens // prefix_block, mesh=mesh, speculate=speculate, mixed=mixed,
        draft=None if draft is None else (gpt.step_fn(*draft), draft[0]),
    )  # fmt: skip
    sched_kw = dict(max_queue=max_queue, max_tokens=max_tokens, max_num_batched_tokens=max_num_batched_tokens)
    if max_adapters:
        pool_kw = dict(runtime_root=adapter_root, max_host=max_cpu_adapters)
        return _with_adapters(
            config, params, tokenizer, adapters, max_adapters, max_lora_rank, mesh, kw, sched_kw, pool_kw
        )
    engine = Engine(gpt.step_fn(config, params), config, **kw)
    return Scheduler(engine, tokenizer, **sched_kw)


def check_replayable(*, max_adapters=0, allow_runtime_lora=False, processes=1) -> None:
    """What several processes cannot serve yet, in one line: LoRA adapters (their weights are written
    into the engine's stack by process 0's adapter pool, which the other processes do not have)."""
    if processes > 1 and (max_adapters or allow_runtime_lora):
        raise ValueError(
            "LoRA adapters (--adapter NAME=DIR, --max_adapters, --allow_runtime_lora) are served by one "
            f"process, not by a job of {processes}: merge the adapter into the weights (--adapter DIR), "
            "or serve adapters from a one-process server per host (docs/serving_ops.md)"
        )


def follows(sched) -> bool:
    """On a job of several processes: process 0's scheduler drives its engine through a replay.Leader
    (each engine call broadcast first) -> False; any other process replays those calls on its own
    engine (replay.follow) until process 0 stops -> True (then exit). One process: False, unchanged."""
    import jax

    if jax.process_count() == 1:
        return False
    from flaxgpt.serve import replay

    if jax.process_index() == 0:
        sched.engine = replay.Leader(sched.engine)
        return False
    replay.follow(sched.engine)
    return True


def stop_followers(sched) -> None:
    """Process 0, its scheduler closed: the other processes' `follow` returns (a stop plan)."""
    if hasattr(type(sched.engine), "stop"):
        sched.engine.stop()


def serving_mesh(devices: int, slots: int):
    """serve.py --mesh N: the (data 1, fsdp N) mesh over the first N devices, the one `flaxgpt aot
    --serve_devices N` compiles for; None for N = 1 (one device). A one-line ValueError when this
    machine has fewer devices or the slots do not split evenly over them."""
    import jax

    from flaxgpt import sharding

    have = jax.devices()  # over a job of several processes: every process's devices
    if jax.process_count() > 1 and devices != len(have):  # each process runs the engine's programs
        raise ValueError(
            f"--mesh {devices} on a job of {jax.process_count()} processes with {len(have)} devices in "
            f"all: serve over every device of the job, --mesh {len(have)}"
        )
    if devices == 1:
        return None
    if devices < 1 or devices > len(have):
        raise ValueError(
            f"--mesh {devices} asks for {devices} devices; this {jax.default_backend()} backend has "
            f"{len(have)}: use --mesh 1..{len(have)}"
        )
    if slots % devices:  # else row_shardings would keep a whole copy of the cache on every device
        raise ValueError(
            f"--slots {slots} is not divisible by --mesh {devices}: each device holds its own slots' "
            f"KV cache; use a multiple of {devices}"
        )
    return sharding.make_mesh(1, devices, have[:devices])


def _with_adapters(config, params, tokenizer, adapters, max_adapters, rank, mesh, kw, sched_kw, pool_kw):
    """The engine over models.multi_lora's step (max_adapters + 1 slots: 0 is the base) and an
    AdapterPool whose writes go into its stack, the named adapters loaded (on the host)."""
    import jax
    import numpy as np

    from flaxgpt import loader, sharding
    from flaxgpt.models.multi_lora import MultiLora
    from flaxgpt.serve.adapters import AdapterPool
    from flaxgpt.serve.engine import Engine

    multi = MultiLora(config, params, slots=max_adapters + 1, rank=rank)
    stack = [multi.empty_stack()]  # the resident adapters: written in place, the engine's step over it
    if mesh is not None:  # every device reads every adapter (they are small beside the weights)
        stack[0] = jax.device_put(stack[0], sharding.replicated(mesh))
    zeros = jax.tree_util.tree_map(lambda x_S: np.zeros(x_S.shape[1:], np.float32), stack[0])
    engine = Engine(multi.step_fn(stack[0]), config, **kw)

    def read(path):
        spec, tree = loader.load_adapter(str(path), config)
        return multi.slot_weights(spec, tree, what=str(path))

    def write(slot, weights):  # the engine thread, between steps: the old stack's buffers are donated
        stack[0] = multi.write(stack[0], slot, weights)
        engine.step_fn = multi.step_fn(stack[0])

    write(1, zeros)  # compiled now, not at the first swap
    pool = AdapterPool(read, write, slots=max_adapters + 1, **pool_kw)
    for name, path in adapters:
        pool.load(name, path)
    return Scheduler(engine, tokenizer, adapters=pool, **sched_kw)
