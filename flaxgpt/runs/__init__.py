"""The run directory a user handles: config.json and meta.json, the lock, orbax checkpoints, the
named-leaves layout they store, and metrics.jsonl / TensorBoard.

May import: flaxgpt.models and flaxgpt.data (to rebuild a run's model and tokenizer). A LoRA run's
base weights are read by flaxgpt.loader, which sits above runs and hf.
"""
