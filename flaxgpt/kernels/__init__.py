"""Accelerator and CPU kernels: the Pallas splash attention for TPU, the C++ int8/bf16 matmul for CPU
(csrc/, compiled on first use), the fused linear + cross-entropy (linear_xent: the XLA form; pallas_xent:
its Triton kernels for GPU), int4 weights' layout and XLA product (int4), the int8 / int4 decoding GEMV
for GPU (pallas_qgemv, Triton), a decoding row's norm + float GEMV + residual (pallas_decode) and its
attention with the cache writes (pallas_decode_attention) for GPU (Triton), the tilings measured for
those GEMVs on a card (tuned: FLAXGPT_GEMV_TILES), a mixture of experts' grouped
matmul reading the expert weights in place (pallas_grouped, Triton, opt-in), the scaled float8 matmul of
FP8 training (fp8: e4m3 / e5m2, current scaling; which devices multiply float8); `target`: the platform
a program is traced for (the mesh context's).

May import: nothing of flaxgpt.
"""
