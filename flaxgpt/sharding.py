"""Device mesh, the logical-axis rules table, and shardings for parameters, state and batches.

Parameters carry logical axis names (layers.py: vocab, embed, heads, mlp, layers). One table maps
them onto the mesh axes ("data", "fsdp"): with fsdp > 1, every "embed" axis is split over the
fsdp devices (ZeRO-3: parameters, gradients and optimizer state sharded, gathered per layer by
XLA); everything else is replicated. Batches are split over all devices on their batch axis.
SERVE_RULES place the weights for decoding over several devices (the MLP and vocabulary split).
A mixture of experts may add an "expert" axis (make_mesh(..., expert=n)): the stacked expert weights
are split over it by their "expert" axis, and each token visits the devices of its experts
(models/moe.py: expert_parallel); rules_for(mesh) is the table for such a mesh.
A "context" axis (make_mesh(..., context=n), innermost) splits every sequence: the activations'
"length" axis is split over it (rules_for), batches' rows over the other axes, and attention runs
over it (models/context_attention.py: ring or Ulysses).
Loading weights goes through one seam, Placement: every loader puts each leaf from host memory with
it, whole onto the default device (Placement()) or straight into a mesh's slices (`put`).

May import: nothing of flaxgpt.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp")
EXPERT_AXIS = "expert"  # the third axis of a mesh that splits a mixture of experts' experts
CONTEXT_AXIS = "context"  # the last axis of a mesh that splits sequences (models/context_attention.py)
BATCH_AXES = ("data", "fsdp")  # the batch is split over every device (but a context axis's)
LOGICAL_RULES = (
    ("batch", BATCH_AXES),
    ("length", None),  # activations' sequence axis: over "context" where the mesh has one (rules_for)
    ("embed", "fsdp"),
    ("vocab", None),
    ("heads", None),
    ("mlp", None),
    ("expert", None),  # stacked expert weights [E, ...] (models/moe.py): whole on each device
    ("layers", None),
)

# Decoding over several devices (the serving engine's Engine(mesh=...), traced under these rules):
# FSDP's "embed" split would all-gather every weight for every token (Llama-3-8B on a v5e-8: 8.3 GB
# of temporaries per chip), so the MLP and the vocabulary (~80% of a Llama's weights) are split on
# their own axes instead (Megatron-style: mostly activations, [slots, D], move) and the attention
# weights stay whole on each device. Activations are not pinned to rows (XLA splits them as the
# weights ask); the KV cache is split by slots (row_shardings), each device attending its own.
SERVE_RULES = (
    ("batch", None),
    ("length", None),
    ("embed", None),
    ("vocab", "fsdp"),
    ("heads", None),
    ("mlp", "fsdp"),
    ("expert", None),
    ("layers", None),
)


def put(x, sharding=None) -> jax.Array:
    """A host array onto devices: whole onto the default device (sharding None: one device), else
    straight into `sharding`'s slices, each device receiving only its own (a weight split 8 ways puts
    an eighth on each device, never the whole on any one)."""
    if sharding is None:
        return jax.device_put(x)
    return jax.make_array_from_callback(np.shape(x), sharding, lambda index: x[index])


class Placement:
    """Where a model's weights go as they load, leaf by leaf from host memory: whole onto the default
    device (`Placement()`, what one device does), or split over `mesh` by a logical-axis `rules` table
    (serving: SERVE_RULES), each device receiving only its slices. Every loader takes one
    (flaxgpt.loader: Hugging Face files, run directories, random weights)."""

    def __init__(self, mesh: Mesh | None = None, rules=SERVE_RULES):
        self.mesh, self.rules = mesh, rules

    def shardings(self, abstract_boxed_params):
        """The (unboxed) parameter tree's NamedShardings, None on one device; a mesh that does not
        divide a parameter's split dimension is a one-line ValueError (before any weight is read)."""
        if self.mesh is None:
            return None
        return param_shardings(abstract_boxed_params, self.mesh, self.rules)

    def putter(self, abstract_boxed_params):
        """put(path, x) -> jax.Array: the host leaf at `path` (a tuple of dict keys) of the parameters
        onto its devices. `abstract_boxed_params`: a function giving them (called over a mesh only)."""
        if self.mesh is None:
            return lambda path, x: put(x)
        shardings = self.shardings(abstract_boxed_params())
        return lambda path, x: put(x, functools.reduce(lambda t, k: t[k], path, shardings))


