"""Decoding that knows nothing about the model: sampling (prefill + a while_loop over the cache), beam
search and speculative decoding all take a `step_fn(tokens, positions, cache) -> (logits, cache)`;
translate is the encoder-decoder's use of beam search.

May import: sampling, beam_search and speculative nothing of flaxgpt but each other; translate also
flaxgpt.models and flaxgpt.runs.
"""
