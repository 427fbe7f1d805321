"""Translation with the encoder-decoder: source ids -> target ids (`generate`), text -> text
(`translate`), a training run's lines -> lines (`translate_run`).

    tokens_BN = generate(params, src_BS, src_lengths_B, config=config, beam_size=4, max_len=64,
                         alpha=0.6, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    lines = translate(config, params, tokenizer, ["a line", ...], beam_size=4)

One decoder for every beam size: `beam_search.beam_search` over the model's adapter
(`seq2seq.start_decoding`, `seq2seq.step_fn`); beam_size 1 is greedy decoding.

Shape letters: B sources, S source length, N decoded tokens.
"""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np

from flaxgpt import loader
from flaxgpt.decode.beam_search import beam_search
from flaxgpt.models import seq2seq


@functools.partial(
    jax.jit, static_argnames=("config", "beam_size", "max_len", "alpha", "bos_id", "eos_id", "pad_id")
)
def generate(
    params,
    src_BS,
    src_lengths_B,
    *,
    config: seq2seq.TransformerConfig,
    beam_size: int = 4,
    max_len: int = 64,
    alpha: float = 0.6,
    bos_id: int = 1,
    eos_id: int = 2,
    pad_id: int = 0,
):
    """Target tokens [B, max_len] (EOS kept, pad after) for each source: the best beam, or greedy
    when beam_size == 1. The source is encoded and projected for cross-attention once."""
    B, W = src_BS.shape[0], beam_size
    if W < 1:  # before the cache: beams=W sizes its buffers (a negative size was a JAX TypeError)
        raise ValueError(f"beam_size {W} must be >= 1 (1: greedy decoding)")
    cache, src_lengths_R = seq2seq.start_decoding(
        config, params, src_BS, src_lengths_B, beams=W, max_len=max_len
    )
    seqs_BWN, _ = beam_search(
        seq2seq.step_fn(config, params, src_lengths_R),
        cache,
        batch_size=B,
        beam_size=W,
        max_len=max_len,
        # one beam at alpha 0 stops at its first EOS, i.e. greedy decoding; a length penalty
        # could let it continue past that EOS and replace it with a longer sequence
        alpha=alpha if W > 1 else 0.0,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
    )
    return seqs_BWN[:, 0]


def translate(
    config: seq2seq.TransformerConfig,
    params,
    tokenizer,
    lines,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len: int | None = None,
    batch_size: int = 32,
    truncate: bool = False,
) -> list[str]:
    """Text in, text out: encode each line (+ EOS), decode in batches, detokenize up to EOS.

    `tokenizer` is a Seq2SeqTokenizer (pad_id, bos_id, eos_id). A line longer than the model's
    block_size - 1 tokens is an error, or cut with a warning when `truncate`.
    """
    max_len = max_len or config.block_size
    ids = []
    for i, line in enumerate(lines):
        toks = tokenizer.encode(line)
        if len(toks) > config.block_size - 1:
            if not truncate:
                raise ValueError(
                    f"line {i + 1} has {len(toks)} tokens, more than block_size - 1 = "
                    f"{config.block_size - 1}; shorten it or pass --truncate (truncate=True)"
                )
            warnings.warn(f"line {i + 1} cut to {config.block_size - 1} tokens", stacklevel=2)
            toks = toks[: config.block_size - 1]
        ids.append(toks + [tokenizer.eos_id])
    out = []
    for start in range(0, len(ids), batch_size):
        chunk = ids[start : start + batch_size]
        # fixed batch rows and source lengths in multiples of 16: few shapes, few compilations
        S = min(config.block_size, -(-max(len(t) for t in chunk) // 16) * 16)
        src = np.full((batch_size, S), tokenizer.pad_id, np.int32)
        lengths = np.ones(batch_size, np.int32)
        for b, t in enumerate(chunk):
            src[b, : len(t)], lengths[b] = t, len(t)
        tokens = generate(
            params,
            src,
            lengths,
            config=config,
            beam_size=beam_size,
            max_len=max_len,
            alpha=alpha,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
        )
        out += [tokenizer.decode(row) for row in np.asarray(tokens)[: len(chunk)]]
    return out


def translate_run(out_dir, lines, *, step: int | None = None, **options) -> list[str]:
    """`translate` with the model, weights and tokenizer of a seq2seq training run (flaxgpt.load)."""
    loader.require_run(out_dir)
    run = loader.load(out_dir, step=step)
    if run.kind != "seq2seq":
        raise ValueError(f"{out_dir} holds a {run.kind!r} model, not an encoder-decoder ('seq2seq') run")
    return translate(run.config, run.params, run.tokenizer, lines, **options)