def configure_cpu_devices(requested: int, batch_rows: int, context: int = 1) -> int:
    """Split the CPU into several JAX devices, so data parallelism uses every core.

    Small models run faster as one single-threaded program per core than as one program whose
    every small op is split across cores. Must run before JAX starts its backends; leaves an
    explicit JAX_NUM_CPU_DEVICES / --xla_force_host_platform_device_count alone. Returns the count
    set, or 0 when nothing was changed. `requested` 0 = one device per core when the batch divides
    (context: the mesh's context axis, whose devices split rows' sequences, not rows).
    """
    import os

    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return 0
    if "JAX_NUM_CPU_DEVICES" in os.environ or xla_flags_set_cpu_devices():
        given = os.environ.get("JAX_NUM_CPU_DEVICES")
        if requested and given is not None and given != str(requested):  # it was dropped without a word
            import warnings

            warnings.warn(
                f"mesh.cpu_devices={requested} gives way to JAX_NUM_CPU_DEVICES={given} (the environment's "
                "count); unset the variable to split the CPU as the config says",
                stacklevel=2,
            )
        if given != "1":  # the user's count of several devices
            patient_cpu_collectives()
        return 0
    if requested == 1:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = requested if requested > 1 else cpu_device_count(cores, batch_rows, context)
    if n > 1:
        jax.config.update("jax_num_cpu_devices", n)
        patient_cpu_collectives()
    return n if n > 1 else 0


CPU_COLLECTIVE_PATIENCE_S = 600


