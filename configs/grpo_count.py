"""SFT -> GRPO, step 2: the SFT model of configs/count_sft.py (the answer's format, random answers)
learns by reward alone to count the a's in 8 letters over "abc"; held-out prompts measure it.

    python -c "from configs.grpo_count import write_data; write_data('data')"
    flaxgpt prepare --dataset text --input data/count_sft.txt --tokenizer char --out_dir data/count_sft
    python train.py --config configs/count_sft.py
    flaxgpt prepare --dataset prompts --input data/count_prompts.jsonl --tokenizer out/count_sft \
        --out_dir data/count_grpo
    python train.py --config configs/grpo_count.py
    python sample.py --out_dir out/grpo_count --start "abcaabca=" --max_new_tokens 2 --temperature 0

A prompt is {"prompt": "abcaabca=", "answer": "4"}, prepared with the SFT run's own tokenizer
(`--tokenizer out/count_sft`: the same characters, the same ids); `count_reward` (below, named in the
recipe as a user's module:function) is 1 for the exact count then the newline, else 0. The last 10%
of the prompts are held out (never trained on, by SFT or GRPO); val_reward in
out/grpo_count/metrics.jsonl is the share of them answered right, at step 0 the SFT model's.
See docs/grpo.md.

Targets: cpu (check: flaxgpt aot --config configs/grpo_count.py --target NAME)
"""

import json
import random
from pathlib import Path

from configs import default

LETTERS, LENGTH, COUNTED = "abc", 8, "a"


def write_data(directory, n: int = 2000, seed: int = 0) -> None:
    """n distinct random words (LENGTH letters over LETTERS) as GRPO prompts (count_prompts.jsonl, the
    last 10% held out by `prepare`) and the training ones as SFT lines (count_sft.txt) whose answers
    are random digits 0..LENGTH: the format without the task."""
    rng = random.Random(seed)
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(LETTERS) for _ in range(LENGTH)))
    words = sorted(words)
    rng.shuffle(words)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"{w}=", "answer": str(w.count(COUNTED))} for w in words]
    (out / "count_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = words[: n - round(n * 0.1)]
    sft = [f"{w}={rng.randint(0, LENGTH)}\n" for w in train for _ in range(2)]
    rng.shuffle(sft)
    (out / "count_sft.txt").write_text("".join(sft))


def count_reward(prompts, completions, answer, **_):
    """1.0 when the completion is the answer (the newline that ends it is not in the text), else 0."""
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def get_config():
    c = default.get_config()
    c.out_dir = "out/grpo_count"
    c.data.dir = "data/count_grpo"
    c.data.format = "prompts"  # GRPO (flaxgpt/train/grpo_online.py)
    c.init_from = "out/count_sft"  # the SFT run: its weights and model, its tokenizer
    c.model.dropout = 0.0  # the rollout's and the update's log-probs alike
    c.grpo.num_generations = 16  # wide groups: a right count is sampled while the answers are still spread
    c.grpo.max_completion_length = 2  # a digit and the newline that ends a completion
    # A KL anchor to the SFT model, whose answers are spread over 0-8: it keeps a prompt's answers spread
    # (entropy up, groups that differ) while the policy has only learned the frequent counts, and dynamic
    # sampling then trains each step on groups that differ. 3 seeds (docs/grpo.md): both, mean 0.940 and
    # worst 0.89; beta alone 0.850 and 0.785; neither 0.800 and 0.670; dynamic sampling alone collapsed.
    c.grpo.beta = 0.1
    c.grpo.dynamic_sampling = True
    c.grpo.reward_funcs = ("configs.grpo_count:count_reward",)
    c.grpo.eval_prompts = 200  # every held-out prompt
    c.batch_size = 256  # completions: 16 prompts x 16
    c.max_iters = 400
    c.optim.learning_rate = 1e-3
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    c.eval_interval = 10
    c.eval_iters = 1
    c.log_interval = 1
    c.ckpt_interval = 0  # only at the end
    c.mesh.cpu_devices = 1
    return c
