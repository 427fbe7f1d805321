"""flaxgpt: GPT-style transformers in JAX/Flax."""

from flaxgpt.data.tokenizers import CharTokenizer, get_tokenizer
from flaxgpt.decode.beam_search import beam_search
from flaxgpt.decode.sampling import generate
from flaxgpt.models.cache import KVCache, Seq2SeqCache
from flaxgpt.models.gpt import GPT, GPTConfig, count_params, init_params
from flaxgpt.models.gpt import step_fn as gpt_step_fn
from flaxgpt.models.seq2seq import Transformer, TransformerConfig

__all__ = [
    "GPT",
    "GPTConfig",
    "KVCache",
    "Seq2SeqCache",
    "CharTokenizer",
    "count_params",
    "get_tokenizer",
    "init_params",
    "load_pretrained",
    "export_pretrained",
    "generate",
    "gpt_step_fn",
    "Transformer",
    "TransformerConfig",
    "beam_search",
]


def __getattr__(name):
    # flaxgpt.hf.gpt2 on first use: importing it here would make `python -m flaxgpt.hf.gpt2` warn
    if name == "load_pretrained":  # GPT-2 / Llama-family weights, optionally with a PEFT adapter merged
        from flaxgpt.hf import peft

        return peft.load_pretrained
    if name == "export_pretrained":
        from flaxgpt.hf import gpt2 as hf

        return hf.export_pretrained
    raise AttributeError(f"module 'flaxgpt' has no attribute {name!r}")
