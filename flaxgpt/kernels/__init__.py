"""Accelerator and CPU kernels: the Pallas splash attention for TPU, the C++ int8/bf16 matmul for CPU
(csrc/, compiled on first use), the fused linear + cross-entropy (linear_xent: the XLA form; pallas_xent:
its Triton kernels for GPU); `target`: the platform a program is traced for (the mesh context's).

May import: nothing of flaxgpt.
"""
