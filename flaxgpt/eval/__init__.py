"""Evaluation: perplexity, HellaSwag, LAMBADA and translation scored in lm-evaluation-harness's conventions,
the batched log-likelihood scorer, and the offline lm-eval reference the tests compare with.

May import: flaxgpt.models, flaxgpt.data, flaxgpt.decode, flaxgpt.runs, flaxgpt.hf, flaxgpt.loader,
flaxgpt.sharding, flaxgpt.runtime, flaxgpt.errors, flaxgpt.extras.
"""
