"""Tools for seeing inside: the model summary (parameters, memory, FLOPs) and attention maps.

May import: flaxgpt.train (recipes: config_check.load_recipe), flaxgpt.loader, flaxgpt.runs,
flaxgpt.hf, flaxgpt.models, flaxgpt.data, flaxgpt.extras. The trainer imports no tool: FLOPs are counted in
flaxgpt.models.flops, training curves drawn by flaxgpt.runs.plot.
"""
