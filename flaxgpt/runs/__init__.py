"""The run directory a user handles: config.json and meta.json (run_dir, also the one rule for "is this
a training run?"), the lock, orbax checkpoints, the named-leaves layout they store, metrics.jsonl /
TensorBoard and their plots (plot), and a LoRA run's adapters with the base they adapt (lora_run).

May import: flaxgpt.models and flaxgpt.data (to rebuild a run's model and tokenizer), flaxgpt.extras.
A LoRA run's base weights are read by flaxgpt.loader, which sits above runs and hf.
"""
