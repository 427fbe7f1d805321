"""Evaluation throughput: flaxgpt.eval vs lm-evaluation-harness's Hugging Face backend, same model and data.

    python benchmarks/eval_throughput.py                              # HellaSwag-shaped, GPT-2 124M, 200 docs
    python benchmarks/eval_throughput.py --task lambada --n 400
    python benchmarks/eval_throughput.py --n 16 --n_layer 2 --n_embd 64 --pause 1   # a smoke run

A GPT-2 124M config with random weights (speed does not depend on the values) saved as a Hugging
Face directory with GPT-2's tokenizer, and synthetic task files of the real tasks' shapes (HellaSwag:
a context of ~40-90 words and 4 endings of ~8-30; LAMBADA: ~60-100 words). Each side runs in its
own process through benchmarks/harness.py (the order alternating every round, --pause seconds of
rest before each run, at least 4 rounds): `flaxgpt eval` (lm-eval's conventions) and lm-eval's
`simple_evaluate` on the HF backend (CPU, float32, --lm_eval_batch_size). Both count the same
tokens: context + continuation of every request as lm-eval tokenizes them. Times exclude model
loading; flaxgpt's include compilation. Needs `pip install -e '.[hf,eval]'`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their has would when if so no will can more "
    "about out up them into could time only new some like then other now people over just after man "
    "house water cut bowl mix place hand small pan stir oven bake table chair walk front ball player"
).split()


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_data(task: str, n: int, path: Path, seed: int = 0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            if task == "hellaswag":
                a, b = sentence(rng, rng.randint(30, 70)), sentence(rng, rng.randint(4, 12))
                endings = [sentence(rng, rng.randint(8, 30)) + "." for _ in range(4)]
                doc = {"activity_label": "Baking", "ctx_a": a, "ctx_b": b, "ctx": a + " " + b.capitalize()}
                doc.update(endings=endings, label=str(rng.randint(0, 3)), ind=i)
            else:
                doc = {"text": sentence(rng, rng.randint(60, 100))}
            f.write(json.dumps(doc) + "\n")


def make_model(directory: Path, n_layer: int, n_embd: int, n_head: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from flaxgpt.eval.reference import write_gpt2_tokenizer

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)).save_pretrained(directory)
    write_gpt2_tokenizer(directory)


def cpu_seconds() -> float:
    """CPU time of this process, all threads: on a shared machine, less sensitive to the others' load."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def side_flaxgpt(a) -> dict:
    from flaxgpt.eval import evaluate as fe
    from flaxgpt.eval import tasks as eval_tasks

    argv = ["--init_from", a.model_dir, "--task", a.task, "--data", a.data, "--convention", "lm_eval"]
    cpu = [0.0]
    score_task = eval_tasks.score_task

    def timed(*args, **kw):  # the CPU time of the region evaluate() reports the wall time of
        start = cpu_seconds()
        out = score_task(*args, **kw)
        cpu[0] = cpu_seconds() - start
        return out

    eval_tasks.score_task = timed
    r = fe.main(argv + ["--batch_tokens", str(a.batch_tokens), "--no_progress"])
    return {"seconds": r["seconds"], "tokens": r["tokens_scored"], "cpu_seconds": cpu[0]}


def side_lm_eval(a) -> dict:
    import torch  # no flaxgpt import here: this side may run under another venv (--torch_python)

    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    import lm_eval
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks_dir, names = a.tasks_dir, [a.task_name]
    lm = HFLM(pretrained=a.model_dir, device="cpu", batch_size=a.lm_eval_batch_size, dtype="float32")
    tokens = 0
    original = lm._loglikelihood_tokens

    def counting(requests, **kw):  # the tokens lm-eval scores: context + continuation per request
        nonlocal tokens
        tokens += sum(len(ctx) + len(cont) for _, ctx, cont in requests)
        return original(requests, **kw)

    lm._loglikelihood_tokens = counting
    start, cpu = time.perf_counter(), cpu_seconds()
    lm_eval.simple_evaluate(
        model=lm, tasks=names, task_manager=TaskManager(include_path=tasks_dir), bootstrap_iters=0
    )
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return {
        "seconds": seconds,
        "tokens": tokens,
        "cpu_seconds": cpu,
        "torch_threads": torch.get_num_threads(),
        "versions": f"lm-eval {lm_eval.__version__}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}",
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="hellaswag", choices=["hellaswag", "lambada"])
    p.add_argument("--n", type=int, default=200, help="documents")
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--batch_tokens", type=int, default=8192, help="flaxgpt's padded tokens per batch")
    p.add_argument("--lm_eval_batch_size", type=int, default=16)
    p.add_argument("--torch_python", default=sys.executable, help="interpreter for the lm-eval side")
    harness.add_arguments(p)
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)  # internal: run one side
    p.add_argument("--tasks_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--task_name", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.side:
        r = (side_flaxgpt if a.side == "flaxgpt" else side_lm_eval)(a)
        r["tok_s"], r["tok_cpu_s"] = r["tokens"] / r["seconds"], r["tokens"] / r["cpu_seconds"]
        return harness.print_result(r)
    work = Path(tempfile.mkdtemp(prefix="eval_bench_"))
    make_model(work / "model", a.n_layer, a.n_embd, a.n_head)
    write_data(a.task, a.n, work / "data.jsonl")
    from flaxgpt.eval.reference import write_tasks

    (name,) = write_tasks({a.task: str(work / "data.jsonl")}, work / "tasks")
    args = ["--model_dir", str(work / "model"), "--data", str(work / "data.jsonl"), "--task", a.task]
    args += ["--n", str(a.n), "--tasks_dir", str(work / "tasks"), "--task_name", name]
    args += ["--batch_tokens", str(a.batch_tokens), "--lm_eval_batch_size", str(a.lm_eval_batch_size)]
    env = {"PYTHONPATH": str(ROOT)}
    sides = [
        harness.Side("flaxgpt", [sys.executable, __file__, *args, "--side", "flaxgpt"], env=env),
        harness.Side("lm-eval", [a.torch_python, __file__, *args, "--side", "lm_eval"], env=env),
    ]
    label = f"{a.task}, {a.n} documents"
    figures = [
        harness.Figure(f"{label}: tokens/s (wall)", "flaxgpt", "tok_s", "lm-eval", "tok_s"),
        harness.Figure(f"{label}: tokens per CPU second", "flaxgpt", "tok_cpu_s", "lm-eval", "tok_cpu_s"),
    ]
    report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    for rnd in report.results:
        assert rnd["flaxgpt"]["tokens"] == rnd["lm-eval"]["tokens"], rnd  # both score the same requests
    ref = report.results[0]["lm-eval"]
    print(f"\n{ref['tokens']} tokens per side; lm-eval: {ref['versions']} ({ref['torch_threads']} threads)")
    print(report.table())


if __name__ == "__main__":
    main()
