"""flaxgpt: GPT-style transformers in JAX/Flax.

    import flaxgpt
    run = flaxgpt.load("out/shakespeare_char")      # or "gpt2", or a Hugging Face directory
    model = flaxgpt.GPT(run.config)

Every public name is imported on first use (PEP 562), so `import flaxgpt` (and the `flaxgpt`
command's --help) imports no jax.
"""

import importlib

# public name -> the module that owns it
_OWNERS = {
    "GPT": "flaxgpt.models.gpt",
    "GPTConfig": "flaxgpt.models.gpt",
    "count_params": "flaxgpt.models.gpt",
    "init_params": "flaxgpt.models.gpt",
    "KVCache": "flaxgpt.models.cache",
    "Seq2SeqCache": "flaxgpt.models.cache",
    "Transformer": "flaxgpt.models.seq2seq",
    "TransformerConfig": "flaxgpt.models.seq2seq",
    "CharTokenizer": "flaxgpt.data.tokenizers",
    "get_tokenizer": "flaxgpt.data.tokenizers",
    "generate": "flaxgpt.decode.sampling",
    "beam_search": "flaxgpt.decode.beam_search",
    "load": "flaxgpt.loader",
    "Run": "flaxgpt.loader",
    "load_pretrained": "flaxgpt.loader",  # GPT-2 / Llama-family weights, a PEFT adapter merged if given
    "export_pretrained": "flaxgpt.hf.pretrained",
    "setup": "flaxgpt.runtime",
}
_RENAMED = {"gpt_step_fn": ("flaxgpt.models.gpt", "step_fn")}

__all__ = [*_OWNERS, *_RENAMED]


def __getattr__(name):
    if name in _OWNERS:
        module, attr = _OWNERS[name], name
    elif name in _RENAMED:
        module, attr = _RENAMED[name]
    else:
        raise AttributeError(f"module 'flaxgpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__():
    return sorted([*globals(), *__all__])
