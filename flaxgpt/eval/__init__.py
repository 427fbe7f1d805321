"""Evaluation: perplexity, HellaSwag, LAMBADA and translation scored in lm-evaluation-harness's conventions,
the batched log-likelihood scorer (split over a job's processes by shards.py), and the offline lm-eval
reference the tests compare with.

May import: flaxgpt.models, flaxgpt.data, flaxgpt.decode, flaxgpt.runs, flaxgpt.hf, flaxgpt.loader,
flaxgpt.sharding, flaxgpt.cluster, flaxgpt.runtime, flaxgpt.errors, flaxgpt.extras.
"""
