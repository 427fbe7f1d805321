"""The trainer's tasks, one per model kind: a static table, chosen by `config.model.kind`.

    task = make_task(config)   # LMTask (decoder-only GPT), DPOTask (its preference tuning: data.format
                               # = pairs), GRPOOnlineTask (RL on prompts: data.format = prompts) or
                               # Seq2SeqTask (encoder-decoder)

A task is what `Task` lists; tasks never import the trainer. An `online` task (GRPO) also has
`rollout(params, frozen, step, n_rows, process_index) -> (host batch, metrics)`: its train batches are
sampled from the current weights, so the trainer asks for each one after the previous update.
"""

from __future__ import annotations

from typing import Any, Protocol

from flaxgpt.train import sections
from flaxgpt.train.dpo_task import DPOTask
from flaxgpt.train.grpo_online import GRPOOnlineTask
from flaxgpt.train.lm_task import LMTask
from flaxgpt.train.seq2seq_task import Seq2SeqTask


class Task(Protocol):
    """What the trainer asks of a task."""

    kind: str  # models.kind_of(model_config): "gpt" | "seq2seq"
    model_config: Any  # GPTConfig | TransformerConfig
    splits: tuple[str, ...]  # the splits evaluations average the loss over ("train", "val")
    data_dir: Any  # the data directory, whose meta.json (the tokenizer) the run directory keeps
    tokens_per_row: int  # target tokens a batch row holds (tokens per second, MFU)
    pretrained: Any  # parameters to start from (init_from a pretrained model), else None

    def abstract_params(self) -> Any: ...  # boxed ShapeDtypeStructs, with logical axes

    def init_params(self, rng) -> Any: ...

    def loss(self, params, batch, rng, train: bool) -> tuple[Any, Any]: ...  # (summed loss, n targets)

    def batch(self, split: str, step: int, n_rows: int, process_index: int) -> dict: ...  # host [n_rows, ...]

    def evaluate(self, params) -> dict: ...  # the task's own metrics at an evaluation ({}: none)

    def place_frozen(self, mesh) -> tuple[Any, Any]: ...  # LoRA: (the frozen base on mesh, its shardings)


TASKS: dict[str, type[Task]] = {"gpt": LMTask, "dpo": DPOTask, "grpo": GRPOOnlineTask, "seq2seq": Seq2SeqTask}


def task_name(config) -> str:
    """The TASKS key of a run: model.kind, except "dpo" for a GPT trained on preference pairs and "grpo"
    for one trained on prompts."""
    kind = config.model.get("kind", "gpt")
    if kind not in ("gpt", "seq2seq"):
        raise ValueError(f"unknown model.kind {kind!r}; known: gpt, seq2seq")
    tuning = {"pairs": "dpo", "prompts": "grpo"}.get(sections.of(config).data.format)
    return tuning if kind == "gpt" and tuning else kind


def make_task(config) -> Task:
    return TASKS[task_name(config)](config)


def task_loss(task, train: bool):
    """loss(params, batch, rng, frozen): the task's loss, given the frozen base (LoRA) when there is one."""

    def loss(params, batch, rng, frozen):
        if frozen is None:
            return task.loss(params, batch, rng, train)
        return task.loss(params, batch, rng, train, frozen=frozen)

    return loss
