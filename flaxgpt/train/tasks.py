"""The trainer's task: an objective x a policy x a batch source, composed from a static table chosen by
`config.model.kind` and `data.format`. No task subclasses another.

    task = make_task(config)                    # reads the data; the start's weights when init_from has them
    task = Task.abstract(config, model_config)  # flaxgpt aot: no data, shapes instead of weights

- objective (the loss given the policy's model call): lm_task.LMObjective (GPT), dpo_task.DPOObjective
  (data.format = pairs), grpo_task.GRPOObjective (data.format = prompts), seq2seq_task.Seq2SeqObjective;
- policy (train.policy): FullPolicy, or LoraPolicy (lora.rank > 0): how the trained parameters and
  the frozen weights (`Frozen(base, reference)`) are applied;
- batch source: fixed data (lm_task.TokenBatches, seq2seq_task.PairBatches) or online rollouts
  (grpo_online.Rollouts, `online`: the trainer asks `rollout(params, frozen, step, n_rows,
  process_index) -> (host batch, metrics)` after each update). Task.abstract has none.

`Task` is the trainer's one seam: tasks never import the trainer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import linen as nn

from flaxgpt.models import gpt
from flaxgpt.models import registry as models
from flaxgpt.train import dpo_task, grpo_online, lm_task, policy, sections, seq2seq_task
from flaxgpt.train.policy import ABSTRACT, NONE, REAL, Frozen


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a task is opened and composed: its data, its objective and its batch source."""

    open: Any  # open(config) -> (data, model config, the start's weights or None)
    objective: Any  # objective(config, model_config, data or None) -> the objective
    source: Any  # source(config, data, policy, objective) -> the batch source


TASKS: dict[str, Recipe] = {
    "gpt": Recipe(lm_task.open_data, lm_task.LMObjective, lm_task.TokenBatches),
    "dpo": Recipe(lm_task.open_data, dpo_task.DPOObjective, lm_task.TokenBatches),
    "grpo": Recipe(grpo_online.open_prompts, grpo_online.objective, grpo_online.Rollouts),
    "seq2seq": Recipe(seq2seq_task.open_pairs, seq2seq_task.Seq2SeqObjective, seq2seq_task.PairBatches),
}


def task_name(config) -> str:
    """The TASKS key of a run: model.kind, except "dpo" for a GPT trained on preference pairs and "grpo"
    for one trained on prompts."""
    kind = config.model.get("kind", "gpt")
    if kind not in ("gpt", "seq2seq"):
        raise ValueError(f"unknown model.kind {kind!r}; known: gpt, seq2seq")
    tuning = {"pairs": "dpo", "prompts": "grpo"}.get(sections.of(config).data.format)
    return tuning if kind == "gpt" and tuning else kind


class Task:
    """What the trainer asks of a run: parameters, the loss, batches, evaluations, frozen weights."""

    def __init__(self, config, model_config, start=None, data=None, mode=REAL):
        """The task of `config` over `model_config`, from the start's weights (None: fresh) and the
        opened data (None: no batch source, flaxgpt aot's); `mode` holds weights as arrays or shapes."""
        recipe = TASKS[task_name(config) if models.kind_of(model_config) == "gpt" else "seq2seq"]
        self.model_config, self.mode = model_config, mode
        self.kind = models.kind_of(model_config)  # "gpt" | "seq2seq"
        self.policy = policy.make_policy(config, model_config)
        self.objective = recipe.objective(config, model_config, data)
        reference = None
        if self.objective.needs_reference and self.policy.lora is None:  # LoRA: the base, adapters off
            reference = self.objective.reference(config, start, mode)
        self.frozen = Frozen(base=mode.run(self.policy.base, start), reference=reference)  # host / abstract
        # parameters to start from (init_from a pretrained model), else None (LoRA: the base is frozen)
        self.pretrained = start if self.policy.lora is None else None
        self.source = None if data is None else recipe.source(config, data, self.policy, self.objective)
        self.online = bool(self.source is not None and self.source.online)
        self.splits = () if self.source is None else self.source.splits  # evaluations' loss averages
        self.data_dir = None if self.source is None else self.source.data_dir  # its meta.json: the run's
        self.tokens_per_row = self.objective.tokens_per_row  # target tokens a row (tokens/s, MFU)
        self.num_iterations = getattr(self.source, "num_iterations", 1)  # optimizer steps a batch

    @classmethod
    def abstract(cls, config, model_config) -> Task:
        """The task with no data and shapes instead of weights (flaxgpt aot compiles its steps): the
        start is the model's parameter shapes (a GPT's: LoRA's base, DPO / GRPO's reference)."""
        start = nn.unbox(gpt.abstract_params(model_config)) if models.kind_of(model_config) == "gpt" else None
        return cls(config, model_config, start, None, ABSTRACT)

    def abstract_params(self):
        """The trained parameters as boxed ShapeDtypeStructs, with logical axes (LoRA: the adapters)."""
        return self.policy.abstract_params()

    def init_params(self, rng):
        return self.policy.init_params(rng)

    def batch_shapes(self, n_rows: int) -> dict:
        """{name: (shape, dtype)} of `batch(split, step, n_rows, ...)` (its largest: seq2seq buckets)."""
        return self.objective.batch_shapes(n_rows)

    def loss(self, params, batch, rng, train: bool, frozen: Frozen = NONE):
        """(summed loss, weight) or (summed loss, (weight, {name: metric sum}))."""
        return self.objective.loss(self.policy, params, frozen, batch, rng, train)

    def batch(self, split: str, step: int, n_rows: int, process_index: int) -> dict:
        """Host batch [n_rows, ...]: train batches follow the step; eval batch i is fixed."""
        return self.source.batch(split, step, n_rows, process_index)

    def rollout(self, params, frozen: Frozen, step: int, n_rows: int, process_index: int = 0):
        """An online task's (host batch, metrics) sampled from the weights."""
        return self.source.rollout(params, frozen, step, n_rows, process_index)

    def before_update(self, params, step: int) -> None:
        """An online task's hook before update `step` is dispatched (the update donates `params`)."""
        self.source.before_update(params, step)

    def evaluate(self, params, frozen: Frozen = NONE) -> dict:
        """The task's own metrics at an evaluation ({}: none)."""
        return self.source.evaluate(params, frozen)

    def devices(self, devices):
        """The devices the trainer's mesh spans: `devices` (None: all), less those an online source
        keeps for itself (GRPO's grpo.engine_devices: the engine's own)."""
        reserve = getattr(self.source, "reserve", None)
        return devices if reserve is None else reserve(devices)

    def place_frozen(self, mesh) -> tuple[Frozen, Frozen]:
        """(the frozen weights on `mesh`, their shardings): sharded as FSDP shards the parameters."""
        shardings = policy.frozen_shardings(self.model_config, self.frozen, mesh)
        placed = self.mode.place(self.frozen, shardings)
        if self.source is not None:  # GRPO's engine follows the weights over the devices
            self.source.on_mesh(mesh, placed)
        return placed, shardings


def make_task(config) -> Task:
    """The run's task: its data opened, the model and the start's weights init_from gives."""
    data, model_config, start = TASKS[task_name(config)].open(config)
    return Task(config, model_config, start, data)
