"""GPT-2 124M on OpenWebText (or FineWeb-Edu): the recipe for a TPU VM or a GPU node.

Targets: v5e-8, v4-8, h100-8 (one GPU: configs/gpt2_124m_1gpu.py)

flaxgpt prepare --dataset hf --hf_name openwebtext --out_dir data/openwebtext
python train.py --config configs/gpt2_124m.py
# fewer devices or less memory: more micro-batches per step, same tokens per step
python train.py --config configs/gpt2_124m.py --config.grad_accum=32

"""

from configs import default


def get_config():
    c = default.get_config()
    c.out_dir = "out/gpt2_124m"
    c.data.dir = "data/openwebtext"
    c.model.n_layer, c.model.n_head, c.model.n_embd = 12, 12, 768
    c.model.block_size = 1024
    c.model.dtype = "bfloat16"  # bf16 matmuls, float32 parameters and loss
    c.model.pad_vocab_multiple = 64  # 50257 -> 50304
    c.model.scan_layers = True  # compile once per block, not 12 times
    c.batch_size = 512  # 512 x 1024 = 524,288 tokens (~0.5M) per step
    c.grad_accum = 8  # micro-batches of 64 sequences; raise it if memory runs out
    c.max_iters = 600000
    c.eval_interval = 1000
    c.eval_iters = 200
    c.log_interval = 10
    c.ckpt_interval = 1000
    c.optim.learning_rate = 6e-4
    c.optim.min_lr = 6e-5
    c.optim.warmup_steps = 2000
    c.optim.decay_steps = 600000
    c.optim.weight_decay = 0.1
    c.optim.beta1, c.optim.beta2 = 0.9, 0.95
    c.optim.loss_chunk = (
        128  # logits 128 positions at a time: no [64, 1024, 50304] fp32 array (~3 GiB/device)
    )
    # the fused linear + cross-entropy instead (no logits at all; loss_chunk unused): compiled for
    # v5e-8, kernels >= 35.9 -> 32.3 ms, 29.4 -> 26.5 HBM GB, temporaries 10.03 -> 9.74 GB
    # (docs/accelerators.md; compiled, not measured)
    c.optim.loss_impl = "fused"
    return c
