"""`flaxgpt eval` under a multi-process launcher: 2 processes started with Slurm's variables (gloo on
the CPU, tests/train/test_multihost.py's launcher) each score a share of HellaSwag, and the results
are one process's; process 0 alone prints and writes them."""

import json
import random

import numpy as np
import pytest

from flaxgpt.eval import shards
from tests.eval.test_eval import save_run, write_hellaswag
from tests.train.test_multihost import PROCESSES, finish, launch


def test_blocks_cover_the_requests_once_in_order():
    for n in (0, 1, 2, 7, 9):
        blocks = [list(shards.block(n, 3, p)) for p in range(3)]
        assert sum(blocks, []) == list(range(n)) and max(map(len, blocks)) - min(map(len, blocks)) <= 1


@pytest.mark.slow  # two jax processes
def test_two_processes_score_like_one(tmp_path, capsys):
    import jax

    from flaxgpt.data.tokenizers import CharTokenizer
    from flaxgpt.eval import evaluate as fe
    from flaxgpt.models.gpt import GPTConfig, init_params

    data = tmp_path / "hellaswag.jsonl"
    write_hellaswag(data, random.Random(0), 9)  # 9 examples: blocks of 5 and 4
    chars = sorted(set(data.read_text()) | set(" :.[]"))
    # block 128: some contexts share a window with their endings (score_choices' shared path), the
    # longer ones are scored row by row (its fallback to score)
    cfg = GPTConfig(vocab_size=len(chars), block_size=128, n_layer=1, n_head=2, n_embd=16)
    run = save_run(tmp_path / "run", cfg, CharTokenizer(chars).to_meta(), init_params(cfg, jax.random.key(0)))
    args = ["--out_dir", str(run), "--task", "hellaswag", "--data", str(data), "--no_progress"]

    want = fe.main([*args, "--output", str(tmp_path / "one.json")])  # this process: 8 devices
    capsys.readouterr()
    out = tmp_path / "two.json"
    procs = launch(lambda port: ["-m", "flaxgpt.eval.evaluate", *args, "--output", str(out)], "slurm")
    outputs = finish(procs)
    got = json.loads(out.read_text())

    # the same scores (float32 rounding of other batch shapes), so the same accuracies
    np.testing.assert_allclose(got["loglikelihoods"], want["loglikelihoods"], rtol=1e-5, atol=1e-5)
    for k in ("n", "acc", "acc_norm", "acc_nanogpt", "acc_norm_nanogpt"):
        assert got[k] == want[k], k
    assert got["tokens_scored"] == want["tokens_scored"]  # every process's requests counted
    # process 0 alone printed the summary and appended the metrics line (one for each evaluation)
    assert '"acc_norm"' in outputs[0] and '"acc_norm"' not in outputs[1]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("time")
    assert len(rows) == 2 and rows[0] == rows[1] and PROCESSES == 2
