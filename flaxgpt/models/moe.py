"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE) and its router losses.

    y_BTD = MoE(config)(x_BTD)              # a sparse layer's MLP (gpt.Block picks it per layer)
    logits, state = gpt.GPT(config).apply(v, tokens, mutable=["router"])
    aux, z = router_losses(state["router"], config.num_experts)

A softmax router scores E experts per token and each token goes to its top k; the k weights are
renormalised to sum to 1 when `norm_topk_prob` (Mixtral always; Qwen3-MoE by its flag). Dropless:
the N*k (token, expert) assignments are sorted by expert and each expert's contiguous run of rows is
one group of a grouped matmul (`grouped_matmul`), so an expert computes only its own tokens and no
token is dropped for capacity (on the CPU a decoding batch's few tokens instead go through every
expert, whose weights they would read anyway: `mix_experts`). Expert weights are stacked [E, ...]
(logical axis "expert"); on a mesh with an "expert" axis they are split over it and the tokens visit
their experts' devices (`expert_parallel`). Qwen2-MoE adds a shared expert, a dense MLP every token
goes through, its output scaled per token by sigmoid(x . w) (`shared_gate`), to the routed experts'
sum. With `fp8` (GPTConfig.fp8) the shared expert's dense MLP is float8, and with `fp8_experts`
(GPTConfig.fp8_experts, opt-in) the sorted path's expert products too (kernels.fp8's fp8_grouped over
the tiled form, `tiled_weight_grad` its dW); decoding's few tokens keep the compute dtype.

Each sparse layer sows into the "router" collection what the losses need: the fraction of the
assignments each expert got and its mean router probability (transformers' load_balancing_loss_func
averages both over the layers before multiplying them), and the mean squared logsumexp of the router
logits (ST-MoE's z-loss).

Shape letters: N tokens (B*T), D model dim, E experts, C experts per token (top-k),
A = N*C assignments, F each expert's hidden size, S adapter slots of rank R, P = S*R (or an adapter's
rank r), X any rows (see layers.py for the rest).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from flaxgpt.kernels import pallas_grouped
from flaxgpt.kernels.fp8 import fp8_grouped
from flaxgpt.models.layers import MLP, Dtype, activation_fn, normal_init, swiglu
from flaxgpt.models.linear import ROWS, Linear
from flaxgpt.models.quantize import QuantizedWeight