def patient_cpu_collectives() -> None:
    """Simulated CPU devices are threads of one process that meet at every collective, and XLA:CPU
    ends the process when one arrives over a minute after the others (a warning after 20 s, then
    --xla_cpu_collective_call_terminate_timeout_seconds, 40 by default): a busy machine does that (the
    CPU recipe died so at step 2000 with load 20 on 2 cores). Ten minutes more, unless XLA_FLAGS says
    otherwise; set before the backend starts (XLA reads its flags then)."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_collective_call_terminate_timeout_seconds" not in flags:
        flag = f"--xla_cpu_collective_call_terminate_timeout_seconds={CPU_COLLECTIVE_PATIENCE_S}"
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def xla_flags_set_cpu_devices() -> bool:
    """XLA_FLAGS names the CPU device count (--xla_force_host_platform_device_count), which wins over
    jax_num_cpu_devices."""
    import os

    return "device_count" in os.environ.get("XLA_FLAGS", "")


def cpu_device_count(cores: int, batch_rows: int, context: int = 1) -> int:
    """The most devices, at most one per core, that split the batch evenly: groups of `context`
    devices, each group some rows (a context axis needs its devices, whatever the cores)."""
    groups = max(d for d in range(1, max(cores // context, 1) + 1) if batch_rows % d == 0)
    return groups * context


def make_mesh(data: int = -1, fsdp: int = 1, devices=None, expert: int = 1, context: int = 1) -> Mesh:
    """A ("data", "fsdp") mesh over `devices` (default: all); -1 on one axis means the rest. With
    expert > 1, a ("data", "fsdp", "expert") mesh: data x fsdp groups of `expert` devices. With
    context > 1, a last "context" axis: groups of `context` neighbouring devices, each splitting the
    sequences of the rows the group holds (the ring's traffic stays between neighbours)."""
    devices = list(jax.devices() if devices is None else devices)
    if context != 1:
        if context < 1 or len(devices) % context:
            raise ValueError(f"mesh.context {context} does not divide the {len(devices)} devices")
        groups = make_mesh(data, fsdp, devices[: len(devices) // context], expert=expert)
        shape = (*groups.devices.shape, context)
        return Mesh(np.asarray(devices).reshape(shape), (*groups.axis_names, CONTEXT_AXIS))
    if expert != 1:
        if expert < 1 or len(devices) % expert:
            raise ValueError(f"mesh.expert {expert} does not divide the {len(devices)} devices")
        groups = make_mesh(data, fsdp, devices[: len(devices) // expert])
        shape = (*groups.devices.shape, expert)
        return Mesh(np.asarray(devices).reshape(shape), (*MESH_AXES, EXPERT_AXIS))
    n = len(devices)
    if data == -1 and fsdp == -1:
        raise ValueError("only one of mesh.data and mesh.fsdp may be -1")
    if fsdp == -1:
        fsdp = n // data if data > 0 and n % data == 0 else -1
    if data == -1:
        data = n // fsdp if fsdp > 0 and n % fsdp == 0 else -1
    if data < 1 or fsdp < 1 or data * fsdp != n:
        raise ValueError(
            f"mesh.data x mesh.fsdp must equal the {n} devices, got {data} x {fsdp}; "
            "set one of them to -1 to use the rest"
        )
    return Mesh(np.asarray(devices).reshape(data, fsdp), MESH_AXES)


def check_context_in_processes(mesh) -> None:
    """Each process loads whole rows (data.batches.to_global), so the devices that split one row's
    sequence (a context group) must all be one process's; a group across processes fails on the first
    batch with jax's "Invalid host data". One line naming the fix instead."""
    if CONTEXT_AXIS not in mesh.axis_names:
        return
    groups = np.moveaxis(mesh.devices, mesh.axis_names.index(CONTEXT_AXIS), -1)
    spread = max(len({d.process_index for d in group}) for group in groups.reshape(-1, groups.shape[-1]))
    if spread > 1:
        local = sum(d.process_index == 0 for d in mesh.devices.flat)  # a process's devices
        raise ValueError(
            f"mesh.context {groups.shape[-1]} splits a row's sequence over devices of {spread} processes; "
            f"keep each context group inside one process: mesh.context <= its {local} devices (1 where "
            "a process drives one GPU), or one process a host with all of its devices"
        )


def batch_axes(mesh) -> tuple:
    """The mesh axes a batch's rows are split over: all but a context axis (which splits sequences)."""
    return tuple(a for a in mesh.axis_names if a != CONTEXT_AXIS)


def batch_devices(mesh) -> int:
    """How many ways a batch's rows are split (the devices of `batch_axes`)."""
    return int(np.prod([mesh.shape[a] for a in batch_axes(mesh)]))


def rules_for(mesh, rules=LOGICAL_RULES):
    """`rules` for `mesh`: as they are, or for a mesh with an "expert" axis, rows split over it too
    and expert weights split by it; with a "context" axis, the activations' tokens ("length") split
    over it (rows never are)."""
    table = {}
    if EXPERT_AXIS in mesh.axis_names:
        table.update({"batch": batch_axes(mesh), "expert": EXPERT_AXIS})
    if CONTEXT_AXIS in mesh.axis_names:
        table["length"] = CONTEXT_AXIS
    return tuple((name, table.get(name, axes)) for name, axes in rules)


def under_mesh(fn, mesh: Mesh, rules=LOGICAL_RULES):
    """fn, traced with `mesh` as the mesh context (jax.sharding.use_abstract_mesh inside the jit)
    and `rules` as flax's axis rules (LOGICAL_RULES; decoding: SERVE_RULES): attention_impl="auto"
    and the Pallas kernel then see the devices the program is compiled for (flaxgpt.kernels.target)
    and split per device, and the model's activation constraints (LOGICAL_RULES: rows over every
    device, gpt.Block) apply, whoever calls or compiles the step."""

    @functools.wraps(fn)  # jit reads fn's signature through it (static and donated argument names)
    def traced(*args, **kwargs):
        with (
            jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
            nn.logical_axis_rules(rules_for(mesh, rules)),
        ):
            return fn(*args, **kwargs)

    return traced


def batch_sharding(mesh: Mesh, leading_axes: int = 0, ndim: int = 0) -> NamedSharding:
    """Rows split over every device but a context axis's; `leading_axes` unsplit axes before them
    (micro-batches). For an array of `ndim` axes with a length axis after the rows (token ids,
    targets, masks, segment ids: [..., B, T]), that axis split over a context axis as the
    activations' "length" is (contiguous chunks: the ring's balanced layout is its own, inside
    attention), so no device holds a sequence's ids whole."""
    rows = (*([None] * leading_axes), batch_axes(mesh))
    if CONTEXT_AXIS in mesh.axis_names and ndim > leading_axes + 1:
        return NamedSharding(mesh, PartitionSpec(*rows, CONTEXT_AXIS))
    return NamedSharding(mesh, PartitionSpec(*rows))


def batch_shardings(mesh: Mesh, leading_axes: int = 0):
    """A batch's sharding for each leaf, by its number of axes: ndim -> batch_sharding (what Steps
    holds, data.batches.to_global places host rows with and flaxgpt aot compiles with)."""
    return functools.partial(batch_sharding, mesh, leading_axes)


def row_shardings(tree, mesh: Mesh):
    """A sharding per leaf of `tree` (arrays or ShapeDtypeStructs): its rows (axis 0) split over every
    device where they divide, else replicated. The serving engine's caches ([slots * heads, S, K]:
    slots, or heads of a one-row cache) and per-slot arrays, as the model's activations are split."""
    rows, rep = batch_sharding(mesh), replicated(mesh)
    n = batch_devices(mesh)
    return jax.tree.map(lambda x: rows if x.ndim and x.shape[0] % n == 0 else rep, tree)


def shapes_on(tree, shardings):
    """ShapeDtypeStructs of `tree` (arrays or shapes) placed by `shardings` (one sharding for every
    leaf, or a matching tree): the abstract arguments flaxgpt aot compiles with."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_batch(batch_rows: int, mesh: Mesh, what: str = "batch_size") -> None:
    n = batch_devices(mesh)
    if batch_rows % n:
        raise ValueError(
            f"{what} {batch_rows} is not divisible by the {n} data-parallel devices "
            f"(mesh {dict(mesh.shape)}); use a multiple of {n}"
        )


def param_shardings(abstract_boxed_params, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedShardings for the (unboxed) parameter tree, from the boxed abstract parameters."""
    specs = nn.get_partition_spec(abstract_boxed_params)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, rules_for(mesh, rules))
    _check_divisible(nn.unbox(abstract_boxed_params), shardings, mesh)
    return shardings


class IndivisibleError(ValueError):
    """A parameter dimension the mesh axes splitting it do not divide (one line; its fields let an
    entry point name its own flag)."""

    def __init__(self, parameter: str, dim: int, devices: int, axes: tuple):
        self.parameter, self.dim, self.devices, self.axes = parameter, dim, devices, axes
        flag = "expert" if EXPERT_AXIS in axes else "fsdp"
        super().__init__(
            f"parameter {parameter} dim {dim} is not divisible by the {devices} devices of mesh axes "
            f"{axes}; choose mesh.{flag} dividing the model dims"
        )


def _check_divisible(abstract_params, shardings, mesh: Mesh) -> None:
    flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    for (path, leaf), sharding in zip(flat, jax.tree_util.tree_leaves(shardings)):
        for dim, axes in zip(leaf.shape, sharding.spec):
            axes = (axes,) if isinstance(axes, str) else (axes or ())
            size = int(np.prod([mesh.shape[a] for a in axes]))
            if dim % size:
                raise IndivisibleError(jax.tree_util.keystr(path), dim, size, axes)


def state_shardings(abstract_state, params_abstract, params_shardings, mesh: Mesh):
    """Shardings for a whole train state: any subtree shaped like the parameters (the params
    themselves, Adam's mu and nu) gets the parameter shardings; everything else is replicated.
    A subtree shaped like the parameters with some leaves masked out (optax.partition's groups:
    Muon's momentum covers only the hidden matrices) gets the shardings of the leaves it has."""
    params_def = jax.tree_util.tree_structure(params_abstract)
    masked = optax.transforms.MaskedNode
    is_masked = lambda x: isinstance(x, masked)  # noqa: E731

    def is_params_like(x):
        try:
            return jax.tree_util.tree_structure(x, is_leaf=is_masked) == params_def
        except Exception:
            return False

    def params_like_shardings(x):
        return jax.tree_util.tree_map(
            lambda leaf, s: leaf if is_masked(leaf) else s, x, params_shardings, is_leaf=is_masked
        )

    rep = replicated(mesh)
    return jax.tree_util.tree_map(
        lambda x: params_like_shardings(x) if is_params_like(x) else rep,
        abstract_state,
        is_leaf=lambda x: is_params_like(x),
    )
