"""Sample text from a trained run or from GPT-2.

    python sample.py --out_dir out/shakespeare_char --start "ROMEO:" --num_samples 5 --max_new_tokens 500
    python sample.py --init_from gpt2 --start "The meaning of life is" --temperature 0.8 --top_k 200
    python sample.py --init_from gpt2 --start FILE:prompt.txt --top_p 0.9 --seed 7
    python sample.py --out_dir out/run --prompts_file prompts.txt --temperature 0     # greedy, one per line

A single sample streams to the terminal as it is decoded; several are printed one after another,
separated by a line of dashes. The same seed gives the same output. GPT-2 BPE samples stop at
<|endoftext|>. Bad input is a one-line error (exit code 1) or, where sampling can go on, a warning.
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
    p.add_argument("--start", default="\n", help='the prompt, or FILE:prompt.txt (default "\\n")')
    p.add_argument("--prompts_file", default=None, help="one prompt per line (blank lines are skipped)")
    p.add_argument("--num_samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--max_new_tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="0 = off")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = p.parse_args(argv)
    if a.temperature < 0:
        raise ValueError(f"--temperature {a.temperature} is negative; use 0 for greedy or a positive value")
    if not 0 < a.top_p <= 1:
        raise ValueError(f"--top_p {a.top_p} is outside (0, 1]; 1 turns nucleus sampling off")
    for name in ("num_samples", "max_new_tokens"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(a, name)}")
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
    if kind != "gpt":  # the encoder-decoder samples with beam search from its own entry point
        raise SystemExit(f"error: {a.out_dir} holds a {kind!r} model; sample.py handles 'gpt' runs only")
    if not meta or "tokenizer" not in meta:
        raise SystemExit(
            f"error: {a.out_dir}/meta.json with a 'tokenizer' entry is missing; copy the "
            "data directory's meta.json into the run directory"
        )
    return GPTConfig.from_dict(model), params, tokenizers.from_meta(meta["tokenizer"])


def read_prompts(a) -> list[str]:
    if a.prompts_file:
        with open(a.prompts_file, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise SystemExit(f"error: {a.prompts_file} has no non-blank lines")
        return prompts
    if a.start.startswith("FILE:"):
        with open(a.start[5:], encoding="utf-8") as f:
            return [f.read()]
    return [a.start]


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
        config, params, tok = load_model(a)
        prompts = [encode(tok, text, config.block_size) for text in read_prompts(a)]
    except (OSError, ValueError) as e:  # CheckpointError is a ValueError; files, vocabulary, config
        print(f"error: {e}", file=sys.stderr)
        return 1
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
