"""Export proven by reading back: a family writes a config.json for a GPTConfig only when its own reader
takes that file back to the same model, every GPTConfig field compared. No family keeps a list of what
its format cannot hold, so a field GPTConfig gains that a format drops is refused the day it lands:

    hf, refused = read_back(family, config, "gpt2")   # refused: None, or the one-line reason, e.g.
    # "a gpt2 checkpoint cannot hold n_kv_head=2 (it would read back as 12)"

Each family's config_to_hf writes what its format holds and leaves out what it has no key for; only a
value it has no name for (GPT-2's activations, a Mixtral without experts) is refused while writing.
families.Family.export_config raises the reason with the family to export as instead; every export
(the config mapping, the weights of each family) goes through it.

"The same model" is the same function, so fields are compared in their normal form (normal_form): a
default that stands for a value is that value (n_kv_head=0 is n_head), a field that changes nothing given
the others is None (rope_factor without rope scaling, experts_per_token without experts), and the
NOT_EXPORTED fields are not compared at all.

May import: flaxgpt.models.
"""

from __future__ import annotations

import dataclasses

from flaxgpt.models.gpt_config import GPTConfig

# GPTConfig fields that are not part of the function a checkpoint holds, so export neither writes nor
# compares them: how a model is trained (the dropouts, the initialisation, the experts' auxiliary
# losses) and how the same function is laid out and computed (dtypes, vocabulary padding, scanned
# layers, rematerialisation, the attention kernel, float8 matmuls). Whoever loads the checkpoint
# chooses them again.
NOT_EXPORTED = frozenset(
    "dropout embd_dropout attn_dropout resid_dropout zero_init_proj router_aux_loss_coef "
    "router_z_loss_coef dtype param_dtype pad_vocab_multiple scan_layers remat attention_impl "
    "context_impl fp8 fp8_experts".split()
)
# the rotary fields each scaling reads (models/rope.py); the others change nothing given it
_BASE = ("rope_theta", "rope_scaling")
ROPE_READS = {
    "none": _BASE,
    "linear": (*_BASE, "rope_factor"),
    "llama3": (
        *_BASE,
        "rope_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_max_len",
    ),
    "yarn": (*_BASE, "rope_factor", "rope_original_max_len", "rope_attention_factor", "rope_beta_fast")
    + ("rope_beta_slow", "rope_truncate"),
    "dynamic": (*_BASE, "rope_factor", "rope_original_max_len"),
}
ROPE_FIELDS = tuple(dict.fromkeys(name for reads in ROPE_READS.values() for name in reads))
EXPERT_FIELDS = ("experts_per_token", "expert_hidden", "norm_topk_prob", "decoder_sparse_step")
EXPERT_FIELDS += ("mlp_only_layers",)


def normal_form(c: GPTConfig) -> dict:
    """{field: value} for every exported field, as the function sees it: a default that stands for a
    value replaced by it, a field that changes nothing given the others None."""
    out = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in NOT_EXPORTED}
    out.update(
        n_kv_head=c.kv_heads,
        head_size=c.head_dim,
        mlp_hidden=c.mlp_hidden or 4 * c.n_embd,
        query_pre_attn_scalar=0.0 if c.query_pre_attn_scalar == c.head_dim else c.query_pre_attn_scalar,
        sinusoid_layout=c.sinusoid_layout if c.pos_embedding == "sinusoidal" else None,
    )
    reads = ROPE_READS[c.rope_scaling] if c.pos_embedding == "rope" else ()
    out.update({name: out[name] if name in reads else None for name in ROPE_FIELDS})
    if "rope_attention_factor" in reads:  # YaRN's 0 stands for its default
        out["rope_attention_factor"] = c.rope.mscale
    out.update(_windows(c))
    out.update(_experts(c))
    # the context and window written: block_size's when the checkpoint had none longer
    out.update(hf_context=max(c.block_size, c.hf_context), hf_window=0 if c.sliding_window else c.hf_window)
    return out


def _windows(c: GPTConfig) -> dict:
    """sliding_window, window_pattern and rope_local_theta as the layers see them: a window that covers
    the context is full attention, a pattern longer than the model makes no layer global, and a local
    rotary base equal to the global, unscaled one is none."""
    windowed = any(c.layer_window(i) for i in range(c.n_layer))
    local = c.rope_local_theta if windowed and c.pos_embedding == "rope" else 0.0
    if local == c.rope_theta and c.rope_scaling == "none":
        local = 0.0
    window = min(c.sliding_window, c.block_size) if windowed else 0
    if window == c.block_size and not local:  # window layers differ from global ones only in their rope
        window = 0
    pattern = c.window_pattern if window and c.window_pattern <= c.n_layer else 0
    return dict(sliding_window=window, window_pattern=pattern, rope_local_theta=local)


def _experts(c: GPTConfig) -> dict:
    """The mixture-of-experts fields: each expert's resolved size, the dense layers that are dense only
    because mlp_only_layers says so; none of them without experts, no dense MLP size when all are sparse."""
    if not c.num_experts:
        return dict.fromkeys(EXPERT_FIELDS)
    L, step = c.n_layer, c.decoder_sparse_step
    out = {name: getattr(c, name) for name in EXPERT_FIELDS}
    out["expert_hidden"] = c.expert_mlp_hidden
    # an entry past the model, or on a layer decoder_sparse_step keeps dense anyway, changes nothing
    kept = {i for i in c.mlp_only_layers if 0 <= i < L and (i + 1) % step == 0}
    out["mlp_only_layers"] = tuple(sorted(kept))
    if all(c.layer_is_sparse(i) for i in range(L)):
        out["mlp_hidden"] = None
    return out


def differences(config: GPTConfig, back: GPTConfig) -> list[str]:
    """The exported fields whose normal forms differ. A field that matters on one side only
    (experts_per_token beside num_experts=0) follows from another difference: those causes are named
    when there are any."""
    mine, theirs = normal_form(config), normal_form(back)
    differ = [name for name in mine if mine[name] != theirs[name]]
    causes = [name for name in differ if mine[name] is not None and theirs[name] is not None]
    return causes or differ


def read_back(family, config: GPTConfig, model_type: str, special_ids=None) -> tuple[dict | None, str | None]:
    """(the config.json `family` writes for `config` as `model_type`, None) when the family's reader
    takes it back to the same function; else (it or None, the one-line reason)."""
    try:
        hf = family.config_to_hf(config, model_type, family, special_ids)  # refuses a value with no name
    except ValueError as e:
        return None, str(e)
    try:
        back = family.config_from_hf(hf, family, block_size=config.block_size)  # the context may be longer
    except ValueError as e:  # a file its own reader refuses: no writer makes one today, a new one might
        return hf, f"a {model_type} checkpoint cannot hold this model: its config.json does not read ({e})"
    written = family.written_as(config) if family.written_as else config
    names = differences(written, back)
    if not names:
        return hf, None
    got = normal_form(back)
    got = {name: getattr(back, name) if got[name] is None else got[name] for name in names}
    said = [f"{name}={getattr(config, name)!r} (it would read back as {got[name]!r})" for name in names]
    return hf, f"a {model_type} checkpoint cannot hold {', '.join(said)}"
