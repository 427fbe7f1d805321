"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE) and its router losses.

    y_BTD = MoE(config)(x_BTD)              # a sparse layer's MLP (gpt.Block picks it per layer)
    logits, state = GPT(config).apply(v, tokens, mutable=["router"])
    aux, z = router_losses(state["router"], config.num_experts)

A softmax router scores E experts per token and each token goes to its top k; the k weights are
renormalised to sum to 1 when `norm_topk_prob` (Mixtral always; Qwen3-MoE by its flag). Dropless:
the N*k (token, expert) assignments are sorted by expert and each expert's contiguous run of rows is
one group of a grouped matmul (`grouped_matmul`), so an expert computes only its own tokens and no
token is dropped for capacity. Expert weights are stacked [E, ...] (logical axis "expert").

Each sparse layer sows into the "router" collection what the losses need: the fraction of the
assignments each expert got and its mean router probability (transformers' load_balancing_loss_func
averages both over the layers before multiplying them), and the mean squared logsumexp of the router
logits (ST-MoE's z-loss).

Shape letters: N tokens (B*T), D model dim, E experts, C experts per token (top-k),
A = N*C assignments, F each expert's hidden size (see layers.py for the rest).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from flaxgpt.models.layers import Dtype, activation_fn, normal_init, swiglu

ROUTER = "router"  # the collection the sparse layers sow their statistics into


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
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BTD):
        E, C, F, D = self.num_experts, self.experts_per_token, self.hidden, x_BTD.shape[-1]
        x_ND = x_BTD.reshape(-1, D)
        N = x_ND.shape[0]
        logits_NE = nn.Dense(
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

        # sort the assignments by expert: each expert's rows are then one contiguous group
        experts_A = experts_NC.reshape(-1)
        order_A = jnp.argsort(experts_A, stable=True)
        tokens_A = order_A // C  # the token each sorted assignment came from
        group_sizes_E = jnp.bincount(experts_A, length=E).astype(jnp.int32)
        x_AD = x_ND[tokens_A].astype(self.dtype)

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
        h_AF2 = grouped_matmul(x_AD, w_fc.astype(self.dtype), group_sizes_E)
        if self.glu and self.activation == "silu":
            h_AF = swiglu(h_AF2)
        elif self.glu:
            gate_AF, up_AF = jnp.split(h_AF2, 2, axis=-1)
            h_AF = activation_fn(self.activation)(gate_AF) * up_AF
        else:
            h_AF = activation_fn(self.activation)(h_AF2)
        y_AD = grouped_matmul(h_AF, w_proj.astype(self.dtype), group_sizes_E)

        # back to token order (a gather by the inverse permutation, not a scatter-add), then the
        # weighted sum over each token's C experts
        inverse_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(N * C))
        y_NCD = y_AD[inverse_A].reshape(N, C, D)
        y_ND = jnp.einsum("ncd,nc->nd", y_NCD, weights_NC.astype(y_NCD.dtype))
        y_BTD = y_ND.reshape(x_BTD.shape)
        return nn.Dropout(self.dropout)(y_BTD, deterministic=self.deterministic)

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


def grouped_matmul(x_AD, w_EDF, group_sizes_E):
    """Rows sorted by group [A, D] times their group's matrix [E, D, F] -> [A, F]: rows
    starts_e .. starts_e + group_sizes_E[e] - 1 use w_EDF[e].

    GPU and TPU lower `jax.lax.ragged_dot` to a grouped-matmul kernel; XLA on CPU has none, and jax's
    fallback there runs every row through every group's matrix and masks (E times the FLOPs), so the
    CPU runs `tiled_grouped_matmul` instead (the branch is chosen when the program is lowered).
    """
    return jax.lax.platform_dependent(
        x_AD, w_EDF, group_sizes_E, cpu=tiled_grouped_matmul, default=jax.lax.ragged_dot
    )


def tiled_grouped_matmul(x_AD, w_EDF, group_sizes_E):
    """grouped_matmul in tiles of b rows: each tile is multiplied by the matrix of every group it
    overlaps and keeps that group's rows. Tiles of ~A/E rows make at most (tiles + E - 1) ~ 2E visits,
    ~2A rows of work in all (the whole-matrix fallback: E*A)."""
    A, D = x_AD.shape
    E, _, F = w_EDF.shape
    b = max(1, -(-A // E))  # rows per tile
    n_tiles = -(-A // b)
    V = n_tiles + E - 1  # visits: consecutive groups share at most one tile
    ends_E = jnp.cumsum(group_sizes_E)
    starts_E = ends_E - group_sizes_E
    spans_E = jnp.where(group_sizes_E > 0, (ends_E - 1) // b - starts_E // b + 1, 0)  # tiles per group
    v_V = jnp.arange(V)
    group_V = jnp.repeat(jnp.arange(E), spans_E, total_repeat_length=V)
    tile_V = starts_E[group_V] // b + v_V - (jnp.cumsum(spans_E) - spans_E)[group_V]
    tile_V = jnp.clip(tile_V, 0, n_tiles - 1)
    rows_Vb = tile_V[:, None] * b + jnp.arange(b)  # each visit's row indices
    keep_Vb = (rows_Vb >= starts_E[group_V, None]) & (rows_Vb < ends_E[group_V, None])
    keep_Vb &= (v_V < jnp.sum(spans_E))[:, None]  # visits past the last group's tile do nothing
    x_TbD = jnp.pad(x_AD, ((0, n_tiles * b - A), (0, 0))).reshape(n_tiles, b, D)
    y_VbF = jnp.einsum("vbd,vdf->vbf", x_TbD[tile_V], w_EDF[group_V])
    y_VbF = jnp.where(keep_Vb[..., None], y_VbF, 0)
    # each row is kept by exactly one visit: the sum adds zeros to it, exactly
    y_TbF = jnp.zeros((n_tiles, b, F), y_VbF.dtype).at[tile_V].add(y_VbF)
    return y_TbF.reshape(n_tiles * b, F)[:A]


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
