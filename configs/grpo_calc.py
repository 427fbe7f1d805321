"""SFT -> GRPO with a tool, step 2: the SFT model of configs/calc_sft.py (the calculator's call format,
random numbers) multiplies 4-digit numbers by calling the calculator, trained by reward alone; held-out
prompts measure it.

    python -c "from configs.grpo_calc import write_data; write_data('data')"
    flaxgpt prepare --dataset text --input data/calc_sft.txt --tokenizer char --out_dir data/calc_sft
    python train.py --config configs/calc_sft.py
    flaxgpt prepare --dataset prompts --input data/calc_prompts.jsonl --tokenizer out/calc_sft \
        --out_dir data/calc_grpo
    python train.py --config configs/grpo_calc.py

A prompt is {"prompt": "1234*5678=", "answer": "7006652"}. An episode (train/grpo_episodes.py): the
model's first reply is a Hermes tool call, `<tool_call>{"name":"calculator","arguments":
{"expression":"1234*5678"}}</tool_call>` (read by serve.tools' parser, as serve.py reads it), where its
reply ends; the environment (`Calc` below: envs.calculator.Calculator, its result wrapped as
`<tool_response>7006652</tool_response>`) answers; those tokens are the observation (not trained); the
model's next reply is the answer and the newline that ends it. `calc_reward` is 1 for the exact
product, else 0. The SFT lines have the same layout with the product of two other random 4-digit
numbers in the tool's response and the answer (the format, and copying the response, never the
prompt's product). The last 10% of the prompts are held out; val_reward at step 0 is the SFT model's
(measured: 0.96, and 0.925-0.96 over 20 GRPO steps for 2 seeds: docs/grpo.md, "The calculator run").
From a weak SFT model (calc_sft at --config.max_iters=750: 0.335 held out) GRPO at lr 1e-4, batch 128
raised it to 0.59-0.615 in 20 steps and to 0.855-0.875 in 300 (3 seeds; docs/grpo.md, "From a weak SFT
model").

Targets: cpu (check: flaxgpt aot --config configs/grpo_calc.py --target NAME)
"""

import json
import random
from pathlib import Path

from configs import default
from flaxgpt.envs.base import Step
from flaxgpt.envs.calculator import Calculator

LOW, HIGH = 1000, 9999  # the factors: 4 digits


def call(expression: str) -> str:
    """The model's tool call for `expression` (Hermes' format, compact JSON)."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def response(text: str) -> str:
    return f"<tool_response>{text}</tool_response>"


class Calc(Calculator):
    """The calculator, its answer (or an error, as the word "error": the characters the SFT vocabulary
    holds) wrapped as a tool response, so the model sees where the observation ends."""

    def step(self, action: str) -> Step:
        s = super().step(action)
        if s.observation is None:
            return s
        return Step(
            response("error" if s.observation.startswith("error") else s.observation), s.reward, s.done
        )


def write_data(directory, n: int = 4000, seed: int = 0) -> None:
    """n random products as GRPO prompts (calc_prompts.jsonl, the last 10% held out by `prepare`) and
    SFT lines (calc_sft.txt) for the training ones: the call with the prompt's expression, the product of
    two other random 4-digit numbers as the tool's response (7 and 8 digits as often as the task's),
    and that number as the answer."""
    rng = random.Random(seed)
    pairs = [(rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)) for _ in range(n)]
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in pairs]
    (out / "calc_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = []
    for a, b in pairs[: n - round(n * 0.1)]:
        r = str(rng.randint(LOW, HIGH) * rng.randint(LOW, HIGH))  # not a*b: the format only
        lines.append(f"{a}*{b}={call(f'{a}*{b}')}{response(r)}{r}\n")
    (out / "calc_sft.txt").write_text("".join(lines))


def calc_reward(prompts, completions, answer, **_):
    """1.0 when the final reply is the product (the newline that ends it is not in the text), else 0."""
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def get_config():
    c = default.get_config()
    c.out_dir = "out/grpo_calc"
    c.data.dir = "data/calc_grpo"
    c.data.format = "prompts"
    c.init_from = "out/calc_sft"  # the SFT run: its weights, model and tokenizer
    c.model.dropout = 0.0
    c.grpo.env = "configs.grpo_calc:Calc"  # each completion an episode: call, response, answer
    c.grpo.max_turns = 2  # the call and the answer
    c.grpo.num_generations = 8
    c.grpo.max_completion_length = 136  # call 80 + response 39 + answer 9, and room
    c.grpo.reward_funcs = ("configs.grpo_calc:calc_reward",)
    c.grpo.eval_prompts = 200
    c.batch_size = 64  # completions: 8 prompts x 8
    c.max_iters = 20  # the SFT model is at 0.96 held out already: GRPO holds it (docs/grpo.md)
    c.optim.learning_rate = 5e-5  # 3e-4 took the SFT model from 0.96 to 0.835 held out in 10 steps
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    c.eval_interval = 10
    c.eval_iters = 1
    c.log_interval = 1
    c.ckpt_interval = 0
    c.mesh.cpu_devices = 1
    return c
