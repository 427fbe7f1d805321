"""SFT -> GRPO with a tool, step 1: a small character GPT learns the calculator's call format (a
Hermes tool call with the prompt's expression, the tool's response, the answer copied from it) from
lines whose responses are the products of other random pairs: the format and the copying, never the
prompt's product. Measured: val loss 0.345, held-out accuracy 0.96 sampled at temperature 1 and 1.00
greedy with the calculator (docs/grpo.md, "The calculator run").

    python -c "from configs.grpo_calc import write_data; write_data('data')"
    flaxgpt prepare --dataset text --input data/calc_sft.txt --tokenizer char --out_dir data/calc_sft
    python train.py --config configs/calc_sft.py
    # step 2, GRPO with the calculator from this run: configs/grpo_calc.py

Plain next-token training on the lines (the tool's responses too: SFT knows no observations; GRPO
then trains only the model's own tokens). See configs/grpo_calc.py and docs/grpo.md.

Targets: cpu (check: flaxgpt aot --config configs/calc_sft.py --target NAME)
"""

from configs import default


def get_config():
    c = default.get_config()
    c.out_dir = "out/calc_sft"
    c.data.dir = "data/calc_sft"
    # rotary positions and 4 layers of 128: copying the prompt's numbers into the call is a fixed
    # relative offset, which RoPE heads learn (2 layers of 64 with learned positions copied nothing)
    c.model.n_layer, c.model.n_head, c.model.n_embd = 4, 4, 128
    c.model.pos_embedding = "rope"
    c.model.block_size = 160  # a line is 10 + 80 + 39 + 9 characters
    c.model.dropout = 0.0
    c.model.pad_vocab_multiple = 1
    c.init_from = "auto"
    c.batch_size = 16
    c.max_iters = 1500
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = 50
    c.optim.min_lr = 1e-4
    c.optim.weight_decay = 0.0
    c.eval_interval = 200
    c.eval_iters = 4
    c.log_interval = 50
    c.ckpt_interval = 0
    c.mesh.cpu_devices = 1
    return c
