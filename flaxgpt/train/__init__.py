"""Training: the trainer loop and its jitted step, the tasks (GPT and encoder-decoder), losses,
optimizers, preemption and the config check.

May import: flaxgpt.models, flaxgpt.data, flaxgpt.runs, flaxgpt.hf (init_from pretrained weights),
flaxgpt.loader (init_from a run directory), flaxgpt.eval, flaxgpt.decode, flaxgpt.serve (GRPO's
rollouts by the engine), flaxgpt.sharding, flaxgpt.runtime, flaxgpt.errors.
"""
