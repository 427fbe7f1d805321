"""GPT-2 124M to 3.28 FineWeb val loss: the modded-nanogpt speedrun's recipe (its 11/10/24 record,
"U-net & 2x lr", the last one before FlexAttention) on an 8-GPU node or a TPU v5e-8 / v4-8 slice.

    flaxgpt prepare --dataset fineweb --out_dir data/fineweb10B --num_proc 16 --max_shards 17
    python train.py --config configs/speedrun_124m.py                            # 8 GPUs (64 rows each)
    python train.py --config configs/speedrun_124m.py --config.grad_accum=4 --config.eval_iters=80  # v5e-8

Expected, from the speedrun's own record (PyTorch, 8xH100): 3000 steps x 524,288 tokens = 1.57B
tokens (16 train shards of 100M, which --max_shards 17 prepares after the val shard), val loss 3.28 on
the first 10,485,760 val tokens, 7.2 minutes. With flaxgpt it is not yet measured on a GPU or TPU;
the CPU version of the same recipe is in docs/benchmarks.md ("Loss per second").

What it is: 12 layers, 6 heads of 128, width 768, vocabulary padded to 50304, no biases; rotary
positions, RMSNorm, QK-norm, ReLU^2 MLP, zero-initialised output projections and head, untied head,
logits soft-capped at 30, U-net skip connections; Muon (lr 0.04, momentum 0.85 -> 0.95 over 500 steps)
on the hidden matrices, Adam on the embedding (0.6), the head (0.008) and the scalars (0.04), betas
(0.9, 0.95), no weight decay, no clipping; constant learning rate, then a linear cooldown to 0 over
the last 900 steps; batches of 512 consecutive windows of 1024 tokens, in shard order.
Differences from the record: its value residual and embedding shortcut (x0 lambdas) are not here,
its RMSNorms have no scale (flaxgpt's have one), and its Newton-Schulz runs in bfloat16.

Targets: h100-8, v5e-8, v4-8
"""

from configs import default


def get_config():
    c = default.get_config()
    c.out_dir = "out/speedrun_124m"
    c.data.dir = "data/fineweb10B"
    c.data.format = "shards"  # fineweb_train_*.bin / fineweb_val_*.bin, read in order
    c.data.val_tokens = 10_485_760  # the speedrun's fixed val set

    m = c.model
    m.vocab_size, m.pad_vocab_multiple = 0, 64  # from meta.json: 50257, padded to 50304 rows
    m.block_size, m.n_layer, m.n_head, m.n_embd = 1024, 12, 6, 768
    m.bias, m.qkv_bias = False, False
    m.pos_embedding, m.norm, m.qk_norm = "rope", "rmsnorm", True
    m.activation = "relu2"
    m.tie_embeddings = False
    m.zero_init_proj = True
    m.logit_softcap = 30.0
    m.unet_skips = True
    m.dtype = "bfloat16"

    o = c.optim
    o.name = "muon"
    o.muon_learning_rate = 0.04
    o.muon_momentum, o.muon_momentum_start, o.muon_momentum_warmup = 0.95, 0.85, 500
    o.embed_learning_rate = 0.6
    o.head_learning_rate = 0.008
    o.learning_rate = 0.04  # norms, biases and the skip weights
    o.min_lr = 0.0
    o.beta1, o.beta2 = 0.9, 0.95
    o.weight_decay = 0.0
    o.grad_clip = 0.0
    o.schedule, o.warmup_steps, o.cooldown_frac = "wsd", 0, 0.3  # the last 900 of 3000 steps

    c.batch_size = 512  # x 1024 tokens = 524,288 tokens per step
    c.max_iters = 3000
    c.eval_interval = 125
    c.eval_iters = 20  # 20 x 512 windows x 1024 = the whole val set (x grad_accum: eval batches are micro)
    c.log_interval = 10
    c.ckpt_interval = 1000
    return c
