"""Sample text from a trained run or from GPT-2.

    python sample.py --out_dir out/shakespeare_char --start "ROMEO:" --num_samples 5 --max_new_tokens 500
    python sample.py --init_from gpt2 --start "The meaning of life is" --temperature 0.8 --top_k 200
    python sample.py --init_from gpt2 --start FILE:prompt.txt --top_p 0.9 --seed 7
    python sample.py --out_dir out/run --prompts_file prompts.txt --temperature 0     # greedy, one per line
    python sample.py --out_dir out/shakespeare_char --start "ROMEO:" --attention_png attn.png \
        --layers 0,5 --heads all --max_new_tokens 0        # attention map of the prompt only
    python sample.py --out_dir out/reverse --start "abcdef" --beam_size 4  # an encoder-decoder run
    python sample.py --out_dir out/reverse --prompts_file src.txt --beam_size 1 > hyp.txt

A single sample streams to the terminal as it is decoded; several are printed one after another,
separated by a line of dashes. The same seed gives the same output. GPT-2 BPE samples stop at
<|endoftext|>. Bad input is a one-line error (exit code 1) or, where sampling can go on, a warning.

Attention maps (GPT models): --attention_png PATH draws the attention weights of the first prompt
for --layers x --heads ('all', '0,5', '-1' or '2:6') into a PNG grid, says where on stderr, then
samples as usual; --max_new_tokens 0 writes the PNG and samples nothing.

Encoder-decoder runs (config.json model.kind "seq2seq", e.g. trained with configs/reverse.py):
every non-blank line of --start (text, or FILE:path) or of --prompts_file is a source; stdout gets
exactly one translation per source line, in order, and nothing else. Beam search with --beam_size
(1 = greedy) and length penalty --alpha; a source longer than the model's maximum is an error, or
is cut with a warning under --truncate. The sampling options (--temperature, --top_k, --top_p,
--num_samples, --seed, --dtype) apply to GPT models only.
"""

from __future__ import annotations

import argparse
import sys

