"""Where attention looks: the softmax weights of chosen layers and heads, as a PNG grid.

    flaxgpt attention-map --init_from out/shakespeare_char --prompt "ROMEO:" \\
        --layers 0,5 --heads all --out attn.png
    flaxgpt attention-map --init_from gpt2 --prompt "The cat sat on the mat because it" \\
        --layers 5 --heads all --out gpt2_layer5.png      # GPT-2's weights (HF cache or a directory)
    flaxgpt attention-map --init_from random --preset gpt2 --n_layer=2 \\
        --prompt "The quick brown fox" --layers all --heads 0:4 --out attn.png

Rows of each panel are queries, columns keys, both labelled with the prompt's tokens
(a space shows as '·', a newline as '⏎'); in a causal model everything above the
diagonal is exactly zero and drawn white. The weights are the model's own: SelfAttention sows them
into the "intermediates" collection when the model is applied with it mutable.

Shape letters: L layers, H heads, T tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flaxgpt import extras
from flaxgpt.hf.files import GPT2_NAMES
from flaxgpt.models import gpt

MAX_LABELLED_TOKENS = 64  # beyond this the tick labels are unreadable: show every k-th one


@functools.lru_cache(maxsize=8)
def _sown_weights_fn(config: gpt.GPTConfig):
    """A compiled apply that returns the intermediates (one compile per config and length)."""

    def run(params, tokens_BT):
        _, state = gpt.GPT(config).apply(
            {"params": params}, tokens_BT, deterministic=True, mutable=["intermediates"]
        )
        inter = state["intermediates"]
        if config.scan_layers:
            (w_LBHTT,) = inter["h"]["block"]["attn"]["attn_weights"]  # scan stacks layers first
            return w_LBHTT
        return jnp.stack([inter[f"h_{i}"]["attn"]["attn_weights"][0] for i in range(config.n_layer)])

    return jax.jit(run)


def attention_weights(config: gpt.GPTConfig, params, tokens) -> np.ndarray:
    """Attention weights [L, H, T, T] (float32, rows sum to 1) of one sequence of token ids."""
    tokens_BT = jnp.asarray(tokens, jnp.int32).reshape(1, -1)
    gpt.check_tokens(tokens_BT, config)
    # the fused kernel never materialises the weights; the XLA path is the same maths
    config = dataclasses.replace(config, attention_impl="xla")
    w_LBHTT = _sown_weights_fn(config)(nn.unbox(params), tokens_BT)
    return np.asarray(w_LBHTT[:, 0], np.float32)


def parse_indices(spec, n: int, what: str = "index") -> list[int]:
    """'all', '0,5', '-1', '2:6' (a Python slice) or a list of ints -> indices in [0, n)."""
    if isinstance(spec, (list, tuple)):
        parts = [str(s) for s in spec]
    else:
        spec = str(spec).strip()
        if spec in ("all", ""):
            return list(range(n))
        parts = [s.strip() for s in spec.split(",") if s.strip()]
    out = []
    for part in parts:
        try:
            if ":" in part:
                bounds = [int(b) if b else None for b in part.split(":")]
                out += list(range(n))[slice(*bounds)]
            else:
                i = int(part)
                if not -n <= i < n:
                    raise IndexError
                out.append(i % n)
        except (ValueError, IndexError):
            raise ValueError(
                f"bad {what} {part!r} in {spec!r}: the model has {n} (use 'all', '0,5', '-1' or '2:6')"
            ) from None
    if not out:  # an empty slice ('1:0'): nothing to draw
        raise ValueError(f"{what}s {spec!r} select none of the model's {n} (use 'all', '0,5', '-1' or '2:6')")
    return out


def token_labels(tokenizer, ids) -> list[str]:
    """One readable label per token id (BPE pieces may be partial characters)."""
    labels = []
    for i in ids:
        text = tokenizer.decode([int(i)])
        labels.append(text.replace(" ", "·").replace("\n", "⏎").replace("\t", "⇥") or "∅")
    return labels


def save_attention_png(weights_LHTT, labels, layers, heads, path, title: str | None = None) -> str:
    """A grid (rows = layers, columns = heads) of attention maps with token labels; returns path."""
    try:
        import matplotlib
        from matplotlib.figure import Figure  # no pyplot: no global backend, safe inside train loops
    except ImportError:
        raise ImportError(f"attention maps need matplotlib: {extras.install_command('plot')}") from None
    w = np.asarray(weights_LHTT)
    L, H, T, _ = w.shape
    layers = parse_indices(layers, L, "layer")
    heads = parse_indices(heads, H, "head")
    if len(labels) != T:
        raise ValueError(f"{len(labels)} token labels for {T} tokens; pass one label per token")
    cell = float(np.clip(0.16 * T + 1.2, 2.5, 10.0))  # inches per panel, so labels stay legible
    scale = min(1.0, 60.0 / (cell * max(len(heads), len(layers))))  # cap the figure near 60 inches
    fig = Figure(
        figsize=(cell * len(heads) * scale + 1.0, cell * len(layers) * scale + 0.8), layout="constrained"
    )
    axes = fig.subplots(len(layers), len(heads), squeeze=False)
    step = max(1, -(-T // MAX_LABELLED_TOKENS))
    ticks = np.arange(0, T, step)
    fontsize = float(np.clip(0.55 * 72 * cell * scale / T, 3, 10))  # points: about half a row each
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    future_TT = np.triu(np.ones((T, T), bool), 1)
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = axes[r, c]
            # keys a causal mask hides (weight exactly 0 above the diagonal) are drawn white
            w_TT = np.ma.masked_where(future_TT & (w[layer, head] == 0), w[layer, head])
            im = ax.imshow(w_TT, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_title(f"layer {layer} head {head}", fontsize=9)
            ax.set_xticks(ticks, [labels[t] for t in ticks], rotation=90, fontsize=fontsize)
            ax.set_yticks(ticks, [labels[t] for t in ticks], fontsize=fontsize)
            if c == 0:
                ax.set_ylabel("query", fontsize=8)
            if r == len(layers) - 1:
                ax.set_xlabel("key", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.6, label="attention weight")
    if title:
        fig.suptitle(title)
    if not Path(path).suffix:  # matplotlib adds its format's extension: say where the file really is
        path = f"{path}.png"
    fig.savefig(path, dpi=100)
    return str(path)


def write_attention_png(
    config,
    params,
    tokenizer,
    prompt: str | list[int],
    layers_spec="all",
    heads_spec="all",
    path="attention.png",
) -> np.ndarray:
    """Run the model on `prompt` (text, or the ids sample.py generates from: its BOS, or the token an
    empty prompt starts from), save the chosen layers x heads; returns weights [L, H, T, T]. Prompts
    longer than block_size keep their last block_size tokens, as generation does.
    """
    ids = (tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt))[-config.block_size :]
    if not ids:
        raise ValueError("the prompt is empty; attention maps need at least one token")
    w = attention_weights(config, params, ids)
    save_attention_png(
        w,
        token_labels(tokenizer, ids),
        layers_spec,
        heads_spec,
        path,
        title=f"attention of {len(ids)} tokens",
    )
    return w


# ----------------------------------------------------------------------------- command line


def _random(args, overrides: dict):
    """The config and tokenizer of --init_from random: --config's model section or --preset."""
    from flaxgpt.data.tokenizers import CharTokenizer, get_tokenizer
    from flaxgpt.models.registry import config_from
    from flaxgpt.train.config_check import load_recipe

    if args.config:
        config = config_from({**load_recipe(args.config).model.to_dict(), **overrides})
    else:
        config = gpt.GPTConfig.preset(args.preset or "gpt2", **overrides)
    if config.vocab_size >= 50257:
        return config, get_tokenizer("gpt2")
    # a small random model: spell the prompt in its own characters
    tokenizer = CharTokenizer.from_text(args.prompt)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the prompt has {tokenizer.vocab_size} distinct characters but the model's "
            f"vocab_size is {config.vocab_size}; use a shorter prompt"
        )
    return config, tokenizer


