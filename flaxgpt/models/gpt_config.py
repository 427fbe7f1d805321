"""GPTConfig: every shape and option of flaxgpt's decoder-only model, the named presets, and
`check_tokens` (a call's token errors seen before tracing).

    config = GPTConfig.preset("gpt2")                  # or GPTConfig(n_layer=4, n_embd=128, ...)
    config = GPTConfig.preset("llama-3.2-1b")          # a Llama-family shape
    config = GPTConfig.from_dict(saved)                # as a run's config.json holds it

The first block of fields is GPT-2's; the second turns the same module into a Llama / Mistral /
Qwen2 decoder; the third holds the modded-nanogpt speedrun's options. Defaults are GPT-2's, so a
saved config without a newer field loads as the model it was. A bad value is a ValueError at
construction naming the field and its choices. A recipe's `model` section maps onto these fields
one for one (flaxgpt/models/registry.py); the model itself is flaxgpt/models/gpt.py.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from flaxgpt.models.attention import ATTENTION_IMPLS
from flaxgpt.models.context_attention import CONTEXT_IMPLS
from flaxgpt.models.layers import ACTIVATIONS, NORMS, SINUSOID_LAYOUTS
from flaxgpt.models.rope import ROPE_SCALINGS, RoPE

# activation checkpointing of each block (gpt._remat_policy): what the backward pass keeps of its forward
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "offload_dots_no_batch")
# what Llama, Mistral and Qwen2 share (the presets below add their shapes)
LLAMA_STYLE = dict(pos_embedding="rope", norm="rmsnorm", activation="silu", glu=True, bias=False)
LLAMA_STYLE.update(qkv_bias=False)
QWEN3_STYLE = dict(
    LLAMA_STYLE, qk_norm=True, head_size=128, vocab_size=151936, block_size=40960, n_kv_head=8,
    rope_theta=1000000.0, layer_norm_epsilon=1e-6,
)  # fmt: skip
# Gemma 2 and 3: GeGLU, (1 + w) RMSNorms also after each branch, sqrt(D)-scaled embeddings, 256-wide heads
GEMMA_STYLE = dict(
    pos_embedding="rope", norm="rmsnorm_1p", activation="gelu", glu=True, bias=False, qkv_bias=False,
    post_norms=True, embed_scale=True, head_size=256, query_pre_attn_scalar=256.0, layer_norm_epsilon=1e-6,
)  # fmt: skip
GEMMA2_STYLE = dict(
    GEMMA_STYLE, vocab_size=256000, block_size=8192, sliding_window=4096, window_pattern=2,
    attn_softcap=50.0, logit_softcap=30.0,
)  # fmt: skip
GEMMA3_STYLE = dict(
    GEMMA_STYLE, qk_norm=True, window_pattern=6, rope_theta=1000000.0, rope_local_theta=10000.0
)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257  # tokens the tokenizer can produce; logits have this many columns
    block_size: int = 1024  # context length T: the longest sequence, and every training window
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # model width D
    pos_embedding: str = "learned"  # learned | sinusoidal | rope (rotary, in the attention)
    sinusoid_layout: str = "interleaved"  # interleaved (the paper's sin, cos, ...) | halves (older runs)
    activation: str = "gelu"  # gelu (tanh approx., GPT-2) | gelu_exact | relu | silu | relu2
    tie_embeddings: bool = True  # the LM head reuses wte
    bias: bool = True  # biases in Linear layers and LayerNorms
    qkv_bias: bool = True  # bias of the fused qkv projection (c_attn)
    dropout: float = 0.0  # the rate of the three dropouts below that are -1 (training only)
    embd_dropout: float = -1.0  # on token + position embeddings; -1 = dropout
    attn_dropout: float = -1.0  # on the attention weights; -1 = dropout
    resid_dropout: float = -1.0  # on each residual branch's output; -1 = dropout
    layer_norm_epsilon: float = 1e-5  # the norms' epsilon (GPT-2's)
    dtype: str = "float32"  # compute dtype; bfloat16 on TPU/GPU (params stay param_dtype)
    param_dtype: str = "float32"  # parameter and optimizer-state dtype
    pad_vocab_multiple: int = 1  # round the embedding rows up to this (64 is fast); 1 = exact
    attention_impl: str = "auto"  # auto | xla | cudnn | pallas (see attention.attend)
    context_impl: str = "ring"  # ring | ulysses: over a mesh context axis (models/context_attention.py)
    scan_layers: bool = False  # nn.scan over the blocks: compile time independent of depth
    remat: str = "none"  # none | full | dots | dots_no_batch | offload_dots_no_batch (see gpt._remat_policy)
    fp8: bool = False  # float8 matmuls: attention, MLPs, a shared expert (kernels/fp8.py); rest dtype
    # opt-in: the tiled grouped form copies each expert matrix a visit, float8 adds casts of the copies
    fp8_experts: bool = False  # with fp8, routed experts in float8 too (a Mixtral layer 0.77x bf16, H200)
    # modern decoders (Llama, Mistral, Qwen2); the defaults are GPT-2's
    norm: str = "layernorm"  # layernorm | rmsnorm (Llama) | rmsnorm_1p (Gemma: 1 + w); layer_norm_epsilon
    glu: bool = False  # gated MLP act(x W_gate) * (x W_up): with activation=silu, SwiGLU
    mlp_hidden: int = 0  # the MLP's hidden size F; 0 = 4 * n_embd
    n_kv_head: int = 0  # key/value heads: 0 = n_head, 1 = multi-query, else grouped-query
    qk_norm: bool = False  # normalise each head's queries and keys (with `norm`) before attention
    rope_theta: float = 10000.0  # pos_embedding=rope: base of the rotary frequencies
    rope_scaling: str = "none"  # none | llama3 (Llama 3.1) | linear | yarn | dynamic (NTK): models/rope.py
    rope_factor: float = 1.0  # llama3 / linear / yarn / dynamic: context extension factor
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_len / this are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_len / this are kept
    rope_original_max_len: int = 8192  # llama3 / yarn / dynamic: the pretraining context (models/rope.py)
    rope_attention_factor: float = 0.0  # yarn: cos and sin times this; 0 = YaRN's 0.1 ln(factor) + 1
    rope_beta_fast: float = 32.0  # yarn: frequencies turning more often over the original context kept
    rope_beta_slow: float = 1.0  # yarn: ... less often divided by factor; a linear ramp between
    rope_truncate: bool = True  # yarn: the ramp's ends rounded to whole frequencies
    sliding_window: int = 0  # each query sees the last sliding_window keys (Mistral); 0 = all
    logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap) (Gemma 2); 0 = off
    # Gemma 2 / 3 and Qwen3 (defaults leave every model above as it was)
    head_size: int = 0  # K, each head's width (config.head_dim); 0 = n_embd // n_head
    window_pattern: int = 0  # with sliding_window: layer i is global when (i+1) % this == 0; 0 = none is
    rope_local_theta: float = 0.0  # rotary base of the window layers (Gemma 3: 10000); 0 = rope_theta
    query_pre_attn_scalar: float = 0.0  # attention logits scaled by 1/sqrt(this) (Gemma); 0 = head_dim
    attn_softcap: float = 0.0  # attention logits = cap * tanh(logits / cap) (Gemma 2); 0 = off
    post_norms: bool = False  # a norm on the attention's and the MLP's outputs before each residual add
    embed_scale: bool = False  # token embeddings times sqrt(n_embd), rounded to the compute dtype (Gemma)
    # a Hugging Face checkpoint's context and window that a shorter block_size hides (a fine-tune on short
    # rows): export writes them back; the model runs block_size and sliding_window, never these
    hf_context: int = 0  # config.json max_position_embeddings, when longer than block_size; 0 = none
    hf_window: int = 0  # config.json sliding_window, when block_size covers none of it; 0 = none
    # the modded-nanogpt speedrun's architecture (activation="relu2" is its MLP)
    zero_init_proj: bool = False  # attention and MLP output projections (and an untied head) start at 0
    unet_skips: bool = False  # U-net: block L-1-i also gets block i's output, times a learned weight
    value_embeds: int = 0  # N extra token tables mixed into the values of the first N and last N blocks
    # mixture of experts (Mixtral, Qwen3-MoE; models/moe.py): sparse layers route each token to k of E MLPs
    num_experts: int = 0  # E expert MLPs in each sparse layer (no biases); 0 = every layer dense
    experts_per_token: int = 2  # k, the experts each token is sent to (top-k of the router's softmax)
    expert_hidden: int = 0  # each expert's hidden size; 0 = mlp_hidden (Mixtral's intermediate_size)
    norm_topk_prob: bool = True  # the k weights renormalised to sum to 1 (Mixtral; Qwen3-MoE's flag)
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % this == 0 (Qwen3-MoE); else dense
    mlp_only_layers: tuple = ()  # layers kept dense whatever decoder_sparse_step says (Qwen3-MoE)
    shared_expert_hidden: int = 0  # a sparse layer's always-active shared expert MLP (Qwen2-MoE); 0 = none
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(x . w) (Qwen2-MoE)
    router_aux_loss_coef: float = 0.001  # training: loss += this x the load-balancing loss (transformers')
    router_z_loss_coef: float = 0.0  # training: loss += this x mean logsumexp(router logits)^2 (ST-MoE)

    def __post_init__(self):
        # resolved here, so the stored rates are the real ones (what config.json records)
        for name in ("embd_dropout", "attn_dropout", "resid_dropout"):
            if getattr(self, name) < 0:
                object.__setattr__(self, name, self.dropout)
        # sizes first: the divisibility below divides by them (n_head 0 was a ZeroDivisionError traceback)
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "pad_vocab_multiple"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if not self.head_size and self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if (self.unet_skips or self.value_embeds) and self.scan_layers:
            raise ValueError(
                "unet_skips and value_embeds need scan_layers=False (each block takes its own inputs)"
            )
        if not 0 <= self.value_embeds <= self.n_layer // 2:
            raise ValueError(
                f"value_embeds {self.value_embeds} must be in [0, n_layer // 2 = {self.n_layer // 2}]"
            )
        if self.n_kv_head < 0 or self.n_head % (self.n_kv_head or self.n_head):
            raise ValueError(f"n_head {self.n_head} is not divisible by n_kv_head {self.n_kv_head}")
        choices = {
            "pos_embedding": ("learned", "sinusoidal", "rope"),
            "sinusoid_layout": SINUSOID_LAYOUTS,
            "activation": ACTIVATIONS,
            "attention_impl": ATTENTION_IMPLS,
            "context_impl": CONTEXT_IMPLS,
            "remat": REMAT_POLICIES,
            "norm": NORMS,
            "rope_scaling": ROPE_SCALINGS,
        }
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r} is not one of {allowed}")
        if (self.window_pattern or self.rope_local_theta) and self.scan_layers:
            raise ValueError(
                "window_pattern / rope_local_theta make layers differ; they need scan_layers=False"
            )
        if self.window_pattern and not self.sliding_window:
            raise ValueError(f"window_pattern {self.window_pattern} needs a sliding_window > 0")
        for field in (
            "mlp_hidden",
            "sliding_window",
            "head_size",
            "window_pattern",
            "hf_context",
            "hf_window",
        ):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0 (0 = the default), got {getattr(self, field)}")
        for field in ("logit_softcap", "attn_softcap", "query_pre_attn_scalar", "rope_local_theta"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0 (0 = off), got {getattr(self, field)}")
        if self.pos_embedding == "rope":
            self.rope  # noqa: B018 -- RoPE checks its own arguments
        elif self.rope_scaling != "none":
            raise ValueError(
                f"rope_scaling={self.rope_scaling!r} stretches rotary positions, and pos_embedding="
                f"{self.pos_embedding!r} has none: set rope_scaling='none' (or pos_embedding='rope')"
            )
        if self.fp8_experts and not self.fp8:
            raise ValueError(
                "fp8_experts adds the routed experts to model.fp8's float8 products: set fp8=True"
            )
        self._check_experts()

    def _check_experts(self):
        # a JSON list (config.json) becomes a tuple: the config stays hashable (jit caches on it)
        layers = self.mlp_only_layers
        if isinstance(layers, str) or not all(
            isinstance(i, int) or str(i).lstrip("-").isdigit() for i in layers
        ):
            raise ValueError(
                f"mlp_only_layers must be a list of layer indices such as (0, 3), got {layers!r}"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in layers))
        for field in ("num_experts", "expert_hidden", "router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")
        if self.shared_expert_hidden < 0:
            raise ValueError(f"shared_expert_hidden must be >= 0 (0 = none), got {self.shared_expert_hidden}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.shared_expert_gate and not self.shared_expert_hidden:
            raise ValueError("shared_expert_gate needs a shared expert: set shared_expert_hidden > 0")
        if not self.num_experts:
            if self.shared_expert_hidden:
                raise ValueError(
                    f"shared_expert_hidden {self.shared_expert_hidden} needs num_experts > 0 (a shared "
                    "expert sits beside routed ones); a dense model's MLP size is mlp_hidden"
                )
            return
        k, E = self.experts_per_token, self.num_experts
        if not 1 <= k <= E:
            raise ValueError(
                f"experts_per_token {k} must be in [1, num_experts {E}]: lower experts_per_token "
                "or raise num_experts"
            )
        sparse = [self.layer_is_sparse(i) for i in range(self.n_layer)]
        if self.scan_layers and not all(sparse):
            raise ValueError(
                "decoder_sparse_step / mlp_only_layers make dense layers among sparse ones; "
                "they need scan_layers=False"
            )

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    def layer_window(self, i: int) -> int:
        """Layer i's sliding window (0 = every earlier key): window_pattern makes every
        window_pattern-th layer global (Gemma 2: 2, local first; Gemma 3: 6)."""
        if self.window_pattern and (i + 1) % self.window_pattern == 0:
            return 0
        return self.sliding_window

    def layer_rope(self, i: int) -> RoPE | None:
        """Layer i's rotary embedding: window layers use rope_local_theta, unscaled, when it is set."""
        if self.pos_embedding == "rope" and self.rope_local_theta and self.layer_window(i):
            return RoPE(self.head_dim, self.rope_local_theta)
        return self.rope

    def layer_is_sparse(self, i: int) -> bool:
        """Layer i's MLP is a mixture of experts (Qwen3-MoE's rule; every layer for Mixtral)."""
        return bool(
            self.num_experts and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def expert_mlp_hidden(self) -> int:
        """Each expert's hidden size F."""
        return self.expert_hidden or self.mlp_hidden or 4 * self.n_embd

    @property
    def kv_heads(self) -> int:
        """J, the key/value heads the attention projects and the KV cache stores."""
        return self.n_kv_head or self.n_head

    @property
    def rope(self) -> RoPE | None:
        if self.pos_embedding != "rope":
            return None
        return RoPE(
            self.head_dim,
            self.rope_theta,
            self.rope_scaling,
            self.rope_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_len,
            self.rope_attention_factor,
            self.rope_beta_fast,
            self.rope_beta_slow,
            self.rope_truncate,
        )

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    # fmt: off
    PRESETS = {
        "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
        "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
        "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
        "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
        # the published config.json shapes of Llama-family models (summaries, from-scratch runs)
        "smollm2-135m": dict(
            LLAMA_STYLE, vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
            mlp_hidden=1536, rope_theta=100000.0,
        ),
        "llama-3.2-1b": dict(
            LLAMA_STYLE, vocab_size=128256, block_size=131072, n_layer=16, n_head=32, n_kv_head=8,
            n_embd=2048, mlp_hidden=8192, rope_theta=500000.0, rope_scaling="llama3", rope_factor=32.0,
            rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192,
        ),
        "llama-3-8b": dict(
            LLAMA_STYLE, vocab_size=128256, block_size=8192, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
            mlp_hidden=14336, rope_theta=500000.0, tie_embeddings=False,
        ),
        "qwen2.5-0.5b": dict(
            LLAMA_STYLE, qkv_bias=True, vocab_size=151936, block_size=32768, n_layer=24, n_head=14,
            n_kv_head=2, n_embd=896, mlp_hidden=4864, rope_theta=1000000.0, layer_norm_epsilon=1e-6,
        ),
        "mistral-7b-v0.1": dict(
            LLAMA_STYLE, vocab_size=32000, block_size=32768, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
            mlp_hidden=14336, sliding_window=4096, tie_embeddings=False,
        ),
        "qwen3-0.6b": dict(QWEN3_STYLE, n_layer=28, n_head=16, n_embd=1024, mlp_hidden=3072),
        "qwen3-1.7b": dict(QWEN3_STYLE, n_layer=28, n_head=16, n_embd=2048, mlp_hidden=6144),
        "qwen3-4b": dict(QWEN3_STYLE, n_layer=36, n_head=32, n_embd=2560, mlp_hidden=9728),
        "qwen3-8b": dict(
            QWEN3_STYLE, n_layer=36, n_head=32, n_embd=4096, mlp_hidden=12288, tie_embeddings=False
        ),
        "gemma-2-2b": dict(GEMMA2_STYLE, n_layer=26, n_head=8, n_kv_head=4, n_embd=2304, mlp_hidden=9216),
        "gemma-2-9b": dict(GEMMA2_STYLE, n_layer=42, n_head=16, n_kv_head=8, n_embd=3584, mlp_hidden=14336),
        "gemma-3-1b": dict(
            GEMMA3_STYLE, vocab_size=262144, block_size=32768, n_layer=26, n_head=4, n_kv_head=1, n_embd=1152,
            mlp_hidden=6912, sliding_window=512,
        ),
        "gemma-3-4b-text": dict(
            GEMMA3_STYLE, vocab_size=262208, block_size=131072, n_layer=34, n_head=8, n_kv_head=4,
            n_embd=2560, mlp_hidden=10240, sliding_window=1024, rope_scaling="linear", rope_factor=8.0,
        ),
        # mixtures of experts: 8 experts top-2 (Mixtral), 128 experts top-8 (Qwen3-MoE), 60 experts top-4
        # and a gated shared expert (Qwen1.5-MoE, a Qwen2-MoE)
        "mixtral-8x7b": dict(
            LLAMA_STYLE, vocab_size=32000, block_size=32768, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
            mlp_hidden=14336, rope_theta=1000000.0, tie_embeddings=False, num_experts=8, experts_per_token=2,
            router_aux_loss_coef=0.02,
        ),
        "qwen3-30b-a3b": dict(
            QWEN3_STYLE, n_layer=48, n_head=32, n_kv_head=4, n_embd=2048, mlp_hidden=6144,
            tie_embeddings=False, num_experts=128, experts_per_token=8, expert_hidden=768,
        ),
        "qwen1.5-moe-a2.7b": dict(
            LLAMA_STYLE, qkv_bias=True, vocab_size=151936, block_size=8192, n_layer=24, n_head=16,
            n_kv_head=16, n_embd=2048, mlp_hidden=5632, rope_theta=1000000.0, layer_norm_epsilon=1e-6,
            tie_embeddings=False, num_experts=60, experts_per_token=4, expert_hidden=1408,
            norm_topk_prob=False, shared_expert_hidden=5632, shared_expert_gate=True,
        ),
    }
    # fmt: on

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """GPT-2 (or a Llama-family model's) shape by name; overrides replace any field (dtype=...)."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def gpt2(cls, **kw):
        return cls.preset("gpt2", **kw)

    @classmethod
    def gpt2_medium(cls, **kw):
        return cls.preset("gpt2-medium", **kw)

    @classmethod
    def gpt2_large(cls, **kw):
        return cls.preset("gpt2-large", **kw)

    @classmethod
    def gpt2_xl(cls, **kw):
        return cls.preset("gpt2-xl", **kw)

    def to_dict(self) -> dict:
        """The fields as config.json holds them (a tuple as a list: what json reads back)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {sorted(unknown)}")
        return cls(**d)


def options_table() -> str:
    """docs/training.md's option table, one row per GPTConfig field from its own line above (name,
    default, comment), so the docs cannot fall behind the dataclass (tests/test_docs.py compares):

        python -m flaxgpt.models.gpt_config    # prints it
    """
    import inspect
    import re

    rows, seen = ["| option | default | what it does |", "| --- | --- | --- |"], []
    for line in inspect.getsource(GPTConfig).splitlines():
        m = re.match(r"    (\w+): \w+ = (.+?)  # (.+)$", line)
        if m:
            name, default, about = m.groups()
            seen.append(name)
            rows.append(f"| `{name}` | `{default}` | {about.replace('|', '/')} |")
    missing = [f.name for f in dataclasses.fields(GPTConfig) if f.name not in seen]
    if missing:
        raise ValueError(f"GPTConfig fields without a `name: type = default  # comment` line: {missing}")
    return "\n".join(rows)


def check_tokens(tokens_BT, config: GPTConfig, cache=None):
    """Errors for the bad input that can be seen before tracing: length and id range."""
    if tokens_BT.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens_BT.shape}")
    T = tokens_BT.shape[1]
    limit = config.block_size if cache is None else cache.max_len
    if T > limit:
        raise ValueError(
            f"sequence length {T} is longer than block_size {limit}; "
            "crop the input to the last block_size tokens"
        )
    if not isinstance(tokens_BT, jax.core.Tracer):
        arr = np.asarray(tokens_BT)
        if arr.size and (arr.min() < 0 or arr.max() >= config.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {config.vocab_size}), got min {arr.min()} max {arr.max()}"
            )


if __name__ == "__main__":
    print(options_table())
