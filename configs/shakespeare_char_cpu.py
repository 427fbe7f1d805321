"""nanoGPT's CPU recipe for Tiny Shakespeare characters: a few minutes on a laptop's 2 cores.

flaxgpt prepare --dataset shakespeare_char --out_dir data/shakespeare_char
python train.py --config configs/shakespeare_char_cpu.py

Targets: cpu (check: flaxgpt aot --config configs/shakespeare_char_cpu.py --target NAME)
"""

from configs import shakespeare_char


def get_config():
    c = shakespeare_char.get_config()
    c.out_dir = "out/shakespeare_char_cpu"
    c.model.n_layer, c.model.n_head, c.model.n_embd = 4, 4, 128
    c.model.block_size = 64
    c.model.dropout = 0.0
    c.batch_size = 12
    c.max_iters = 2000
    c.optim.decay_steps = 2000
    c.eval_iters = 20
    c.log_interval = 10
    c.ckpt_interval = 0  # only at the end
    return c