def _load(args, overrides: dict):
    """(GPTConfig, params, tokenizer): a run directory or HF weights (flaxgpt.load), or a random init."""
    from flaxgpt import loader

    source = Path(args.init_from)
    if args.init_from == "random":
        config, tokenizer = _random(args, overrides)
        run = loader.init(config, seed=args.seed, tokenizer=tokenizer)
    elif loader.is_run_dir(source) or args.init_from in GPT2_NAMES or (source / "config.json").is_file():
        run = loader.load(args.init_from, overrides=overrides)
    else:
        raise ValueError(
            f"--init_from {args.init_from!r} is neither a training run (no checkpoints/ in it), a Hugging "
            f"Face directory, a GPT-2 name ({', '.join(GPT2_NAMES)}), nor 'random'"
        )
    if run.kind != "gpt":
        raise ValueError(
            f"{args.init_from} holds an encoder-decoder; attention maps are drawn for GPT runs only"
        )
    return run.config, run.params, run.tokenizer


def main(argv: list[str] | None = None) -> np.ndarray:
    from flaxgpt.tools.summary import parse_overrides

    p = argparse.ArgumentParser(
        prog="flaxgpt attention-map",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="GPTConfig fields may follow as overrides, e.g. --n_layer=2.",
    )
    p.add_argument(
        "--init_from",
        default="random",
        help="a run directory, GPT-2 weights (gpt2, gpt2-xl, an HF directory), or random (--preset/--config)",
    )
    p.add_argument("--preset", default=None, help="GPTConfig preset for --init_from random (default gpt2)")
    p.add_argument("--config", default=None, help="configs/<recipe>.py for --init_from random")
    p.add_argument("--prompt", required=True, help="the text whose attention is drawn")
    p.add_argument("--layers", default="all", help="'all', '0,5', '-1' or '2:6'")
    p.add_argument("--heads", default="all", help="'all', '0,5', '-1' or '2:6'")
    p.add_argument("--out", default="attention.png", help="PNG to write")
    p.add_argument("--seed", type=int, default=0, help="seed of a random init")
    args, rest = p.parse_known_args(argv)
    extras.require("plot", "flaxgpt attention-map")
    extras.require_hf(args.init_from, "flaxgpt attention-map --init_from")
    try:
        config, params, tokenizer = _load(args, parse_overrides(rest, gpt.GPTConfig))
        w = write_attention_png(config, params, tokenizer, args.prompt, args.layers, args.heads, args.out)
    except (ValueError, ImportError, OSError, RuntimeError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"wrote {args.out}: layers {args.layers}, heads {args.heads}, {w.shape[-1]} tokens")
    return w


if __name__ == "__main__":
    main(sys.argv[1:])
