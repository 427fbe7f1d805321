"""The models: the GPT (config, presets, step_fn adapter, its linear layers over float, quantized or
adapted weights, quantized weights, LoRA adapters), the
encoder-decoder Transformer, their layers (attention, MLP, norms, rotary), the KV caches (one interface
in cache.py: contiguous and ring layers there, the paged kind in paged.py), and the registry that maps
a recipe's `model` section to a config.

May import: flaxgpt.kernels (attention and matmul kernels). Nothing else of flaxgpt.
"""
