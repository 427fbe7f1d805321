"""The modern recipe on the CPU Shakespeare task: the GPT-2 recipe's model size and data
(configs/shakespeare_char_cpu.py: 4 layers x 128, block 64, batch 12) trained the modded-nanogpt
speedrun's way: Muon, rotary positions, RMSNorm, QK-norm, ReLU^2, zero-initialised output projections,
an untied head, and a constant learning rate with a linear cooldown. It reaches the GPT-2 recipe's
val loss after 2000 steps (1.90) in about a fifth of the steps (docs/benchmarks.md, "Loss per second").

flaxgpt prepare --dataset shakespeare_char --out_dir data/shakespeare_char
python train.py --config configs/shakespeare_char_cpu_modern.py

Targets: cpu
"""

from configs import shakespeare_char_cpu


def get_config():
    c = shakespeare_char_cpu.get_config()
    c.out_dir = "out/shakespeare_char_cpu_modern"
    m = c.model
    m.pos_embedding, m.norm, m.qk_norm = "rope", "rmsnorm", True
    m.activation = "relu2"
    m.tie_embeddings = False
    m.zero_init_proj = True

    o = c.optim
    o.name = "muon"
    o.muon_learning_rate = 0.03  # the hidden matrices
    o.learning_rate = 2e-3  # AdamW: embeddings, head, norms
    o.min_lr = 1e-4  # every group cools down to 1/20 of its peak
    o.schedule, o.warmup_steps, o.cooldown_frac = "wsd", 20, 0.6
    o.weight_decay = 0.0
    o.grad_clip = 0.0

    c.max_iters = 400
    c.optim.decay_steps = 400
    return c
