"""Where the parameters sit, what training them costs: the figures write-ups compute by hand.

    flaxgpt summary --preset gpt2
    flaxgpt summary --preset gpt2 --tie_embeddings=false --qkv_bias=false
    flaxgpt summary --config configs/default.py --n_layer=6 --seq_len 256
    flaxgpt summary --config configs/default.py --json
    flaxgpt summary --preset base --vocab_size=37000      # the encoder-decoder Transformer

Every number comes from `jax.eval_shape` of the real model (no weight is ever
allocated), so a 1.5B-parameter model is summarised in a second on a laptop.
`summarize(model_config)` returns the same numbers as a dict. The parameter parts and the FLOPs
are counted by flaxgpt.models.flops (`flops_per_token`, the one FLOPs count of the project, which
the trainer's MFU uses too; imported here under its own name).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from flaxgpt.models import registry as models
from flaxgpt.models.flops import (  # noqa: F401 (summary.flops_per_token)
    flops_of,
    flops_per_token,
    inactive_expert_params,
    parameter_counts,
)
from flaxgpt.train.config_check import load_recipe

MB = 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def summarize(model_config, seq_len: int | None = None) -> dict:
    """All the numbers of the printed summary, for a GPTConfig (or a seq2seq TransformerConfig)."""
    parts = parameter_counts(models.abstract_params(model_config))
    total = sum(parts.values())
    c = model_config
    kind = models.kind_of(c)
    vocab_matrix = c.padded_vocab_size * c.n_embd
    # untied, a GPT has wte and lm_head; an encoder-decoder src_embed, tgt_embed and lm_head
    extra_when_untied = vocab_matrix * (1 if kind == "gpt" else 2)
    pos = parts["position embeddings"]
    totals = {
        "total": total,
        "without_position_embeddings": total - pos,  # nanoGPT's get_num_params()
        # Kaplan et al.'s N (~12*L*D^2): the blocks and final norm, no embedding or head matrix
        "without_embeddings": total - pos - parts["token embeddings"] - parts["head"],
        "tied_head": total if c.tie_embeddings else total - extra_when_untied,
        "untied_head": total + extra_when_untied if c.tie_embeddings else total,
        "active": total - inactive_expert_params(c),  # a mixture of experts: a token's k experts of E
    }
    memory = {}
    for dtype, nbytes in DTYPE_BYTES.items():
        m = {"params": total * nbytes, "grads": total * nbytes, "adam": 2 * total * nbytes}
        m["total"] = sum(m.values())
        memory[dtype] = m
    out = {
        "kind": kind,
        "config": dataclasses.asdict(c),
        "parts": parts,
        "totals": totals,
        "tied": c.tie_embeddings,
        "memory_bytes": memory,
        "flops": flops_of(c, parts, seq_len),
    }
    if kind == "gpt":
        out["kv_cache"] = kv_cache_bytes(c)
    return out


def kv_cache_bytes(c) -> dict:
    """Bytes of KV cache per token of one sequence (keys and values of every layer), as the
    GPT's cache stores them (kv_heads heads) and as multi-head attention would (n_head heads)."""
    per_head = 2 * c.n_layer * c.head_dim  # keys + values, every layer
    T = c.block_size
    windows = [c.layer_window(i) if hasattr(c, "layer_window") else 0 for i in range(c.n_layer)]
    positions = sum(min(w or T, T) for w in windows)  # a window layer's cache holds its window (a ring)
    per_position = 2 * c.head_dim * c.kv_heads
    return {
        "kv_heads": c.kv_heads,
        "at_block_size": {dtype: per_position * positions * n for dtype, n in DTYPE_BYTES.items()},
        "per_token": {dtype: per_head * c.kv_heads * n for dtype, n in DTYPE_BYTES.items()},
        "per_token_multi_head": {dtype: per_head * c.n_head * n for dtype, n in DTYPE_BYTES.items()},
    }


