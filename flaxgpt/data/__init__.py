"""Data: tokenizers, the prepare tools that write token files (text, Tiny Shakespeare, Hugging Face
datasets, FineWeb shards, parallel text, packed chat conversations), chat templates (chat), packing
(packing), and batches as pure functions of (seed, step, process).

May import: flaxgpt.hf (a model's tokenizer.json). No model, no trainer.
"""
