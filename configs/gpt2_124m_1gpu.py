"""GPT-2 124M on OpenWebText (or FineWeb-Edu) on one GPU: the same ~0.5M tokens per step in micro-batches.

Targets: h100-1

flaxgpt prepare --dataset hf --hf_name openwebtext --out_dir data/openwebtext
python train.py --config configs/gpt2_124m_1gpu.py

Chosen by comparing the compiled H100 programs (flaxgpt aot, docs/accelerators.md): on one GPU a
loop over layers saves every layer's activations into stacked buffers that the backward pass reads
back (4.1 TB of HBM traffic a step against 2.0 TB unrolled), and a chunked loss adds a serial loop
and a recomputed head; an 80 GB H100 holds a 16-row micro-batch's full logits.
"""

from configs import gpt2_124m


def get_config():
    c = gpt2_124m.get_config()
    c.out_dir = "out/gpt2_124m_1gpu"
    c.grad_accum = 32  # micro-batches of 16 sequences: 512 x 1024 = 524,288 tokens per step
    c.model.scan_layers = False  # 12 blocks unrolled: no stacked activations (compiles in ~1 min)
    c.optim.loss_chunk = 0  # [16, 1024, 50304] logits at once (3.3 GB fp32): no serial loss loop
    # the logits, not the fused loss: compiled for h100-1 the fused step's bound is 8.7% higher (it
    # recomputes the head's product) and 80 GB hold the logits (docs/accelerators.md)
    c.optim.loss_impl = "logits"
    return c