SEPARATOR = "-" * 40


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out", help="a training run's directory (with --init_from resume)")
    p.add_argument("--init_from", default="resume", help="resume | a GPT-2 name (gpt2, gpt2-xl...) | a path")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to load (default: the latest)")
    p.add_argument(
        "--start", default=None, help='the prompt, or FILE:prompt.txt (default "\\n"; seq2seq: required)'
    )
    p.add_argument("--prompts_file", default=None, help="one prompt per line (blank lines are skipped)")
    p.add_argument("--num_samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--max_new_tokens", type=int, default=500, help="0 = no sampling (with --attention_png)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="0 = off")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--attention_png", default=None, help="write the first prompt's attention map here")
    p.add_argument("--layers", default="all", help="layers of the attention map: all | 0,5 | -1 | 2:6")
    p.add_argument("--heads", default="all", help="heads of the attention map: all | 0,5 | -1 | 2:6")
    p.add_argument("--beam_size", type=int, default=4, help="seq2seq runs: beam width (1 = greedy)")
    p.add_argument("--alpha", type=float, default=0.6, help="seq2seq runs: length penalty exponent")
    p.add_argument("--truncate", action="store_true", help="seq2seq runs: cut long sources (else error)")
    a = p.parse_args(argv)
    if a.temperature < 0:
        raise ValueError(f"--temperature {a.temperature} is negative; use 0 for greedy or a positive value")
    if not 0 < a.top_p <= 1:
        raise ValueError(f"--top_p {a.top_p} is outside (0, 1]; 1 turns nucleus sampling off")
    for name in ("num_samples", "beam_size"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.max_new_tokens < 0 or (a.max_new_tokens == 0 and not a.attention_png):
        raise ValueError(f"--max_new_tokens must be >= 1 (0 with --attention_png), got {a.max_new_tokens}")
    if a.alpha < 0:
        raise ValueError(f"--alpha {a.alpha} is negative; 0 turns the length penalty off, the paper uses 0.6")
    if a.top_k < 0:
        raise ValueError(f"--top_k must be >= 0 (0 = off), got {a.top_k}")
    return a


def warn(msg: str):
    print(f"warning: {msg}", file=sys.stderr)


def load_model(a):
    """-> (GPTConfig, params, tokenizer) from a run directory or GPT-2 weights."""
    from flaxgpt import tokenizers
    from flaxgpt.gpt import GPTConfig

    if a.init_from != "resume":
        try:
            from flaxgpt.hf import load_pretrained
        except ImportError as e:
            raise SystemExit(f"error: --init_from {a.init_from} needs flaxgpt.hf ({e})") from None
        config, params = load_pretrained(a.init_from)
        return config, params, tokenizers.get_tokenizer("gpt2")
    from absl import logging as absl_logging

    from flaxgpt.checkpoint import load_for_inference

    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes about read-only directories
    model, params, meta = load_for_inference(a.out_dir, a.step)
    kind = model.pop("kind", "gpt")
    if kind != "gpt":  # run_kind sends seq2seq runs to translate(); anything else is unknown
        raise SystemExit(f"error: {a.out_dir} holds a {kind!r} model; sample.py handles 'gpt' and 'seq2seq'")
    if not meta or "tokenizer" not in meta:
        raise SystemExit(
            f"error: {a.out_dir}/meta.json with a 'tokenizer' entry is missing; copy the "
            "data directory's meta.json into the run directory"
        )
    return GPTConfig.from_dict(model), params, tokenizers.from_meta(meta["tokenizer"])


def run_kind(a) -> str:
    """'gpt' or 'seq2seq': config.json's model.kind of a run directory ('gpt' for GPT-2 weights)."""
    import json
    from pathlib import Path

    path = Path(a.out_dir) / "config.json"
    if a.init_from != "resume" or not path.is_file():
        return "gpt"  # a missing run directory gets load_model's one-line error
    try:
        return json.loads(path.read_text()).get("model", {}).get("kind", "gpt")
    except (ValueError, AttributeError):
        return "gpt"  # a malformed config.json: the checkpoint loader names the problem


def read_prompts(a) -> list[str]:
    if a.prompts_file:
        with open(a.prompts_file, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise SystemExit(f"error: {a.prompts_file} has no non-blank lines")
        return prompts
    start = "\n" if a.start is None else a.start
    if start.startswith("FILE:"):
        with open(start[5:], encoding="utf-8") as f:
            return [f.read()]
    return [start]


def read_sources(a) -> list[str]:
    """The non-blank lines to translate, from --prompts_file or --start (text or FILE:path)."""
    if a.start is None and not a.prompts_file:
        raise ValueError(f"{a.out_dir} is a seq2seq run: give the sources with --start or --prompts_file")
    if a.prompts_file:
        return read_prompts(a)
    text = a.start
    if text.startswith("FILE:"):
        with open(text[5:], encoding="utf-8") as f:
            text = f.read()
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--start {a.start!r} has no non-blank line to translate")
    return lines


def translate(a) -> int:
    """Encoder-decoder runs: one translation per source line on stdout."""
    import warnings

    from absl import logging as absl_logging

    from flaxgpt.seq2seq_task import translate_run

    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes about read-only directories
    gpt_only = {"temperature": 0.8, "top_k": 200, "top_p": 1.0, "num_samples": 1, "dtype": "float32"}
    for name, default in gpt_only.items():
        if getattr(a, name) != default:
            warn(f"--{name} applies to GPT models; {a.out_dir} is decoded with beam search (--beam_size)")
    if a.attention_png:
        raise ValueError("--attention_png draws GPT self-attention; drop it for an encoder-decoder run")
    lines = read_sources(a)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            hyps = translate_run(
                a.out_dir, lines, step=a.step, beam_size=a.beam_size, alpha=a.alpha, truncate=a.truncate
            )
        except ValueError as e:
            raise ValueError(str(e).replace("pass truncate=True", "pass --truncate")) from None
    for w in caught:  # translate_run's "line N cut to K tokens" as this script's warnings; others as usual
        if " cut to " in str(w.message):
            warn(f"{w.message} (--truncate)")
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    for hyp in hyps:
        print(hyp)
    return 0


def attention_png(a, config, params, tok, prompt: str):
    """Writes the attention map of `prompt` for --layers x --heads to --attention_png."""
    from flaxgpt.attention_map import write_attention_png

    write_attention_png(config, params, tok, prompt, a.layers, a.heads, a.attention_png)
    print(f"attention map (layers {a.layers}, heads {a.heads}) written to {a.attention_png}", file=sys.stderr)


def encode(tokenizer, text: str, block_size: int) -> list[int]:
    ids = tokenizer.encode(text)
    if not ids:
        if tokenizer.eot_id is not None:
            return [tokenizer.eot_id]
        # a character vocabulary has no end-of-text token: start from a newline as nanoGPT does
        start = "\n" if "\n" in tokenizer.stoi else tokenizer.chars[0]
        warn(f"empty prompt: starting from {start!r} (this character vocabulary has no end-of-text token)")
        return tokenizer.encode(start)
    if len(ids) > block_size:
        warn(
            f"prompt of {len(ids)} tokens is longer than the context ({block_size}); "
            f"keeping its last {block_size} tokens"
        )
        ids = ids[-block_size:]
    return ids


class Streamer:
    """Prints the new text of a growing token list; holds back a half-decoded UTF-8 character."""

    def __init__(self, tokenizer, out):
        self.tok, self.out, self.ids, self.shown = tokenizer, out, [], 0

    def add(self, ids):
        self.ids.extend(int(i) for i in ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.shown :])
        self.out.flush()
        self.shown = len(text)


def main(argv=None) -> int:
    try:
        a = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    import jax
    import jax.numpy as jnp
    import numpy as np

    from flaxgpt import sampling
    from flaxgpt.cache import KVCache

    try:
        if run_kind(a) == "seq2seq":
            return translate(a)
        config, params, tok = load_model(a)
        texts = read_prompts(a)
        prompts = [encode(tok, text, config.block_size) for text in texts]
        if a.attention_png:  # float32 weights, before any --dtype cast
            attention_png(a, config, params, tok, texts[0])
    except (OSError, ValueError, ImportError) as e:  # CheckpointError is a ValueError; files, vocabulary
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.max_new_tokens == 0:  # the attention map was all that was asked for
        return 0
    if a.dtype != "float32":  # weights in the compute dtype too: decoding is bound by reading them
        import dataclasses

        config = dataclasses.replace(config, dtype=a.dtype, param_dtype=a.dtype)
        params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, a.dtype), params)

    rows = [p for p in prompts for _ in range(a.num_samples)]
    B, P = len(rows), max(map(len, rows))
    prompt_BP = np.zeros((B, P), np.int32)
    for b, ids in enumerate(rows):
        prompt_BP[b, : len(ids)] = ids
    lengths_B = np.array([len(ids) for ids in rows], np.int32)
    W = sampling.cache_length(config.block_size, P, a.max_new_tokens)
    cache = KVCache.for_config(config, B, W)
    kw = dict(
        max_new_tokens=a.max_new_tokens,
        rng=jax.random.key(a.seed),
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        eos_id=tok.eot_id,
    )
    step = sampling.gpt_step_fn(config, params)

    def visible(ids):  # without the end-of-text an empty prompt starts from, or a row stops at
        return [int(t) for t in ids if t != tok.eot_id] if tok.eot_id is not None else list(ids)

    if B == 1:
        streamer = Streamer(tok, sys.stdout)
        streamer.add(visible(rows[0]))
        for out_BC, n_B in sampling.stream_generate(step, cache, prompt_BP, lengths_B, chunk=16, **kw):
            streamer.add(visible(out_BC[0, : n_B[0]]))
        sys.stdout.write("\n")
        return 0
    tokens_BN, n_B = sampling.generate(step, cache, prompt_BP, lengths_B, **kw)
    for b in range(B):
        print(tok.decode(visible(rows[b]) + visible(tokens_BN[b, : n_B[b]])))
        print(SEPARATOR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