ROUTER = "router"  # the collection the sparse layers sow their statistics into
# LoRA's expert targets -> the stacked weight each adapts: an [E, ...] adapter pair a stack (models/lora.py)
EXPERT_PARAMS = {"experts_gate_up": "experts_fc", "experts_up": "experts_fc", "experts_down": "experts_proj"}


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["w", "a", "b"], meta_fields=["scale", "slots"]
)
@dataclasses.dataclass(frozen=True)
class LoraExperts:
    """A stacked expert weight with a LoRA adapter per expert: expert e computes
    x @ w[e] + scale * (x @ a[e]) @ b[e], w [E, K, N] (float or quantized), a [E, K, r], b [E, r, N]
    (float32, as every flaxgpt adapter). The low-rank product is never formed: two more grouped
    matmuls of r columns (PEFT's target_parameters LoRA gives the same output by W + s B A).

    Adapter slots (models/multi_lora.py, `slots` S > 0): a [E, K, S*R] and b [E, S*R, N] hold every
    slot's rank-R adapter side by side (scales folded into b), and each row keeps its own slot's R
    columns of x @ a[e] (`low_rank`): S times a rank-R sliver of the work, the stacks read in place
    rather than an adapter gathered per row."""

    w: jax.Array | QuantizedWeight
    a: jax.Array
    b: jax.Array
    scale: float
    slots: int = 0  # 0: one adapter; S: a slot stack, each row's slot given beside its tokens

    def low_rank(self, xa_XP, slot_X):
        """x @ a's columns [..., rows, P] as b reads them: times the scale, or (a slot stack) each
        row's own slot's R columns kept and the others zeroed; slot_X [rows] is each row's slot."""
        if not self.slots:
            return xa_XP * self.scale
        keep_XS = jax.nn.one_hot(slot_X, self.slots, dtype=xa_XP.dtype)
        return xa_XP * jnp.repeat(keep_XS, xa_XP.shape[-1] // self.slots, axis=-1)


class MoE(nn.Module):
    """Router + E expert MLPs (D -> F -> D, gated when `glu`), each token through its top C."""

    num_experts: int
    experts_per_token: int
    hidden: int
    activation: str = "silu"
    glu: bool = True
    norm_topk_prob: bool = True
    dropout: float = 0.0
    out_init_std: float = 0.02
    shared_hidden: int = 0  # a shared expert MLP every token goes through (Qwen2-MoE); 0 = none
    shared_gate: bool = False  # the shared expert's output scaled by sigmoid(x . w) per token
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    deterministic: bool = True
    lora: object = None  # models.lora.LoraSpec: the expert stacks' adapters ("lora" collection), scale
    fp8: bool = False  # the shared expert's products in float8 (GPTConfig.fp8)
    fp8_experts: bool = False  # the routed experts' grouped products in float8 (GPTConfig.fp8_experts)

    @nn.compact
    def __call__(self, x_BTD):
        E, C, F, D = self.num_experts, self.experts_per_token, self.hidden, x_BTD.shape[-1]
        x_ND = x_BTD.reshape(-1, D)
        logits_NE = Linear(
            E,
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=normal_init(0.02, ("embed", None)),
            name="router",
        )(x_ND)
        # fp32 softmax and top-k, as transformers: bf16 ties would pick different experts
        probs_NE = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
        weights_NC, experts_NC = jax.lax.top_k(probs_NE, C)
        if self.norm_topk_prob:
            weights_NC = weights_NC / jnp.sum(weights_NC, axis=-1, keepdims=True)
        self._sow_statistics(logits_NE, probs_NE, experts_NC)

        w_fc = self.param(
            "experts_fc",
            normal_init(0.02, ("expert", "embed", "mlp")),
            (E, D, 2 * F if self.glu else F),
            self.param_dtype,
        )
        w_proj = self.param(
            "experts_proj",
            normal_init(self.out_init_std, ("expert", "mlp", "embed")),
            (E, F, D),
            self.param_dtype,
        )
        # quantized stacks (models/quantize.py: int8 or bf16 decoding) stay compact until the matmul
        cast = lambda w: w if isinstance(w, QuantizedWeight) else w.astype(self.dtype)  # noqa: E731
        w_fc, w_proj = self.adapted("experts_fc", cast(w_fc)), self.adapted("experts_proj", cast(w_proj))
        if self.fp8_experts:
            self._check_fp8(w_fc, w_proj)
        slot_N = None  # each token's adapter slot: its batch row's (models/multi_lora.py)
        if self.has_variable("lora", ROWS):
            rows_B = self.get_variable("lora", ROWS)
            slot_N = jnp.repeat(rows_B, x_ND.shape[0] // rows_B.shape[0])
        args = (x_ND.astype(self.dtype), weights_NC, experts_NC, w_fc, w_proj, self._expert_mlp)
        if expert_axis_size() > 1:
            y_ND = expert_parallel(*args, slot_N, fp8=self.fp8_experts)
        else:
            y_ND = mix_experts(*args, slot_N=slot_N, fp8=self.fp8_experts)
        if self.shared_hidden:
            y_ND = y_ND + self._shared_expert(x_ND)
        y_BTD = y_ND.reshape(x_BTD.shape)
        return nn.Dropout(self.dropout)(y_BTD, deterministic=self.deterministic)

    def adapted(self, name: str, w):
        """The stacked expert weight `name` as the matmuls use it: `w` itself, or LoraExperts(w, A, B,
        scale) where the "lora" collection holds an adapter pair for it (models/lora.py lays them out),
        or where it holds adapter slots (a [S, E, K, R], b [S, E, R, N] and `rows`: multi_lora.py)
        LoraExperts with the slots side by side in the rank, experts first as the stack's own axis."""
        for t, stack in EXPERT_PARAMS.items():
            if self.lora is not None and stack == name and self.has_variable("lora", f"{t}_a"):
                a, b = (self.get_variable("lora", f"{t}_{x}") for x in "ab")
                if not self.has_variable("lora", ROWS):
                    return LoraExperts(w, a, b, self.lora.scale)
                S, E, K, R = a.shape
                a_EKP = jnp.transpose(a, (1, 2, 0, 3)).reshape(E, K, S * R)  # P = S x R, slot-major
                b_EPN = jnp.transpose(b, (1, 0, 2, 3)).reshape(E, S * R, b.shape[-1])
                return LoraExperts(w, a_EKP, b_EPN, 1.0, slots=S)  # scales are in b
        return w

    def _check_fp8(self, *stacks):
        """model.fp8_experts multiplies float stacks: a quantized or adapted one is refused, naming a fix."""
        for w in stacks:
            if isinstance(w, QuantizedWeight):
                raise ValueError(
                    f"model.fp8_experts multiplies float weights in float8, but {self.name}'s expert stacks "
                    f"are quantized ({w.w.dtype}): set model.fp8_experts=False, or lora.base_dtype=float32 "
                    "for a float base"
                )
            if isinstance(w, LoraExperts):
                raise ValueError(
                    f"model.fp8_experts has no float8 path for adapted experts ({self.name}): drop "
                    f"{'/'.join(EXPERT_PARAMS)} from lora.targets, or set model.fp8_experts=False"
                )

    def _shared_expert(self, x_ND):
        """The shared expert (a dense MLP of hidden size shared_hidden) on every token [N, D] -> [N, D],
        times sigmoid of its gate when `shared_gate`."""
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        y_ND = MLP(
            self.shared_hidden,
            activation=self.activation,
            glu=self.glu,
            use_bias=False,
            out_init_std=self.out_init_std,
            fp8=self.fp8,  # a dense MLP: its own float8 products (layers.MLP)
            name="shared_expert",
            **kw,
        )(x_ND)
        if not self.shared_gate:
            return y_ND
        gate = Linear(
            1, use_bias=False, kernel_init=normal_init(0.02, ("embed", None)), name="shared_expert_gate", **kw
        )
        # fp32 sigmoid, as the router's softmax
        return jax.nn.sigmoid(gate(x_ND).astype(jnp.float32)).astype(y_ND.dtype) * y_ND

    def _expert_mlp(self, h_AF2):
        """An expert's activation on its first matmul's output: [A, 2F] (glu) or [A, F] -> [A, F]."""
        if self.glu and self.activation == "silu":
            return swiglu(h_AF2)
        if self.glu:
            gate_AF, up_AF = jnp.split(h_AF2, 2, axis=-1)
            return activation_fn(self.activation)(gate_AF) * up_AF
        return activation_fn(self.activation)(h_AF2)

    def _sow_statistics(self, logits_NE, probs_NE, experts_NC):
        """This layer's share of the router losses (see router_losses), when "router" is mutable."""
        if not self.is_mutable_collection(ROUTER):
            return
        N, C = experts_NC.shape
        # the assignments count as transformers' histc counts them: C per token, no gradient
        counts_E = jnp.bincount(experts_NC.reshape(-1), length=self.num_experts)
        self.sow(ROUTER, "load", counts_E.astype(jnp.float32) / N)
        self.sow(ROUTER, "prob", jnp.mean(probs_NE, axis=0))
        z_N = jax.nn.logsumexp(logits_NE.astype(jnp.float32), axis=-1)
        self.sow(ROUTER, "z", jnp.mean(jnp.square(z_N)))


def mix_experts(
    x_ND, weights_NC, experts_NC, w_fc, w_proj, act, first: int | jax.Array = 0, slot_N=None, fp8=False
):
    """sum_c weights_NC[n, c] * expert_{experts_NC[n, c]}(x_ND[n]) -> [N, D], over the experts held
    here: w_fc [E_l, D, 2F or F], w_proj [E_l, F, D] (float or quantized: expert_matmul) are experts
    first .. first + E_l - 1 (all of them on one device); assignments to other experts add nothing
    (another device adds them). slot_N [N]: each token's adapter slot, where the stacks are
    LoraExperts of adapter slots (else None).

    The tokens sorted by expert into a grouped matmul (`sorted_mix`), except on CPUs and GPUs for a
    few tokens that hit about every expert anyway (decoding a batch, a prefill chunk: N * C >= E_l,
    N <= 4 E_l): there `dense_mix` reads each expert's matrices once, in place, where the sorted
    rows' gathers copy one matrix per row (batch 8, top 2, 8 experts: 16 copies of each matmul's
    weights). TPUs' ragged_dot reads each expert once itself. Compiled for h100-1, a Qwen3-30B-A3B
    prefill chunk of 128 tokens: 112.5 GB of HBM traffic dense, 391.5 GB tiled (docs/aot.md).

    fp8: the sorted path's products in float8 (expert_matmul); the dense path (decoding's few
    tokens, memory-bound) stays in the compute dtype."""
    N, C = experts_NC.shape
    E_l = experts_held(w_fc)
    if N * C < E_l or N > 4 * E_l:
        return sorted_mix(x_ND, weights_NC, experts_NC, w_fc, w_proj, act, first, slot_N, fp8)
    sorted_, dense = (lambda *a, f=f: f(*a[:5], act, *a[5:]) for f in (sorted_mix, dense_mix))
    args = (x_ND, weights_NC, experts_NC, w_fc, w_proj, jnp.asarray(first, jnp.int32), slot_N)
    return jax.lax.platform_dependent(*args, cpu=dense, cuda=dense, rocm=dense, default=sorted_)


def dense_mix(x_ND, weights_NC, experts_NC, w_fc, w_proj, act, first: int | jax.Array = 0, slot_N=None):
    """mix_experts with every token through every expert held here, each output weighted by the
    token's routing weight for that expert (0 where it did not pick it): E_l / C times the FLOPs of
    the sorted path, each expert's weights read once (a matmul batched over the stack)."""
    E_l = experts_held(w_fc)
    own_NCE = (experts_NC - first)[..., None] == jnp.arange(E_l)
    weights_NE = jnp.sum(jnp.where(own_NCE, weights_NC[..., None], 0), axis=1)
    x_END = jnp.broadcast_to(x_ND, (E_l, *x_ND.shape))
    y_END = _batched_matmul(act(_batched_matmul(x_END, w_fc, slot_N)), w_proj, slot_N)
    return jnp.einsum("end,ne->nd", y_END, weights_NE.astype(y_END.dtype))


def _batched_matmul(x_ENK, w, slot_N=None):
    """x_ENK[e] @ w[e] for every expert: float [E, K, F], or quantized (scale [E, F] per expert and
    output channel, applied to the product as expert_matmul does), or adapted (LoraExperts; slot_N
    [N] each token's slot in an adapter-slot stack)."""
    if isinstance(w, LoraExperts):
        y_ENF = _batched_matmul(x_ENK, w.w)
        xa_ENP = w.low_rank(jnp.einsum("enk,ekp->enp", x_ENK.astype(jnp.float32), w.a), slot_N)
        return y_ENF + jnp.einsum("enp,epf->enf", xa_ENP, w.b).astype(y_ENF.dtype)
    if not isinstance(w, QuantizedWeight):
        return jnp.einsum("enk,ekf->enf", x_ENK, w)
    y_ENF = jnp.einsum("enk,ekf->enf", x_ENK, w.w.astype(x_ENK.dtype))
    return y_ENF * w.scale[:, None, :].astype(y_ENF.dtype)


def sorted_mix(
    x_ND, weights_NC, experts_NC, w_fc, w_proj, act, first: int | jax.Array = 0, slot_N=None, fp8=False
):
    """mix_experts by a grouped matmul over the assignments sorted by expert (dropless)."""
    N, C = experts_NC.shape
    E_l = experts_held(w_fc)
    local_A = experts_NC.reshape(-1) - first  # this device's expert index, or out of [0, E_l)
    held_A = (local_A >= 0) & (local_A < E_l)
    # sort the assignments by expert, the ones held elsewhere last: each expert's rows are then one
    # contiguous group, and the rows past the groups belong to none (their output is dropped below)
    group_A = jnp.where(held_A, local_A, E_l)
    order_A = jnp.argsort(group_A, stable=True)
    group_sizes_E = jnp.bincount(group_A, length=E_l + 1)[:E_l].astype(jnp.int32)
    token_A = order_A // C  # the token each sorted assignment came from
    x_AD, slot_A = x_ND[token_A], None if slot_N is None else slot_N[token_A]
    expert_A = jnp.minimum(group_A[order_A], E_l - 1)  # each sorted row's expert (any, past the groups)
    h_AF = act(expert_matmul(x_AD, w_fc, group_sizes_E, expert_A, slot_A, fp8))
    y_AD = expert_matmul(h_AF, w_proj, group_sizes_E, expert_A, slot_A, fp8)
    # back to token order (a gather by the inverse permutation, not a scatter-add), then the
    # weighted sum over each token's C experts
    inverse_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(N * C))
    y_NCD = jnp.where(held_A.reshape(N, C, 1), y_AD[inverse_A].reshape(N, C, -1), 0)
    return jnp.einsum("ncd,nc->nd", y_NCD, weights_NC.astype(y_NCD.dtype))


EXPERT_AXIS = "expert"  # the mesh axis that splits the experts (flaxgpt.sharding.make_mesh)


def expert_axis_size() -> int:
    """Devices on the "expert" axis of the mesh being traced for (1: none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or EXPERT_AXIS not in mesh.axis_names else mesh.shape[EXPERT_AXIS]


def expert_parallel(x_ND, weights_NC, experts_NC, w_fc, w_proj, act, slot_N=None, fp8=False):
    """mix_experts with the experts split over the mesh's "expert" axis (E / n per device) and the
    tokens over every axis: each device gathers the tokens of its expert group (all-gather), runs
    them through its own experts only, and the partial outputs are summed back onto the devices that
    hold each token (reduce-scatter). Expert weights arrive whole in D and F (FSDP gathers them), and
    their adapters with them (split by expert: adapter slots too); a token's slot travels with it."""
    mesh = jax.sharding.get_abstract_mesh()
    n, E = mesh.shape[EXPERT_AXIS], experts_held(w_fc)
    if E % n:
        raise ValueError(f"num_experts {E} is not divisible by the {n} devices of the expert mesh axis")
    rows, experts = P(tuple(mesh.axis_names)), P(EXPERT_AXIS)

    def local(x_ND, weights_NC, experts_NC, w_fc, w_proj, slot_N):
        gather = lambda a: jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True)  # noqa: E731
        first = jax.lax.axis_index(EXPERT_AXIS) * (E // n)
        tokens = (gather(x_ND), gather(weights_NC), gather(experts_NC))
        y_ND = mix_experts(*tokens, w_fc, w_proj, act, first, gather(slot_N), fp8)
        return jax.lax.psum_scatter(y_ND, EXPERT_AXIS, scatter_dimension=0, tiled=True)

    specs = (rows, rows, rows, experts, experts, rows)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=rows)(
        x_ND, weights_NC, experts_NC, w_fc, w_proj, slot_N
    )


