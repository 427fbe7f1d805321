"""Decoding that knows nothing about the model: sampling (prefill + a while_loop over the cache), beam
search and speculative decoding all take a `step_fn(tokens, positions, cache) -> (logits, cache)`;
translate is the encoder-decoder's use of beam search.

May import: flaxgpt.models, flaxgpt.loader (translate only: the encoder-decoder and its runs).
sampler, logits, sampling, beam_search and speculative import nothing of flaxgpt but each other
(tests/test_imports.py).
"""
