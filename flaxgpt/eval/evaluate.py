"""Evaluate a run or GPT-2 weights on perplexity, HellaSwag, LAMBADA, or (encoder-decoders) translation.

    flaxgpt eval --init_from gpt2 --task hellaswag --data hellaswag_val.jsonl
    flaxgpt eval --init_from gpt2 --task lambada --data lambada_test.jsonl
    flaxgpt eval --init_from gpt2 --task perplexity --data wiki.test.raw --stride 512
    flaxgpt eval --out_dir out/finetune_shakespeare --task perplexity --data texts/
    flaxgpt eval --out_dir out/numbers --task translation --data pairs.tsv --beam_size 4

Prints the results as JSON (--output FILE also writes them, with the per-example log-likelihoods);
on a training run (--out_dir) appends them to its metrics.jsonl at the checkpoint's step as
`<task>_<metric>`. A progress bar on stderr counts scored tokens. Bad input is a one-line error.
See the README's Evaluation section for the data files and the numbers GPT-2 gets.

Under a multi-process launcher (Slurm's srun, mpirun, SkyPilot, a GKE JobSet, a TPU pod: found by
flaxgpt.cluster, no flag) every process runs the same command: each scores its share of the requests
on its own devices (flaxgpt.eval.shards), and process 0 alone prints and writes the results.
Translation is not split: every process decodes every pair.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TASKS = ("perplexity", "hellaswag", "lambada", "translation")
# the flags one kind of task reads, with their defaults (--dtype, --limit, --step, --output: every task)
GPT_FLAGS = {"window": 0, "stride": 0, "convention": "both", "batch_tokens": 8192, "cpu_devices": 0}
TRANSLATION_FLAGS = {"beam_size": None, "alpha": None, "truncate": False}


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="flaxgpt eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--out_dir", help="a flaxgpt training run")
    src.add_argument("--init_from", help="GPT-2 weights: gpt2 .. gpt2-xl, or a Hugging Face GPT-2 directory")
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--data", required=True, help="the task's file (perplexity: a text file or folder)")
    p.add_argument(
        "--step", type=int, default=None, help="checkpoint step of --out_dir (default: the latest)"
    )
    p.add_argument("--limit", type=int, default=0, help="only the first N examples (0 = all)")
    p.add_argument("--window", type=int, help="perplexity: tokens a window sees (0 = block_size)")
    p.add_argument("--stride", type=int, help="perplexity: window step (0 = no sliding)")
    p.add_argument(
        "--convention",
        choices=["both", "lm_eval", "nanogpt"],
        help="hellaswag: lm-evaluation-harness's, build-nanogpt's, or both",
    )
    p.add_argument("--batch_tokens", type=int, help="padded tokens per batch (memory)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--cpu_devices", type=int, help="CPU only: devices to split it into (0 = cores)")
    p.add_argument("--beam_size", type=int, help="translation: beam width (1 = greedy; the run's, else 4)")
    p.add_argument("--alpha", type=float, help="translation: length penalty (the run's, else 0.6)")
    p.add_argument("--truncate", action="store_true", help="translation: cut long sources (else an error)")
    p.add_argument("--output", default=None, help="also write the results (with per-example scores) here")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.set_defaults(
        **GPT_FLAGS, **TRANSLATION_FLAGS
    )  # one owner of those defaults: the check below reads them
    a = p.parse_args(argv)
    for name in ("limit", "window", "stride", "cpu_devices"):
        if getattr(a, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(a, name)}")
    if a.batch_tokens < 1 or (a.beam_size is not None and a.beam_size < 1):
        raise ValueError(f"--batch_tokens and --beam_size must be >= 1, got {a.batch_tokens}, {a.beam_size}")
    # a flag another task reads is an error here, not a setting silently left unused
    theirs = GPT_FLAGS if a.task == "translation" else TRANSLATION_FLAGS
    given = [name for name, default in theirs.items() if getattr(a, name) != default]
    if given:
        which = "perplexity, hellaswag and lambada" if a.task == "translation" else "translation"
        flags = ", ".join(f"--{name}" for name in given)
        verb, them = ("applies", "it") if len(given) == 1 else ("apply", "them")
        raise ValueError(f"{flags} {verb} to {which} only, not --task {a.task}; leave {them} out")
    if a.output:  # before the evaluation, not after it
        folder = os.path.dirname(os.path.abspath(a.output))
        if os.path.isdir(a.output) or not os.path.isdir(folder):
            why = "is a directory" if os.path.isdir(a.output) else f"is in {folder}, which does not exist"
            raise ValueError(f"--output {a.output} {why}; pass a file path in an existing directory")
    return a


def check_tokenizer(tokenizer, vocab_size: int, source: str, hf_dir: str | None = None) -> None:
    """One-line errors when the tokenizer cannot be the model's."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer mismatch: {source}'s tokenizer has {tokenizer.vocab_size} tokens but the "
            f"model's vocabulary has {vocab_size}"
        )
    path = os.path.join(hf_dir or "", "tokenizer.json")
    if hf_dir and os.path.isfile(path) and not hasattr(tokenizer, "file"):  # GPT-2 weights: GPT-2's BPE
        from tokenizers import Tokenizer

        probe = "Hello world! It's 2024: naïve café, 12345 tokens.\n  end"
        theirs, ours = Tokenizer.from_file(path).encode(probe).ids, tokenizer.encode(probe)
        if theirs != ours:
            raise ValueError(
                f"tokenizer mismatch: {path} encodes text differently from GPT-2's BPE, which flaxgpt "
                f"uses for Hugging Face weights ({theirs[:6]} vs {ours[:6]})"
            )


