"""flaxgpt: GPT-style transformers in JAX/Flax."""

from flaxgpt.beam_search import beam_search
from flaxgpt.cache import KVCache, Seq2SeqCache
from flaxgpt.gpt import GPT, GPTConfig, count_params, init_params
from flaxgpt.gpt import step_fn as gpt_step_fn
from flaxgpt.sampling import generate
from flaxgpt.seq2seq import Transformer, TransformerConfig
from flaxgpt.tokenizers import CharTokenizer, get_tokenizer

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
    # flaxgpt.hf on first use: importing it here would make `python -m flaxgpt.hf` warn
    if name in ("load_pretrained", "export_pretrained"):
        from flaxgpt import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'flaxgpt' has no attribute {name!r}")
