"""GRPO's toy: a tiny character GPT, from random weights, learns by reward alone to copy a 3-letter
word after ">"; the mean reward on held-out words rises within a couple of minutes on 2 CPU cores.

    python -c "from configs.grpo_toy import write_prompts; write_prompts('data/grpo_toy.jsonl')"
    flaxgpt prepare --dataset prompts --input data/grpo_toy.jsonl --tokenizer char --out_dir data/grpo_toy
    python train.py --config configs/grpo_toy.py
    python sample.py --out_dir out/grpo_toy --start "fad>" --max_new_tokens 4 --temperature 0

A prompt is {"prompt": "fad>", "answer": "fad"}; the reward (`copy_reward` below, named in the recipe
as a user's module:function) is the share of the answer's letters the completion has in place, over
the longer of the two, so the empty or rambling completion scores less than the exact copy followed
by the newline that ends it. val_reward in out/grpo_toy/metrics.jsonl is the mean reward of one
sampled completion for each held-out word (words never trained on). See docs/grpo.md.

Targets: cpu (check: flaxgpt aot --config configs/grpo_toy.py --target NAME)
"""

import json
import random
from pathlib import Path

from configs import default

LETTERS = "abcdef"


def write_prompts(path, n: int = 216, seed: int = 0) -> None:
    """n distinct 3-letter words over LETTERS (216 in all), shuffled, as prompts jsonl (prepare holds
    out the last 10%)."""
    rng = random.Random(seed)
    words = ["".join(w) for w in ((a, b, c) for a in LETTERS for b in LETTERS for c in LETTERS)]
    rng.shuffle(words)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": f"{w}>", "answer": w}) for w in words[:n]]
    Path(path).write_text("\n".join(lines) + "\n")


def copy_reward(prompts, completions, answer, **_):
    """Share of the answer's letters in place in the completion, over the longer of the two."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        hits = sum(x == y for x, y in zip(c, a, strict=False))
        out.append(hits / max(len(a), len(c)))
    return out


def get_config():
    c = default.get_config()
    c.out_dir = "out/grpo_toy"
    c.data.dir = "data/grpo_toy"
    c.data.format = "prompts"  # GRPO (flaxgpt/train/grpo_online.py)
    c.model.n_layer, c.model.n_head, c.model.n_embd = 2, 2, 64
    c.model.block_size = 16  # "abc>" + 4 completion tokens fit
    c.model.dropout = 0.0  # the rollout's and the update's log-probs alike
    c.model.pad_vocab_multiple = 1
    c.init_from = "auto"  # fresh, or the run's latest checkpoint: the same command resumes
    c.grpo.num_generations = 8
    c.grpo.max_completion_length = 4  # 3 letters + the newline that ends a completion
    c.grpo.reward_funcs = ("configs.grpo_toy:copy_reward",)
    c.grpo.eval_prompts = 40  # every held-out word
    c.batch_size = 128  # completions: 16 prompts x 8
    c.max_iters = 100
    c.optim.learning_rate = 3e-3
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    c.eval_interval = 10
    c.eval_iters = 1
    c.log_interval = 1
    c.ckpt_interval = 0  # only at the end
    c.mesh.cpu_devices = 1
    return c
