"""Accelerator and CPU kernels: the Pallas splash attention for TPU and the C++ int8/bf16 matmul for CPU
(csrc/, compiled on first use).

May import: nothing of flaxgpt.
"""
