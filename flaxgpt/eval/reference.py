"""lm-evaluation-harness on local files, offline: the reference flaxgpt.eval.evaluate is checked against.

    write_gpt2_tokenizer("model_dir")      # GPT-2's BPE as Hugging Face tokenizer files, from flaxgpt's ranks
    out = run_lm_eval("model_dir", {"hellaswag": "hs.jsonl", "lambada": "lambada.jsonl"}, "tasks_dir")
    out["hellaswag"]["acc_norm"], out["hellaswag"]["loglikelihoods"][0]   # per example: one per ending

lm-eval's own hellaswag and lambada_openai tasks download their data from the Hugging Face hub;
these are the same tasks (the same prompts, `process_docs` and metrics) reading local jsonl files
through the `json` dataset builder. Needs `pip install -e '.[eval]'` (lm-eval, accelerate).
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from flaxgpt import extras

ENDOFTEXT = "<|endoftext|>"

# lm-eval 0.4's tasks/hellaswag/hellaswag.yaml and tasks/lambada/lambada_openai.yaml, data made local
TASK_YAML = {
    "hellaswag": """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
validation_split: validation
process_docs: !function hellaswag_utils.process_docs
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "choices"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""",
    "lambada": """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
}


def write_gpt2_tokenizer(directory) -> None:
    """tokenizer.json + tokenizer_config.json of GPT-2's BPE, built from the ranks flaxgpt ships."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.tiktoken import TikTokenConverter

    from flaxgpt.data.tokenizers import GPT2_PATTERN

    ranks = str(importlib.resources.files("flaxgpt").joinpath("assets/r50k_base.tiktoken"))
    backend = TikTokenConverter(vocab_file=ranks, pattern=GPT2_PATTERN).converted()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=ENDOFTEXT, bos_token=ENDOFTEXT, unk_token=ENDOFTEXT
    )
    tok.save_pretrained(str(directory))


def write_tasks(tasks: dict[str, str], tasks_dir) -> list[str]:
    """lm-eval task YAMLs `local_<task>` for {task: jsonl file}; returns their names."""
    tasks_dir = Path(tasks_dir)
    tasks_dir.mkdir(parents=True, exist_ok=True)
    (tasks_dir / "hellaswag_utils.py").write_text(
        "from lm_eval.tasks.hellaswag.utils import process_docs  # noqa\n"
    )
    names = []
    for task, data in tasks.items():
        name = f"local_{task}"
        text = TASK_YAML[task].format(name=name, data=Path(data).resolve())
        (tasks_dir / f"{name}.yaml").write_text(text)
        names.append(name)
    return names


def run_lm_eval(model_dir, tasks: dict[str, str], tasks_dir, batch_size: int = 16, limit=None) -> dict:
    """{task: {metric: value, "loglikelihoods": per example}} from lm-eval's Hugging Face backend on CPU."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    extras.require("eval", "the lm-eval reference")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    names = write_tasks(tasks, tasks_dir)
    lm = HFLM(pretrained=str(model_dir), device="cpu", batch_size=batch_size)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=names,
        # only our local tasks: indexing lm-eval's thousands of built-in task YAMLs takes ~25 s
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        log_samples=True,
        limit=limit,
        bootstrap_iters=0,  # no standard errors: they cost more than the evaluation here
    )
    return results_by_task(out, tasks, names)


def results_by_task(out: dict, tasks, names) -> dict:
    """lm_eval.simple_evaluate's output (log_samples=True) -> {task: its metrics without standard
    errors, and "loglikelihoods": each example's (hellaswag: a list per example, one per ending)}."""
    results = {}
    for task, name in zip(tasks, names):
        metrics = {k.split(",")[0]: v for k, v in out["results"][name].items() if "stderr" not in k}
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
        metrics["loglikelihoods"] = lls if task == "hellaswag" else [x[0] for x in lls]
        results[task] = metrics
    return results
