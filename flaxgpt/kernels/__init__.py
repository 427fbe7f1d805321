"""Accelerator and CPU kernels: the Pallas splash attention for TPU and the C++ int8/bf16 matmul for CPU
(csrc/, compiled on first use); `target`: the platform a program is traced for (the mesh context's).

May import: nothing of flaxgpt.
"""
