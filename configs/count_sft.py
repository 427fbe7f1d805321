"""SFT -> GRPO, step 1: a tiny character GPT learns the answer's format ("abcabbca=3" then a newline)
from lines whose answers are random digits, so it learns the format and nothing of counting.

    python -c "from configs.grpo_count import write_data; write_data('data')"
    flaxgpt prepare --dataset text --input data/count_sft.txt --tokenizer char --out_dir data/count_sft
    python train.py --config configs/count_sft.py
    # step 2, GRPO from this run: configs/grpo_count.py

Plain next-token training on the lines (the prompt's letters too: they are random, so only the
format is learnable). See configs/grpo_count.py and docs/grpo.md.

Targets: cpu (check: flaxgpt aot --config configs/count_sft.py --target NAME)
"""

from configs import default


def get_config():
    c = default.get_config()
    c.out_dir = "out/count_sft"
    c.data.dir = "data/count_sft"
    c.model.n_layer, c.model.n_head, c.model.n_embd = 2, 2, 64
    c.model.block_size = 16  # a line is 11 characters: 8 letters, "=", a digit, the newline
    c.model.dropout = 0.0
    c.model.pad_vocab_multiple = 1
    c.init_from = "auto"  # fresh, or the run's latest checkpoint: the same command resumes
    c.batch_size = 64
    c.max_iters = 300
    c.optim.learning_rate = 3e-3
    c.optim.warmup_steps = 20
    c.optim.min_lr = 3e-4
    c.optim.weight_decay = 0.0
    c.eval_interval = 100
    c.eval_iters = 4
    c.log_interval = 20
    c.ckpt_interval = 0  # only at the end
    c.mesh.cpu_devices = 1
    return c