def experts_held(w) -> int:
    """The experts a stacked weight [E, ...] holds (float, quantized (models/quantize.py) or adapted)."""
    while isinstance(w, (QuantizedWeight, LoraExperts)):
        w = w.w
    return w.shape[0]


def expert_matmul(x_AD, w, group_sizes_E, expert_A, slot_A=None, fp8=False):
    """grouped_matmul with float weights [E, D, F] or quantized ones (quantize.QuantizedWeight: int8
    or bf16 w [E, D, F] and scale [E, F], per expert and output channel): (x @ (q * s))[a, f] is
    (x @ q)[a, f] * s[expert_A[a], f], so the scales multiply each row's output by its expert's; or
    adapted ones (LoraExperts): each row's low-rank term through the same groups, in float32 (slot_A
    [A]: each row's slot, in an adapter-slot stack).

    fp8 (float weights): kernels.fp8.fp8_grouped over the tiled form, on every platform (TPUs and
    CPUs emulate float8), except at decoding's few rows, which stay in the compute dtype
    (grouped_matmul's gathered_matmul: memory-bound, float8 would only add the casts' passes); with
    FLAXGPT_GROUPED=pallas where grouped_matmul would take gmm (one device, shapes it tiles) over
    pallas_grouped's kernels instead (float8 operands read in place, scales in their epilogues)."""
    if fp8 and not isinstance(w, (LoraExperts, QuantizedWeight)) and x_AD.shape[0] > 2 * w.shape[0]:
        fns = tiled_grouped_matmul, tiled_weight_grad
        if pallas_grouped.wanted(*x_AD.shape, w.shape[-1]):
            fns = pallas_grouped.fp8_functions(*fns)
        return fp8_grouped(x_AD, w, group_sizes_E, *fns)
    if isinstance(w, LoraExperts):
        y_AF = expert_matmul(x_AD, w.w, group_sizes_E, expert_A)
        xa_AP = w.low_rank(grouped_matmul(x_AD.astype(jnp.float32), w.a, group_sizes_E), slot_A)
        return y_AF + grouped_matmul(xa_AP, w.b, group_sizes_E).astype(y_AF.dtype)
    if not isinstance(w, QuantizedWeight):
        return grouped_matmul(x_AD, w, group_sizes_E)
    y_AF = grouped_matmul(x_AD, w.w.astype(x_AD.dtype), group_sizes_E)
    return y_AF * w.scale[expert_A].astype(y_AF.dtype)


