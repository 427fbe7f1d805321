"""The calculator task at a tiny scale (configs/grpo_calc.py, docs/grpo.md): a 1-layer model taught
the call's layout by a few plain next-token steps on the SFT lines (each row a line from its start:
learnt by position, in seconds), then GRPO's rollouts through the recipe's task: episodes call the
calculator, the tool's response is masked out of the loss (exactly its characters), rewards are
finite, two engine replicas give the same batch, and a GRPO update on the rollout gives a finite
loss."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the configs/ package

from configs import grpo_calc  # noqa: E402
from flaxgpt.data import prepare, tokenizers  # noqa: E402
from flaxgpt.models import gpt  # noqa: E402
from flaxgpt.train.grpo_rollout import Replicas  # noqa: E402
from flaxgpt.train.policy import NONE  # noqa: E402
from flaxgpt.train.tasks import make_task  # noqa: E402


def recipe(grpo_data, out):
    c = grpo_calc.get_config()
    c.init_from, c.data.dir, c.out_dir = "scratch", str(grpo_data), str(out)
    c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size = 1, 2, 32, 160
    c.model.pad_vocab_multiple = 1
    c.batch_size, c.grpo.num_generations, c.grpo.temperature = 8, 4, 0.5
    return c


def taught(task, lines, tok, steps: int = 120):
    """Random weights fitted to the SFT lines, each row one line from position 0 (its characters by
    position: the layout, not the numbers)."""
    rows = np.zeros((len(lines), 160), np.int32)
    for i, line in enumerate(lines):
        ids = tok.encode(line)[:160]
        rows[i, : len(ids)] = ids
    params = gpt.init_params(task.model_config, jax.random.key(0))
    tx = optax.adam(1e-2)

    def loss(p):
        logits = task.policy.apply(p, NONE, jnp.asarray(rows[:, :-1]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(rows[:, 1:])).mean()

    @jax.jit
    def step(p, s):
        g = jax.grad(loss)(p)
        u, s = tx.update(g, s)
        return optax.apply_updates(p, u), s

    state = tx.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    return params


def test_calculator_episodes_on_the_recipes_task(tmp_path):
    grpo_calc.write_data(tmp_path, n=40)
    sft_data, grpo_data = tmp_path / "sft_data", tmp_path / "grpo_data"
    text = ["--dataset", "text", "--input", str(tmp_path / "calc_sft.txt"), "--tokenizer", "char"]
    prepare.main([*text, "--out_dir", str(sft_data)])
    prompts = ["--dataset", "prompts", "--input", str(tmp_path / "calc_prompts.jsonl")]
    prepare.main([*prompts, "--tokenizer", str(sft_data), "--out_dir", str(grpo_data)])
    tok = tokenizers.from_meta(json.loads((grpo_data / "meta.json").read_text())["tokenizer"])
    task = make_task(recipe(grpo_data, tmp_path / "run"))
    params = taught(task, (tmp_path / "calc_sft.txt").read_text().splitlines()[:32], tok)

    batch, info = task.source.rollout(params, NONE, 0, 8)
    called = 0
    for row, mask in zip(batch["targets"], batch["loss_mask"], strict=True):
        held = np.flatnonzero(np.diff(np.r_[0, mask == 0, 0]))  # runs of untrained targets
        runs = [tok.decode(row[a:b].tolist()) for a, b in zip(held[::2], held[1::2], strict=True)]
        observations = [r for r in runs if r.startswith("<tool_response>")]
        for r in observations:  # the response exactly: its first character to its closing tag
            assert r.endswith("</tool_response>") and r.count("<") == 2, r
        called += bool(observations)
    assert called >= 4, called  # most episodes called the calculator
    assert np.isfinite(info["reward"]) and np.isfinite(info["rewards/env/mean"])
    # the step's episode metrics: a call then an answer is 2 replies and 1 observation an episode
    assert info["episodes/observations_mean"] >= called / 8 and 1 <= info["episodes/turns_mean"] <= 4
    assert 0 < info["episodes/observation_tokens_ratio"] < 1
    assert 0 <= info["rewards/calc_reward/mean"] <= 1
    # grpo.engine_replicas=2 on one device (the calculators stepped from 2 threads): the same batch
    one, task.source.engine = task.source.engine, Replicas(task.source.engine, jax.devices()[:1], 2)
    again, again_info = task.source.rollout(params, NONE, 0, 8)
    for key, value in batch.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)
    assert {k: again_info[k] for k in info if "/" in k} == {k: info[k] for k in info if "/" in k}
    task.source.engine = one

    objective, tx = task.objective, optax.adam(1e-3)

    @jax.jit
    def update(p, s, b):
        (total, (weight, _)), g = jax.value_and_grad(
            lambda p: objective.loss(task.policy, p, NONE, b, None, False), has_aux=True
        )(p)
        u, s = tx.update(g, s)
        return optax.apply_updates(p, u), s, total / weight

    params, _, loss = update(params, tx.init(params), batch)
    assert np.isfinite(float(loss))
    batch, info = task.source.rollout(params, NONE, 1, 8)  # the updated weights, no recompile
    assert np.isfinite(info["reward"])
