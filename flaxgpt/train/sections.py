"""A recipe's data, mesh, lora, dpo and grpo sections as typed, frozen dataclasses: every field with its
type, its default and why it is there, read from the recipe's ConfigDict with one-line errors. The
checker reads the types: an unknown key is answered with the field it most likely means, a value of the
wrong type names the key, the type and the value, a `Literal` lists its choices and a number outside
its range (`opt(low=, high=)`) says the range. A rule between fields of one section is that section's
`check`; a rule between sections is `Sections.check`: each refusal is written once.

    s = of(config)                  # Sections(data, mesh, lora, dpo, grpo), every rule checked
    s.lora.rank, s.grpo.rollout     # what the tasks, the trainer and flaxgpt aot read
    c.lora = ml_collections.ConfigDict(defaults("lora"))   # configs/default.py's, from the fields

Rules that also read the run's top-level keys (batch_size, init_from, eval_tasks) or its data are
config_check's.
"""

import dataclasses
from typing import ClassVar, Literal

from flaxgpt import errors
from flaxgpt.models import lora as lora_lib
from flaxgpt.train import grpo_task
from flaxgpt.train.typed import ConfigError, Section, opt, typed

__all__ = ["ConfigError", "Section", "Sections", "defaults", "of", "opt", "read", "typed"]

DPO_LOSSES = ("sigmoid", "ipo")  # dpo.loss: DPO's sigmoid loss | IPO's squared one (dpo_task)
FORMATS = ("tokens", "shards", "packed", "pairs", "prompts")  # data.format: the tasks' (train.tasks)


@dataclasses.dataclass(frozen=True)
class DataSection(Section):
    """Where the prepared data is and how the task reads it (flaxgpt prepare writes it)."""

    name: ClassVar[str] = "data"
    dir: str = opt("data/shakespeare_char", "folder with train.bin, val.bin, meta.json: flaxgpt.data.prepare")
    format: Literal[FORMATS] = opt(
        "tokens",
        "tokens (train.bin/val.bin, random windows) | shards (speedrun *.bin, in order) | packed (chat "
        "SFT) | pairs (DPO: flaxgpt prepare --dataset pairs) | prompts (GRPO: --dataset prompts)",
    )
    align_to_bos: bool = opt(False, "shards: every training window starts at a document's first token")
    val_tokens: int = opt(10_485_760, "shards: the fixed val set, the first this many val tokens")


@dataclasses.dataclass(frozen=True)
class MeshSection(Section):
    """How the devices are arranged (flaxgpt.sharding.make_mesh): data parallel x FSDP x experts x
    context (sequences split over devices)."""

    name: ClassVar[str] = "mesh"
    data: int = opt(-1, "data-parallel devices; -1 = all devices left after fsdp")
    fsdp: int = opt(1, "devices that shard parameters and optimizer state, ZeRO-3 style")
    expert: int = opt(1, "mixture of experts: devices that split the experts, expert parallelism", 1)
    context: int = opt(
        1,
        "devices that split every sequence (attention over them: model.context_impl ring | ulysses); "
        "ring needs the sequence length divisible by 2 x this",
        1,
    )
    cpu_devices: int = opt(0, "CPU: split the host into this many devices; 0 = one per core", 0)

    def check(self) -> None:
        for axis in ("data", "fsdp"):  # -1: the devices the other axis leaves (sharding.make_mesh)
            size = getattr(self, axis)
            if size != -1 and size < 1:
                raise ConfigError(f"--config.mesh.{axis}={size} must be >= 1, or -1 for all devices left")
        if self.data == -1 and self.fsdp == -1:
            raise ConfigError("only one of --config.mesh.data and --config.mesh.fsdp may be -1")


