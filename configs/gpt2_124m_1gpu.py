"""GPT-2 124M on OpenWebText (or FineWeb-Edu) on one GPU: the same ~0.5M tokens per step in micro-batches.

Targets: h100-1

python -m flaxgpt.data.prepare --dataset hf --hf_name openwebtext --out_dir data/openwebtext
python train.py --config configs/gpt2_124m_1gpu.py
"""

from configs import gpt2_124m


def get_config():
    c = gpt2_124m.get_config()
    c.out_dir = "out/gpt2_124m_1gpu"
    c.grad_accum = 16  # micro-batches of 32 sequences: 512 x 1024 = 524,288 tokens per step
    c.optim.loss_chunk = 128  # no [32, 1024, 50304] fp32 logits
    return c
