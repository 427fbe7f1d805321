"""Where the parameters sit, what training them costs: the figures write-ups compute by hand.

    python -m flaxgpt.summary --preset gpt2
    python -m flaxgpt.summary --preset gpt2 --tie_embeddings=false --qkv_bias=false
    python -m flaxgpt.summary --config configs/default.py --n_layer=6 --seq_len 256
    python -m flaxgpt.summary --config configs/default.py --json
    python -m flaxgpt.summary --preset base --vocab_size=37000      # the encoder-decoder Transformer

Every number comes from `jax.eval_shape` of the real model (no weight is ever
allocated), so a 1.5B-parameter model is summarised in a second on a laptop.
`summarize(model_config)` returns the same numbers as a dict.

FLOPs per token follow nanoGPT / PaLM (Appendix B): a matmul with N weights costs
2N FLOPs per token forward and 4N backward, plus attention's scores and weighted
sum, 4*L*H*Q*T forward (Q head dim, T sequence length, the full square counted,
not just the causal half). Training = 6N + 12*L*H*Q*T, forward = 2N + 4*L*H*Q*T,
with N the weights that take part in matmuls: all parameters but the position
embeddings and, when the head is untied, the token-embedding lookup. For the
encoder-decoder the figures are per target token with a source of the same length,
and L counts encoder layers plus twice the decoder layers (self- and cross-attention).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import linen as nn

from flaxgpt import gpt

MB = 2**20
PARTS = (
    "token embeddings",
    "position embeddings",
    "attention",
    "cross-attention",
    "MLP",
    "layer norms",
    "head",
    "other",
)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _part_of(path: tuple[str, ...]) -> str:
    """Which row of the table a parameter belongs to, from its names in the tree."""
    names = [n.lower() for n in path]
    if "wte" in names or any(n.endswith("embed") for n in names):  # seq2seq: embed, src_embed, tgt_embed
        return "token embeddings"
    if "wpe" in names:
        return "position embeddings"
    if "lm_head" in names:
        return "head"
    if "cross" in names:
        return "cross-attention"
    if "attn" in names:
        return "attention"
    if "mlp" in names:
        return "MLP"
    if any(n.startswith("ln") or n.endswith("_ln") for n in names):
        return "layer norms"
    return "other"


def _leaves_with_names(params):
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(params))[0]
    for keypath, leaf in flat:
        yield tuple(str(getattr(k, "key", k)) for k in keypath), leaf


def abstract_params_of(model_config):
    """ShapeDtypeStructs of any flaxgpt model's parameters (GPT or the encoder-decoder)."""
    if isinstance(model_config, gpt.GPTConfig):
        return gpt.abstract_params(model_config)
    from flaxgpt import seq2seq  # the encoder-decoder is optional here

    return seq2seq.abstract_params(model_config)


def parameter_counts(params) -> dict[str, int]:
    """Parameters per part (PARTS), from real or abstract (boxed or plain) parameters."""
    counts = dict.fromkeys(PARTS, 0)
    for path, leaf in _leaves_with_names(params):
        counts[_part_of(path)] += int(np.prod(leaf.shape))
    return counts


