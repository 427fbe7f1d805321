"""Data: tokenizers, the prepare tools that write token files (text, Tiny Shakespeare, Hugging Face
datasets, FineWeb shards, parallel text, packed chat conversations), chat templates (chat), packing
(packing), and batches as pure functions of (seed, step, process).

May import: flaxgpt.errors. No model, no trainer, no Hugging Face weights: a model's tokenizer.json is
read here (hf_tokenizer), and flaxgpt.hf imports it.
"""
