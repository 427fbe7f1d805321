"""Ahead-of-time compiles: a recipe's real programs (train step, eval step, sampling, the serving engine)
compiled for a named TPU or GPU target on this CPU machine, with per-device memory, kernels, collectives
and a roofline report. `flaxgpt aot --config configs/<recipe>.py --target v5e-8`.

targets (named topologies and their specs), programs (the programs, built from flaxgpt's own code),
report (memory, HLO and cost analysis -> rows), compile (the command line).

May import: flaxgpt.train, flaxgpt.serve, flaxgpt.decode, flaxgpt.hf, flaxgpt.loader (resolve_init: a
recipe's model without its weights), flaxgpt.runs, flaxgpt.models, flaxgpt.sharding, flaxgpt.extras.
"""
