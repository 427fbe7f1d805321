"""Tools for seeing inside: the model summary (parameters, memory, FLOPs), training-curve plots and
attention maps.

May import: anything below the trainer (models, data, runs, hf).
"""