def format_summary(s: dict) -> str:
    total = s["totals"]["total"]
    c, is_gpt = s["config"], s["kind"] == "gpt"
    if is_gpt:
        shape = f"GPT: {c['n_layer']} layers, {c['n_head']} heads"
        if c["n_kv_head"] and c["n_kv_head"] != c["n_head"]:
            shape += f" ({c['n_kv_head']} key/value heads)"
    else:
        shape = f"encoder-decoder: {c['n_enc_layer']}+{c['n_dec_layer']} layers, {c['n_head']} heads"
    shape += f", width {c['n_embd']}, context {c['block_size']}"
    m = c["pad_vocab_multiple"]
    vocab = f"vocab {c['vocab_size']:,}"
    if m > 1:
        vocab += f" (embedding rows padded to {-(-c['vocab_size'] // m) * m:,})"
    header = [f"{shape}, {vocab}", ""]
    lines = [f"{'part':<22}{'parameters':>16}{'share':>9}", "-" * 47]
    for part, n in s["parts"].items():
        note = "   (tied: reuses the token embeddings)" if part == "head" and s["tied"] else ""
        if part == "position embeddings" and not n:
            kind = "rotary" if c.get("pos_embedding") == "rope" else "sinusoidal"
            note = f"   ({kind}: computed, not learned)"
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
    ]
    if is_gpt and c.get("num_experts"):
        k, E = c["experts_per_token"], c["num_experts"]
        shared = " + the shared expert" if c.get("shared_expert_hidden") else ""
        lines.append(
            f"{'active per token':<36}{t['active']:>16,}   ({k} of {E} experts{shared} in each sparse layer)"
        )
    lines += [
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
    if "kv_cache" in s:
        kv, T = s["kv_cache"], c["block_size"]
        per, mha = kv["per_token"]["bfloat16"], kv["per_token_multi_head"]["bfloat16"]
        at_T = kv.get("at_block_size", {}).get("bfloat16", per * T)
        line = f"KV cache, bfloat16: {per / 2**10:,.1f} KiB per token, {at_T / MB:,.1f} MB at {T:,} tokens"
        if at_T < per * T:
            line += " (sliding-window layers hold their window)"
        if kv["kv_heads"] != c["n_head"]:
            line += f" ({kv['kv_heads']} key/value heads; {mha / per:.0f}x less than {c['n_head']})"
        lines += ["", line]
    if "flops" in s:
        f = s["flops"]
        per = "token" if is_gpt else "target token (source as long; L = enc + 2 x dec layers)"
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
        try:
            out[key] = _parse_value(value, defaults[key])
        except ValueError as e:
            raise ValueError(f"--{key}={value}: {e}") from None
        i += 1
    return out


def _data_vocab_size(cfg) -> int | None:
    """The vocabulary of the prepared dataset a run config points at, when it is on disk."""
    try:
        meta = json.loads((Path(cfg.data.dir) / "meta.json").read_text())
        return int(meta["vocab_size"])
    except (AttributeError, KeyError, OSError, ValueError, TypeError):
        return None


def config_from_args(args, rest: list[str]):
    """The model config named by --config / --run / --preset, with the field overrides in `rest`."""
    if args.config or args.run:
        if args.config:
            cfg = load_recipe(args.config)
            model, data_vocab = cfg.model, _data_vocab_size(cfg)
        else:
            from flaxgpt.runs import run_dir  # lazy: orbax is slow to import

            run_dir.require_run(args.run)
            model, data_vocab = run_dir.model_section(args.run), None
        model = dict(model.to_dict() if hasattr(model, "to_dict") else model)
        overrides = parse_overrides(rest, models.CONFIGS.get(model.get("kind"), models.GPTConfig))
        # overrides join the section before the mapping: "-1 = dropout" sees an overridden dropout
        config = models.config_from({**model, **overrides}, data_vocab, saved=bool(args.run))
        if not model.get("vocab_size") and "vocab_size" not in overrides:
            where = "the dataset's meta.json" if data_vocab else "default (the dataset is not prepared)"
            print(f"vocab_size {config.vocab_size:,} from {where}; --vocab_size=N to change it\n")
        return config
    cls = models.TransformerConfig if args.preset in models.TransformerConfig.PRESETS else models.GPTConfig
    overrides = parse_overrides(rest, cls)
    return cls.preset(args.preset, **overrides) if args.preset else cls(**overrides)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="flaxgpt summary",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any model config field may follow as an override, e.g. --n_layer=6.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="configs/<recipe>.py with get_config(); its `model` section is used")
    src.add_argument("--run", help="a training run directory: its config.json's `model` entry is used")
    presets = ", ".join([*models.GPTConfig.PRESETS, *models.TransformerConfig.PRESETS])
    src.add_argument("--preset", help=f"a model preset: {presets}")
    p.add_argument("--seq_len", type=int, default=None, help="T for the attention FLOPs (default block_size)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of a table")
    args, rest = p.parse_known_args(argv)
    try:
        model_config = config_from_args(args, rest)
    except (ValueError, TypeError, OSError, KeyError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    s = summarize(model_config, args.seq_len)
    print(json.dumps(s, indent=1) if args.json else format_summary(s))
    return s


if __name__ == "__main__":
    main(sys.argv[1:])
