"""A tiny mixture of experts on Tiny Shakespeare characters: the dense CPU recipe's active size.

flaxgpt prepare --dataset shakespeare_char --out_dir data/shakespeare_char
python train.py --config configs/shakespeare_char_moe.py        # the mixture of experts
python train.py --config configs/shakespeare_char_cpu.py --config.max_iters=400 \
    --config.optim.decay_steps=400 --config.eval_interval=50 --config.out_dir=out/shakespeare_char_dense

shakespeare_char_cpu's model (4 layers x 128, block 64, GELU MLPs) with every MLP made 8 experts of
hidden size 256, each token through its top 2: a token uses 2 x 256 = 512 hidden units per layer,
the dense recipe's 4 x 128, so both have the same active parameters (the router's 128 x 8 per layer
aside) and the mixture 4x the MLP parameters in all. Same data, batch, steps and learning rates.

Targets: cpu (check: flaxgpt aot --config configs/shakespeare_char_moe.py --target NAME)
"""

from configs import shakespeare_char_cpu


def get_config():
    c = shakespeare_char_cpu.get_config()
    c.out_dir = "out/shakespeare_char_moe"
    c.model.num_experts = 8  # E expert MLPs per layer
    c.model.experts_per_token = 2  # k: active MLP width 2 x expert_hidden = the dense recipe's 512
    c.model.expert_hidden = 256  # each expert's hidden size
    c.model.router_aux_loss_coef = 0.01  # load balancing (Mixtral's is 0.02, transformers' 0.001)
    c.max_iters = 400  # 17.6 min on the loaded 2-core CPU (dense: 6.9); the dense twin runs the same steps
    c.optim.decay_steps = 400
    c.eval_interval = 50  # a point of the val curve every 50 steps
    return c