def grouped_matmul(x_AD, w_EDF, group_sizes_E):
    """Rows sorted by group [A, D] times their group's matrix [E, D, F] -> [A, F]: rows
    starts_e .. starts_e + group_sizes_E[e] - 1 use w_EDF[e].

    TPUs lower `jax.lax.ragged_dot` to a grouped-matmul kernel. XLA on CPU has none, and neither has
    XLA on NVIDIA GPUs (jax 0.10 / the CUDA 12 plugin): both expand it to every row through every
    group's matrix, masked (E times the FLOPs; compiled for h100-8, Qwen3-30B-A3B LoRA training's
    temporaries were 449 GB a device with it, 14.9 GB without: docs/aot.md). So CPUs and GPUs run
    `tiled_grouped_matmul`, or `gathered_matmul` at decoding's few rows (the branch is chosen when
    the program is lowered). FLAXGPT_GROUPED=pallas (opt-in, one device) takes kernels.pallas_grouped's
    Triton grouped GEMM instead of the tiled form on GPUs (each expert's weights read in place, not
    gathered a visit), and on CPUs the same kernels interpreted (a check, not a speed-up), where it
    tiles the shapes and x and w share a dtype.
    """
    # decoding (batch 1, top 2: A = 2) is memory-bound: gathered_matmul reads A expert matrices, the
    # tiled pass about 2E (A = 2, E = 8: 9 visits, 4.5x the bytes), so the rows decide
    own = gathered_matmul if x_AD.shape[0] <= 2 * w_EDF.shape[0] else tiled_grouped_matmul
    cpu = cuda = own
    # the kernels where FLAXGPT_GROUPED asks and they tile (else, e.g. D or F < 16: a LoRA rank, tiled)
    wanted = pallas_grouped.wanted(*x_AD.shape, w_EDF.shape[-1])
    if wanted and own is tiled_grouped_matmul and x_AD.dtype == w_EDF.dtype:
        cpu, cuda = functools.partial(pallas_grouped.gmm, interpret=True), pallas_grouped.gmm
    return jax.lax.platform_dependent(
        x_AD, w_EDF, group_sizes_E, cpu=cpu, cuda=cuda, rocm=own, default=jax.lax.ragged_dot
    )


