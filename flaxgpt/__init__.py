"""flaxgpt: GPT-style transformers in JAX/Flax."""

from flaxgpt.cache import KVCache
from flaxgpt.gpt import GPT, GPTConfig, count_params, init_params
from flaxgpt.hf import export_pretrained, load_pretrained
from flaxgpt.tokenizers import CharTokenizer, get_tokenizer

__all__ = [
    "GPT",
    "GPTConfig",
    "KVCache",
    "CharTokenizer",
    "count_params",
    "get_tokenizer",
    "init_params",
    "load_pretrained",
    "export_pretrained",
]
