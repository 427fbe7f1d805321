"""Training: the trainer loop and its jitted step, the tasks (objectives x policies x batch sources), losses,
optimizers, preemption, the typed config sections (sections, on typed: dataclasses whose fields check
themselves) and the config check.

May import: flaxgpt.models, flaxgpt.data, flaxgpt.runs, flaxgpt.loader (resolve_init: where init_from
starts, a run or pretrained weights), flaxgpt.eval, flaxgpt.decode, flaxgpt.serve (GRPO's
rollouts by the engine), flaxgpt.envs (GRPO's environments),
flaxgpt.sharding, flaxgpt.cluster, flaxgpt.runtime,
flaxgpt.errors.
"""