def gathered_matmul(x_AD, w_EDF, group_sizes_E):
    """grouped_matmul for a few rows: each row times its own group's matrix, gathered [A, D, F]
    (A matrices read, not E); rows past the groups give 0, as ragged_dot's."""
    A, E = x_AD.shape[0], w_EDF.shape[0]
    # a row's group: how many groups end at or before it (E: past them all)
    group_A = jnp.sum(jnp.cumsum(group_sizes_E)[None, :] <= jnp.arange(A)[:, None], axis=1)
    y_AF = jnp.einsum("ad,adf->af", x_AD, w_EDF[jnp.minimum(group_A, E - 1)])
    return jnp.where((group_A < E)[:, None], y_AF, 0)


def _tile_plan(A: int, group_sizes_E):
    """The visits of a tiled grouped product over A sorted rows: (b rows a tile, tiles, tile_V,
    group_V, keep_Vb): visit v multiplies tile tile_V[v] by group group_V[v]'s matrix and keeps the
    rows keep_Vb[v] marks (that group's; none for the visits past the last group's tile)."""
    b = max(1, -(-A // group_sizes_E.shape[0]))  # rows per tile
    n_tiles = -(-A // b)
    group_V, tile_V, starts_E, ends_E, used = pallas_grouped.visits(b, n_tiles, group_sizes_E)
    tile_V = jnp.clip(tile_V, 0, n_tiles - 1)
    rows_Vb = tile_V[:, None] * b + jnp.arange(b)  # each visit's row indices
    keep_Vb = (rows_Vb >= starts_E[group_V, None]) & (rows_Vb < ends_E[group_V, None])
    keep_Vb &= (jnp.arange(tile_V.shape[0]) < used)[:, None]  # visits past the last group's tile do nothing
    return b, n_tiles, tile_V, group_V, keep_Vb


def _tiles(x_AK, b: int, n_tiles: int):
    """[A, K] -> [tiles, b, K], the last tile padded with zero rows."""
    return jnp.pad(x_AK, ((0, n_tiles * b - x_AK.shape[0]), (0, 0))).reshape(n_tiles, b, -1)


def tiled_grouped_matmul(x_AD, w_EDF, group_sizes_E, scale=None, out_dtype=None):
    """grouped_matmul in tiles of b rows: each tile is multiplied by the matrix of every group it
    overlaps and keeps that group's rows. Tiles of ~A/E rows make at most (tiles + E - 1) ~ 2E visits,
    ~2A rows of work in all (the whole-matrix fallback: E*A).

    scale (float8 operands, kernels.fp8.fp8_grouped): each visit's product accumulates in float32,
    is multiplied by the scalar `scale` and cast to out_dtype before the visits are summed (a float8
    GEMM's epilogue: the visits' [V, b, F] are written in out_dtype, not float32)."""
    A, F = x_AD.shape[0], w_EDF.shape[-1]
    b, n_tiles, tile_V, group_V, keep_Vb = _tile_plan(A, group_sizes_E)
    x_VbD = _tiles(x_AD, b, n_tiles)[tile_V]
    y_VbF = _scaled("vbd,vdf->vbf", x_VbD, w_EDF[group_V], scale, out_dtype)
    y_VbF = jnp.where(keep_Vb[..., None], y_VbF, 0)
    # each row is kept by at most one visit (rows past the groups by none): the sum adds only zeros to it
    y_TbF = jnp.zeros((n_tiles, b, F), y_VbF.dtype).at[tile_V].add(y_VbF)
    return y_TbF.reshape(n_tiles * b, F)[:A]


def tiled_weight_grad(x_AD, g_AF, group_sizes_E, scale=None, out_dtype=None):
    """tiled_grouped_matmul's transpose in its stack: [E, D, F], group e's x^T g, by the same
    visits (each visit's tile times its kept rows of g, summed into its group's matrix); scale and
    out_dtype as tiled_grouped_matmul's."""
    (A, D), F = x_AD.shape, g_AF.shape[1]
    b, n_tiles, tile_V, group_V, keep_Vb = _tile_plan(A, group_sizes_E)
    g_VbF = jnp.where(keep_Vb[..., None], _tiles(g_AF, b, n_tiles)[tile_V], 0)
    x_VbD = _tiles(x_AD, b, n_tiles)[tile_V]
    dw_VDF = _scaled("vbd,vbf->vdf", x_VbD, g_VbF, scale, out_dtype)
    return jnp.zeros((group_sizes_E.shape[0], D, F), dw_VDF.dtype).at[group_V].add(dw_VDF)


def _scaled(spec, a, b, scale, out_dtype):
    """einsum(spec, a, b), or with a scale: accumulated in float32, times scale, in out_dtype."""
    if scale is None:
        return jnp.einsum(spec, a, b)
    return (jnp.einsum(spec, a, b, preferred_element_type=jnp.float32) * scale).astype(out_dtype)


def _collect(tree, name: str) -> list:
    """Every array sown under `name` anywhere in the "router" collection (scanned layers: [L, ...])."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _collect(value, name)
        elif key == name:
            out += list(value)  # sow keeps a tuple of the values sown
    return out


def router_losses(router_vars, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(load-balancing loss, z-loss) of a forward pass's sown "router" collection.

    The load-balancing loss is transformers' router_aux_loss (load_balancing_loss_func): the
    assignment fractions and mean probabilities each averaged over the sparse layers, then
    E * sum_e fraction_e * prob_e (C when the load is uniform). The z-loss is the layers' mean.
    """
    E = num_experts
    load_LE = jnp.concatenate([x.reshape(-1, E) for x in _collect(router_vars, "load")])
    prob_LE = jnp.concatenate([x.reshape(-1, E) for x in _collect(router_vars, "prob")])
    z_L = jnp.concatenate([x.reshape(-1) for x in _collect(router_vars, "z")])
    aux = E * jnp.sum(jnp.mean(load_LE, axis=0) * jnp.mean(prob_LE, axis=0))
    return aux, jnp.mean(z_L)