def load(a):
    """(kind, config, params, tokenizer, step) from --init_from or --out_dir."""
    import dataclasses

    from flaxgpt import loader

    if a.out_dir:
        loader.require_run(a.out_dir)
    kind, config, params, tokenizer = loader.load(a.init_from or a.out_dir, step=a.step)
    # the compute dtype of either kind; weights stay as loaded (scores in float32 either way)
    config = dataclasses.replace(config, dtype=a.dtype)
    if a.init_from:
        from flaxgpt.hf.files import resolve

        check_tokenizer(tokenizer, config.vocab_size, a.init_from, resolve(a.init_from))
        return kind, config, params, tokenizer, None
    from flaxgpt.runs.run_dir import checkpoint_step

    check_tokenizer(tokenizer, config.vocab_size, a.out_dir)
    return kind, config, params, tokenizer, checkpoint_step(a.out_dir, a.step)


def evaluate(a, kind, config, params, tokenizer) -> dict:
    """The task's metrics (and `tokens_per_second` for the GPT tasks)."""
    from flaxgpt.eval import tasks as et

    if (kind == "seq2seq") != (a.task == "translation"):
        want = "translation" if kind == "seq2seq" else "perplexity, hellaswag or lambada"
        raise ValueError(f"--task {a.task} does not apply to a {kind!r} model; use {want}")
    if a.task == "translation":
        pairs = et.read_pairs(a.data, tokenizer)[: a.limit or None]
        from flaxgpt.runs import run_dir  # the flags, else the run's recipe

        settings = run_dir.translation_settings(a.out_dir, a.beam_size, a.alpha)
        return et.translation(config, params, tokenizer, pairs, truncate=a.truncate, **settings)
    import jax

    from flaxgpt.eval.scoring import Scorer
    from flaxgpt.eval.shards import ProcessShards

    window = a.window or config.block_size
    if window > config.block_size:
        raise ValueError(f"--window {window} is longer than the model's block_size {config.block_size}")
    data = et.load_data(a.task, a.data, a.limit)
    main_process = jax.process_index() == 0
    scorer = Scorer(
        config, params, batch_tokens=a.batch_tokens, progress=main_process and not a.no_progress,
        devices=jax.local_devices(),
    )  # fmt: skip
    if jax.process_count() > 1:
        scorer = ProcessShards(scorer)
    start = time.perf_counter()
    conventions = ("lm_eval", "nanogpt") if a.convention == "both" else (a.convention,)
    metrics = et.score_task(
        a.task, scorer, tokenizer, data, window=window, stride=a.stride or None, conventions=conventions
    )
    seconds = time.perf_counter() - start
    metrics.update(
        seconds=seconds, tokens_scored=scorer.tokens_seen, tokens_per_second=scorer.tokens_seen / seconds
    )
    return metrics


def main(argv=None) -> dict:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    from flaxgpt import cluster, extras, sharding

    extras.require_hf(a.init_from, "flaxgpt eval --init_from")  # before loading anything
    cluster.join()  # Slurm, Open MPI, SkyPilot, a GKE JobSet, a TPU pod: every process scores a share

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    sharding.configure_cpu_devices(a.cpu_devices or cores, 1)
    kind, config, params, tokenizer, step = load(a)
    metrics = evaluate(a, kind, config, params, tokenizer)
    results = {"task": a.task, "data": a.data, "model": a.init_from or a.out_dir, "step": step, **metrics}
    summary = {k: v for k, v in results.items() if not isinstance(v, list)}
    import jax

    if jax.process_index():  # every process has every score; process 0 alone reports them
        return results
    print(json.dumps(summary, indent=2))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(results, f)
    if a.out_dir:
        append_to_run(a.out_dir, a.task, step, summary)
    return results


def append_to_run(out_dir: str, task: str, step: int | None, summary: dict) -> None:
    """The scores as a line of the run's metrics.jsonl; a run the user may only read (a shared
    checkpoint) keeps its results printed above, with a note, not an error after them."""
    from flaxgpt.runs.metrics import MetricsWriter

    skip = ("n", "seconds", "tokens_scored", "tokens_per_second", "task", "data", "model", "step")
    try:
        writer = MetricsWriter(out_dir, tensorboard=False, print_fn=lambda line: None)
        writer.write(step or 0, {f"{task}_{k}": v for k, v in summary.items() if k not in skip})
        writer.close()
    except OSError as e:
        print(f"note: the scores were not added to {out_dir}'s metrics.jsonl ({e})", file=sys.stderr)


def cli(argv=None) -> int:
    """`flaxgpt eval`: main with bad input as one line (CheckpointError and RunError are ValueErrors)."""
    from flaxgpt import errors
    from flaxgpt.data.dataset_files import PrepareError

    return errors.run_cli(main, argv, errors=(ValueError, OSError, PrepareError))


if __name__ == "__main__":
    from flaxgpt import runtime

    runtime.setup()
    sys.exit(cli())
