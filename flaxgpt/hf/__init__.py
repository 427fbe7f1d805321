"""Hugging Face interop: GPT-2 and Llama-family (Llama, Mistral, Qwen2) weights both ways by explicit key
tables, PEFT LoRA adapters both ways and merged (peft.py), the files of a checkpoint (sharded
safetensors, the hub cache), and tokenizer.json.

May import: flaxgpt.models, flaxgpt.data.tokenizers, flaxgpt.runs.
"""
