"""Hugging Face interop: checkpoints both ways for every family in one table (families: GPT-2, Llama,
Mistral, Qwen2, Qwen3, Gemma 2 and 3; one entry each: key table and config mapping both ways), loaded
and exported by pretrained (gpt2.py's weight loop for GPT-2, rotary.py's for the rest), PEFT LoRA
adapters both ways (peft.py), int4 checkpoints in compressed-tensors' pack-quantized format both ways
(compressed.py), and the files of a checkpoint (sharded safetensors, the hub cache).

May import: flaxgpt.models, flaxgpt.data, flaxgpt.runs (the one "is this a run directory?" rule, so
export never writes into one), flaxgpt.sharding (a Placement puts each loaded leaf on its devices),
flaxgpt.errors (the one did-you-mean).
The loader and the `flaxgpt hf` / `flaxgpt peft` commands sit above: flaxgpt.loader, flaxgpt.hf_cli.
"""
