"""The trainer's tasks, one per model kind: a static table, chosen by `config.model.kind`.

    task = make_task(config)   # LMTask (decoder-only GPT) or Seq2SeqTask (encoder-decoder)

A task provides: model_config, abstract_params() (boxed, with logical axes), init_params(rng),
loss(params, batch, rng, train) -> (summed float32 loss, number of target tokens),
batch(split, step, n_rows, process_index) -> host-local numpy dict [n_rows, ...],
tokens_per_row, splits, data_dir (whose meta.json the run directory keeps), optionally
evaluate(params) -> extra metrics and `pretrained` (parameters to start from). Tasks never import the trainer.
"""

from __future__ import annotations

from flaxgpt.train.lm_task import LMTask
from flaxgpt.train.seq2seq_task import Seq2SeqTask

TASKS = {"gpt": LMTask, "seq2seq": Seq2SeqTask}


def make_task(config):
    kind = config.model.get("kind", "gpt")
    if kind not in TASKS:
        raise ValueError(f"unknown model.kind {kind!r}; known: {', '.join(TASKS)}")
    return TASKS[kind](config)


def task_loss(task, train: bool):
    """loss(params, batch, rng, frozen): the task's loss, given the frozen base (LoRA) when there is one."""

    def loss(params, batch, rng, frozen):
        if frozen is None:
            return task.loss(params, batch, rng, train)
        return task.loss(params, batch, rng, train, frozen=frozen)

    return loss