@dataclasses.dataclass(frozen=True)
class LoraSection(Section):
    """LoRA (flaxgpt/models/lora.py): low-rank adapters trained on a frozen pretrained base (init_from)."""

    name: ClassVar[str] = "lora"
    rank: int = opt(0, "adapter rank r; 0 = off, full fine-tuning", 0)
    alpha: float = opt(16.0, "the adapters' output is scaled by alpha / r")
    dropout: float = opt(0.0, "dropout on each adapted layer's input, adapter path only, in training", 0, 1)
    targets: str = opt(
        "all-linear",
        "all-linear | a comma list: q,k,v,o,gate,up,down (Llama family) or qkv,o,up,down (GPT-2)",
    )
    base_dtype: Literal[lora_lib.BASE_DTYPES] = opt("float32", "the frozen base; int8: QLoRA-style")


@dataclasses.dataclass(frozen=True)
class DPOSection(Section):
    """DPO (data.format = pairs, flaxgpt/train/dpo_task.py): the policy is tuned toward chosen responses
    against a frozen reference (LoRA: the base with the adapters off; full fine-tuning: a copy)."""

    name: ClassVar[str] = "dpo"
    beta: float = opt(
        0.1, "how far the policy may move from the reference: TRL's beta, IPO's tau", 0, low_in=False
    )
    loss: Literal[DPO_LOSSES] = opt(
        "sigmoid", "sigmoid: DPO | ipo: IPO, per-token averaged log-ratios as TRL"
    )
    label_smoothing: float = opt(0.0, "sigmoid: conservative DPO, the probability a label is flipped", 0, 0.5)
    reference: str = opt("", "full fine-tuning: the reference's HF directory; '' = init_from's weights")

    def check(self) -> None:
        if self.label_smoothing and self.loss != "sigmoid":
            raise ConfigError(
                f"--config.dpo.label_smoothing={self.label_smoothing} smooths the sigmoid loss, "
                f"not {self.loss}"
            )


@dataclasses.dataclass(frozen=True)
class GRPOSection(grpo_task.GRPOOptions):
    """GRPO (data.format = prompts, flaxgpt/train/grpo_online.py): each step samples num_generations
    completions of batch_size // num_generations prompts from the current weights, scores them with the
    rewards and trains on the group-normalised advantages. The objective's fields (loss_type, epsilon,
    beta, temperature, ...) and their rules are grpo_task.GRPOOptions'; these are the run's. Names and
    defaults are TRL 1.16's."""

    num_generations: int = opt(8, "G: completions a prompt, >= 2; batch_size counts completions")
    top_p: float = opt(1.0, "nucleus sampling of the rollouts; 1 = off", 0, 1, low_in=False, high_in=True)
    rollout: Literal[grpo_task.ROLLOUTS] = opt(
        "engine", "who samples: engine (serve.engine, continuous batching) | generate"
    )
    merge_lora: bool = opt(
        True,
        "LoRA over a float32 base: rollouts decode the base with the adapters merged (one more copy of "
        "the base); false, or a bfloat16 / int8 base: the adapters added unmerged",
    )
    scale_rewards: Literal[grpo_task.SCALES] = opt("group", "advantages over the group's std | batch | none")
    num_iterations: int = opt(1, "optimizer steps on each rollout; > 1: the sampling policy's logps kept", 1)
    mask_truncated_completions: bool = opt(False, "completions that hit max_completion_length train nothing")
    reward_funcs: tuple[str, ...] = opt(
        ("answer",), "rewards, flaxgpt/train/rewards.py: answer | format=REGEX | length=N | module:function"
    )
    reward_weights: tuple[float, ...] = opt((), "one weight a reward; () = all 1")
    eval_prompts: int = opt(64, "held-out (val) prompts sampled once each at an evaluation: val_reward", 0)
    env: str = opt("", "module:Class: each completion an episode against it (grpo_episodes); '' = one-shot")
    max_turns: int = opt(0, "an episode's replies at most; 0 = the environment's max_turns", 0)
    off_policy_steps: int = opt(
        0, "k > 0: step n's rollout sampled by step n-k's weights while steps train: grpo_async", 0
    )
    engine_devices: int = opt(
        0,
        "off_policy_steps >= 1: the engine decodes on this many devices of its own (the host's last), "
        "the trainer's mesh on the rest; 0 = both on the training mesh's devices",
        0,
    )
    engine_replicas: int = opt(
        1,
        "the engine as this many replicas, each a share of the step's prompts on a thread of its own, "
        "round robin over the engine's devices with the whole weights: a small model on a CPU (2 on "
        "2 cores: each decodes on a core) or GPUs that each hold it; 1 = one engine (heads split)",
        1,
    )
    dynamic_sampling: bool = opt(False, "DAPO: groups whose rewards are all equal dropped and refilled")
    dynamic_sampling_rounds: int = opt(4, "... with at most this many more prompt batches a step", 0)

    def check(self) -> None:
        super().check()
        try:
            grpo_task.check_group_size(self.num_generations)
        except ValueError as e:  # the objective's rule, said as the flag to change
            raise ConfigError(f"--config.{e}") from None
        if self.env and self.rollout != "engine":  # episodes extend the engine's rows between turns
            raise ConfigError(
                f"--config.grpo.env={self.env!r} plays episodes on the engine: grpo.rollout=engine"
            )
        if not self.env and not self.reward_funcs:
            raise ConfigError(
                "--config.grpo.reward_funcs is empty: name a reward, or an environment (grpo.env)"
            )
        if self.engine_devices and (not self.off_policy_steps or self.rollout != "engine"):
            raise ConfigError(
                f"--config.grpo.engine_devices={self.engine_devices} gives the engine devices of its own, "
                "which only the asynchronous engine's rollouts use: set grpo.off_policy_steps >= 1 and "
                "grpo.rollout=engine (on-policy rollouts and updates take turns: separate devices idle)"
            )
        if self.engine_replicas > 1 and self.rollout != "engine":
            raise ConfigError(
                f"--config.grpo.engine_replicas={self.engine_replicas} splits the engine's rollouts; "
                f"grpo.rollout={self.rollout} samples them otherwise: set grpo.engine_replicas=1"
            )
        if self.off_policy_steps and self.num_iterations > 1:
            raise ConfigError(
                f"--config.grpo.off_policy_steps={self.off_policy_steps} with grpo.num_iterations="
                f"{self.num_iterations}: off-policy rollouts train once each; set one of them to its default"
            )


