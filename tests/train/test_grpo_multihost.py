"""GRPO over 2 processes (Slurm's variables, gloo on the CPU, tests/train/test_multihost.py's
launcher): each process rolls out its own prompts with its own engine on its own device, the update
runs over both; the losses and rewards are those of one process that rolls out both processes'
prompts (the same prompts and seeds) and updates on 2 devices; process 1's engine is 2 replicas
(grpo.engine_replicas: the same tokens). Run as a script, this file is one
worker: `python tests/train/test_grpo_multihost.py PROCESS DATA OUT`.
"""

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the configs/ package

from tests.train.test_multihost import PROCESSES, finish, launch, metrics_losses  # noqa: E402

STEPS = 2


def config(data_dir, out_dir):
    from configs import grpo_toy

    c = grpo_toy.get_config()
    c.data.dir, c.out_dir, c.init_from = str(data_dir), str(out_dir), "scratch"
    c.model.n_layer, c.model.n_embd = 1, 32
    c.mesh.data, c.mesh.fsdp, c.mesh.cpu_devices = PROCESSES, 1, 0  # a process's device each
    c.batch_size, c.grpo.num_generations, c.grpo.eval_prompts = 8, 4, 0  # a prompt a process; no held-out
    c.max_iters, c.eval_interval = STEPS, 100
    c.tensorboard = c.plot = False
    return c


def worker(data_dir, out_dir, process: int) -> None:
    from flaxgpt.train import trainer

    c = config(data_dir, out_dir)
    # process 1 rolls out its share with 2 engine replicas on its device (their tokens are one
    # engine's), process 0 with one engine: both paths over processes in one run
    c.grpo.engine_replicas = 1 + process
    trainer.train(c, print_fn=lambda *a: print(*a, flush=True))


def both_processes_rollouts(monkeypatch):
    """Rollouts.sampled as process 0 and 1 would each sample them, concatenated (process 0's rows
    first, as the trainer's global batch), with process 0's metrics, in this one process."""
    import jax

    from flaxgpt.train import grpo_online

    # the rollout's process count: which prompts and seeds a process takes, and its engine's slots
    monkeypatch.setattr(
        grpo_online, "jax", types.SimpleNamespace(**{**vars(jax), "process_count": lambda: 2})
    )
    sampled = grpo_online.Rollouts.sampled

    def both(self, params, frozen, step, n_rows, process_index=0):
        shares = [sampled(self, params, frozen, step, n_rows // PROCESSES, p) for p in range(PROCESSES)]
        batch = {k: np.concatenate([s[0][k] for s in shares]) for k in shares[0][0]}
        return batch, shares[0][1]

    monkeypatch.setattr(grpo_online.Rollouts, "sampled", both)


def test_off_policy_rollouts_over_processes_are_one_line():
    from flaxgpt.train import grpo_rollout

    grpo_rollout.check_over_devices(1, 2)  # one process: the rollout thread
    grpo_rollout.check_over_devices(2, 0)  # several: in step with the update
    with pytest.raises(ValueError, match=r"has 2 processes: set grpo.off_policy_steps=0") as e:
        grpo_rollout.check_over_devices(2, 1)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # two jax processes, then the one-process reference
@pytest.mark.devices(2)
def test_two_processes_roll_out_and_train_like_one(tmp_path, monkeypatch):
    import jax

    from configs import grpo_toy
    from flaxgpt.data import prepare
    from flaxgpt.train import trainer

    grpo_toy.write_prompts(tmp_path / "toy.jsonl", n=40)
    data = tmp_path / "data"
    prepare.main(["--dataset", "prompts", "--input", str(tmp_path / "toy.jsonl"), "--tokenizer", "char",
                  "--out_dir", str(data)])  # fmt: skip
    out = tmp_path / "two"
    outputs = finish(launch(lambda port: [__file__, "{i}", str(data), str(out)], "slurm"))
    assert "compiled the train step" in outputs[0] and "compiled the train step" not in outputs[1]

    both_processes_rollouts(monkeypatch)
    ref = config(data, tmp_path / "one")
    ref.mesh.data = 2
    trainer.train(ref, devices=jax.devices()[:2], print_fn=lambda *a: None)
    got, want = metrics_losses(out), metrics_losses(tmp_path / "one")
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], atol=1e-5, rtol=1e-5)
    rows = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    rewards = lambda d: [(r["step"], r.get("reward"), r.get("val_reward")) for r in rows(d)]  # noqa: E731
    assert rewards(out) == rewards(tmp_path / "one")  # process 0's rollouts; the held-out prompts


if __name__ == "__main__":
    worker(sys.argv[2], sys.argv[3], int(sys.argv[1]))
