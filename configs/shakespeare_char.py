"""nanoGPT's "baby GPT" on Tiny Shakespeare characters (nanoGPT: val loss 1.4697 on one A100).

flaxgpt prepare --dataset shakespeare_char --out_dir data/shakespeare_char
python train.py --config configs/shakespeare_char.py

Targets: v5e-1, h100-1
"""

from configs import default


def get_config():
    c = default.get_config()
    c.out_dir = "out/shakespeare_char"
    c.data.dir = "data/shakespeare_char"
    c.model.n_layer, c.model.n_head, c.model.n_embd = 6, 6, 384
    c.model.block_size = 256
    c.model.dropout = 0.2
    c.model.bias = c.model.qkv_bias = False  # nanoGPT trains this recipe without biases
    c.model.activation = "gelu_exact"  # nanoGPT uses torch nn.GELU() (erf), not the tanh approximation
    c.batch_size = 64
    c.max_iters = 5000
    c.eval_interval = 250  # small data: evaluate often
    c.eval_iters = 200
    c.log_interval = 10
    c.ckpt_interval = 1000
    c.optim.learning_rate = 1e-3  # a baby network can take a big step
    c.optim.min_lr = 1e-4
    c.optim.decay_steps = 5000
    c.optim.warmup_steps = 100
    c.optim.beta2 = 0.99  # few tokens per step: average the second moment longer
    return c