def flops_per_token(n_matmul: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> dict:
    attn_fwd = 4 * n_layer * n_head * head_dim * seq_len  # q.k scores + weighted sum of v
    return {"forward": 2 * n_matmul + attn_fwd, "train": 6 * n_matmul + 3 * attn_fwd}


def summarize(model_config, seq_len: int | None = None) -> dict:
    """All the numbers of the printed summary, for a GPTConfig (or a seq2seq TransformerConfig)."""
    parts = parameter_counts(abstract_params_of(model_config))
    total = sum(parts.values())
    c = model_config
    is_gpt = isinstance(c, gpt.GPTConfig)
    vocab_matrix = c.padded_vocab_size * (c.n_embd if is_gpt else c.d_model)
    tied = c.tie_embeddings if is_gpt else c.share_embeddings
    # untied, a GPT has wte and lm_head; an encoder-decoder src_embed, tgt_embed and lm_head
    extra_when_untied = vocab_matrix * (1 if is_gpt else 2)
    pos = parts["position embeddings"]
    totals = {
        "total": total,
        "without_position_embeddings": total - pos,  # nanoGPT's get_num_params()
        # Kaplan et al.'s N (~12*L*D^2): the blocks and final norm, no embedding or head matrix
        "without_embeddings": total - pos - parts["token embeddings"] - parts["head"],
        "tied_head": total if tied else total - extra_when_untied,
        "untied_head": total + extra_when_untied if tied else total,
    }
    memory = {}
    for dtype, nbytes in DTYPE_BYTES.items():
        m = {"params": total * nbytes, "grads": total * nbytes, "adam": 2 * total * nbytes}
        m["total"] = sum(m.values())
        memory[dtype] = m
    out = {
        "config": dataclasses.asdict(c),
        "parts": parts,
        "totals": totals,
        "tied": tied,
        "memory_bytes": memory,
    }
    T = seq_len or (c.block_size if is_gpt else c.max_len)
    # a lookup is free: the token matrices cost FLOPs only where one is the (tied) head
    n_matmul = total - pos - (0 if tied else parts["token embeddings"])
    # encoder-decoder, per target token with a source as long: every encoder layer attends
    # over S, every decoder layer over T (self) and over S (cross)
    attn_layers = c.n_layer if is_gpt else c.n_enc_layer + 2 * c.n_dec_layer
    out["flops"] = {
        "seq_len": T,
        "n_matmul": n_matmul,
        "attention_layers": attn_layers,
        **flops_per_token(n_matmul, attn_layers, c.n_head, c.head_dim, T),
    }
    return out


def format_summary(s: dict) -> str:
    total = s["totals"]["total"]
    c = s["config"]
    if "n_embd" in c:
        shape = f"GPT: {c['n_layer']} layers, {c['n_head']} heads, width {c['n_embd']}"
        shape += f", context {c['block_size']}"
    else:
        shape = f"encoder-decoder: {c['n_enc_layer']}+{c['n_dec_layer']} layers, {c['n_head']} heads"
        shape += f", width {c['d_model']}, max_len {c['max_len']}"
    m = c["pad_vocab_multiple"]
    vocab = f"vocab {c['vocab_size']:,}"
    if m > 1:
        vocab += f" (embedding rows padded to {-(-c['vocab_size'] // m) * m:,})"
    header = [f"{shape}, {vocab}", ""]
    lines = [f"{'part':<22}{'parameters':>16}{'share':>9}", "-" * 47]
    for part, n in s["parts"].items():
        note = "   (tied: reuses the token embeddings)" if part == "head" and s["tied"] else ""
        if part == "position embeddings" and not n:
            note = "   (sinusoidal: computed, not learned)"
        if n or note or part not in ("other", "cross-attention"):
            lines.append(f"{part:<22}{n:>16,}{100 * n / max(total, 1):>8.1f}%{note}")
    lines.append("-" * 47)
    t = s["totals"]
    head = "tied to token embeddings" if s["tied"] else "untied"
    lines += [
        f"{'total':<36}{t['total']:>16,}   (head {head})",
        f"{'  without position embeddings':<36}{t['without_position_embeddings']:>16,}   (nanoGPT's count)",
        f"{'  without any embeddings':<36}{t['without_embeddings']:>16,}   (Kaplan et al.'s N, ~12*L*D^2)",
        f"{'  with the head tied':<36}{t['tied_head']:>16,}",
        f"{'  with the head untied':<36}{t['untied_head']:>16,}",
        "",
        f"memory (MB = 2^20 bytes){'float32':>18}{'bfloat16':>12}",
    ]
    mem = s["memory_bytes"]
    for row, label in (
        ("params", "parameters"),
        ("grads", "gradients"),
        ("adam", "Adam state (m, v)"),
        ("total", "total"),
    ):
        lines.append(f"  {label:<22}{mem['float32'][row] / MB:>16,.2f}{mem['bfloat16'][row] / MB:>12,.2f}")
    lines.append("  (activations and temporaries come on top and grow with batch x sequence)")
    if "flops" in s:
        f = s["flops"]
        per = "token" if "n_embd" in c else "target token (source as long; L = enc + 2 x dec layers)"
        lines += [
            "",
            f"FLOPs per {per} at sequence length {f['seq_len']} (N = {f['n_matmul']:,} matmul weights):",
            f"  training (6N + 12*L*H*Q*T)   {f['train']:>18,}  ({f['train'] / 1e9:.3f} GFLOP)",
            f"  forward  (2N + 4*L*H*Q*T)    {f['forward']:>18,}  ({f['forward'] / 1e9:.3f} GFLOP)",
        ]
    return "\n".join(header + lines)


# ----------------------------------------------------------------------------- command line


def _parse_value(text: str, like):
    """A command-line string as the type of the dataclass field's default."""
    if isinstance(like, bool):
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if isinstance(like, int):
        return int(text)
    if isinstance(like, float):
        return float(text)
    return text


def parse_overrides(args: list[str], config_cls) -> dict:
    """`--tie_embeddings=false --n_layer 6` (also `--model.n_layer=6`) -> {field: value}."""
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    out, i = {}, 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; overrides look like --n_layer=6")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ValueError(f"{arg} needs a value, e.g. {arg}=...")
            value, i = args[i + 1], i + 1
        key = key.removeprefix("config.").removeprefix("model.")
        if key not in defaults:
            raise ValueError(f"unknown model field {key!r}; fields: {', '.join(defaults)}")
        out[key] = _parse_value(value, defaults[key])
        i += 1
    return out


def load_config_file(path: str):
    """get_config() of a configs/<recipe>.py file (`file.py:arg` passes arg to get_config)."""
    path, _, arg = path.partition(":")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {path!r} not found; pass e.g. configs/default.py")
    # recipes import their base as `from configs import default`: the repository root must be importable
    root = str(file.resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(f"_flaxgpt_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _data_vocab_size(cfg) -> int | None:
    """The vocabulary of the prepared dataset a run config points at, when it is on disk."""
    try:
        meta = json.loads((Path(cfg.data.dir) / "meta.json").read_text())
        return int(meta["vocab_size"])
    except (AttributeError, KeyError, OSError, ValueError, TypeError):
        return None


def model_config_from(model, overrides: dict | None = None, data_vocab: int | None = None):
    """A GPTConfig (or seq2seq TransformerConfig) from a run config's `model` section.

    Accepts both a saved run's config.json entry (GPTConfig field names plus "kind") and a
    configs/*.py section (which the trainer maps onto GPTConfig, e.g. one `dropout`).
    vocab_size 0 or None means "the dataset's": `data_vocab`, else GPT-2's 50257.
    """
    d = dict(model.to_dict() if hasattr(model, "to_dict") else model)
    kind = d.pop("kind", "gpt")
    if kind not in ("gpt", "seq2seq"):
        raise ValueError(f"model.kind={kind!r} is not one of ('gpt', 'seq2seq')")
    if kind == "seq2seq":
        from flaxgpt.seq2seq import TransformerConfig as cls
    else:
        cls = gpt.GPTConfig
    known = {f.name for f in dataclasses.fields(cls)}
    if not d.get("vocab_size"):
        d["vocab_size"] = data_vocab or cls().vocab_size
    if kind == "gpt" and not set(d) <= known:  # a recipe's section: map it as training does
        import ml_collections

        from flaxgpt.trainer import gpt_config_from

        config = gpt_config_from(ml_collections.ConfigDict(d), d["vocab_size"])
    else:
        config = cls(**{k: v for k, v in d.items() if k in known and v is not None})
    return dataclasses.replace(config, **(overrides or {}))


def _config_class(kind: str):
    if kind == "seq2seq":
        from flaxgpt.seq2seq import TransformerConfig

        return TransformerConfig
    return gpt.GPTConfig


def _seq2seq_presets() -> tuple[str, ...]:
    try:
        from flaxgpt.seq2seq import TransformerConfig
    except ImportError:
        return ()
    return tuple(TransformerConfig.PRESETS)


def config_from_args(args, rest: list[str]):
    """The model config named by --config / --run / --preset, with the field overrides in `rest`."""
    if args.config or args.run:
        if args.config:
            cfg = load_config_file(args.config)
            model, data_vocab = cfg.model, _data_vocab_size(cfg)
        else:
            model, data_vocab = json.loads((Path(args.run) / "config.json").read_text())["model"], None
        overrides = parse_overrides(rest, _config_class(dict(model).get("kind", "gpt")))
        config = model_config_from(model, overrides, data_vocab)
        if not dict(model).get("vocab_size") and "vocab_size" not in overrides:
            where = "the dataset's meta.json" if data_vocab else "default (the dataset is not prepared)"
            print(f"vocab_size {config.vocab_size:,} from {where}; --vocab_size=N to change it\n")
        return config
    cls = _config_class("seq2seq" if args.preset in _seq2seq_presets() else "gpt")
    overrides = parse_overrides(rest, cls)
    return cls.preset(args.preset, **overrides) if args.preset else cls(**overrides)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any model config field may follow as an override, e.g. --n_layer=6.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="configs/<recipe>.py with get_config(); its `model` section is used")
    src.add_argument("--run", help="a training run directory: its config.json's `model` entry is used")
    presets = ", ".join([*gpt.GPTConfig.PRESETS, *_seq2seq_presets()])
    src.add_argument("--preset", help=f"a model preset: {presets}")
    p.add_argument("--seq_len", type=int, default=None, help="T for the attention FLOPs (default block_size)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of a table")
    args, rest = p.parse_known_args(argv)
    try:
        model_config = config_from_args(args, rest)
    except (ValueError, TypeError, OSError, KeyError) as e:
        p.exit(2, f"flaxgpt.summary: error: {e}\n")
    s = summarize(model_config, args.seq_len)
    print(json.dumps(s, indent=1) if args.json else format_summary(s))
    return s


if __name__ == "__main__":
    main(sys.argv[1:])