SECTIONS = {
    "data": DataSection,
    "mesh": MeshSection,
    "lora": LoraSection,
    "dpo": DPOSection,
    "grpo": GRPOSection,
}


@dataclasses.dataclass(frozen=True)
class Sections:
    """A run's typed sections; made, they have passed every rule between them."""

    data: DataSection
    mesh: MeshSection
    lora: LoraSection
    dpo: DPOSection
    grpo: GRPOSection

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """The refusals between sections."""
        lora, dpo = self.lora, self.dpo
        if self.data.format == "pairs" and dpo.reference and lora.rank:
            raise ConfigError(
                f"--config.dpo.reference={dpo.reference!r} with LoRA: the reference is the base with the "
                "adapters off; set dpo.reference='' (or lora.rank=0 for a separate reference)"
            )


def read(cls: type[Section], section) -> Section:
    """A recipe's section (a ConfigDict or dict; None: every default) as `cls`: a key that is no field
    is an error naming the field it most likely means."""
    values = {} if section is None else dict(section.items())
    names = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            near = errors.did_you_mean(key, {n: f"{cls.name}.{n}" for n in names})
            hint = near or f"{cls.name} has {', '.join(names)}"
            raise ConfigError(f"unknown config key '{cls.name}.{key}'; {hint}")
    return cls(**values)


def of(config) -> Sections:
    """The typed sections of a run config (a recipe's ConfigDict), every rule checked."""
    return Sections(**{name: read(cls, config.get(name)) for name, cls in SECTIONS.items()})


def defaults(name: str) -> dict:
    """The section `name`'s fields and defaults, as a recipe holds them (configs/default.py)."""
    return {f.name: f.default for f in dataclasses.fields(SECTIONS[name])}
