"""A tiny Gemma 3 directory through the fine-tuning recipe: prepare -> train.py -> loss goes down -> export.

The tiny random Gemma 3 of test_families (window 5 < the 32-token training window, soft-capped
Gemma 2 options checked there) and a byte-level BPE trained here stand in for a published model.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import transformers

from flaxgpt.data import prepare
from tests.hf.test_families import FAMILIES, TINY
from tests.hf.test_llama_cli import TEXT, make_tokenizer
from tests.train.test_train_cli import run

ROOT = Path(__file__).resolve().parents[2]


def test_finetune_gemma3_loss_goes_down_then_export(tmp_path):
    import jax

    from flaxgpt import hf_cli
    from flaxgpt.runs.run_dir import load_run
    from tests.hf.test_llama import flax_logits

    config_cls, model_cls, extra = FAMILIES["gemma3_text"]
    torch.manual_seed(0)
    model_cls(config_cls(**{**TINY, **extra})).save_pretrained(tmp_path / "gemma")
    make_tokenizer(str(tmp_path / "gemma"))
    (tmp_path / "in.txt").write_text(TEXT)
    args = ["--dataset", "text", "--input", str(tmp_path / "in.txt"), "--out_dir", str(tmp_path / "d")]
    prepare.main(args + ["--tokenizer", str(tmp_path / "gemma")])
    overrides = dict(
        init_from=tmp_path / "gemma", out_dir=tmp_path / "run", max_iters=8, batch_size=4, grad_accum=1,
        eval_interval=8, eval_iters=1, log_interval=1, **{"data.dir": tmp_path / "d", "model.block_size": 32,
        "model.dtype": "float32", "model.scan_layers": False, "optim.warmup_steps": 0,
        "optim.learning_rate": 3e-3},
    )  # fmt: skip
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    recipe = f"--config={ROOT}/configs/finetune_llama.py"
    r = run([str(ROOT / "train.py"), recipe, *flags], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) >= 4 and losses[-1] < losses[0] - 0.5, losses
    saved = json.loads((tmp_path / "run/config.json").read_text())["model"]
    assert (saved["window_pattern"], saved["norm"], saved["post_norms"]) == (6, "rmsnorm_1p", True)

    assert hf_cli.main(["export", "--out_dir", str(tmp_path / "run"), "--to", str(tmp_path / "hf")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    trained = load_run(tmp_path / "run")
    tokens = np.asarray([trained.tokenizer.encode("the lazy dog jumps over the quick brown fox")])
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours = flax_logits(trained.config, jax.device_get(trained.params), tokens)
    np.testing.assert_allclose(ref, ours, atol=1e-4)

    # the recipe's default scan_layers=True: one line saying what to change
    flags = [f for f in flags if "scan_layers" not in f and "out_dir" not in f]
    r = run([str(ROOT / "train.py"), recipe, *flags, f"--config.out_dir={tmp_path / 'run2'}"], tmp_path)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and "need scan_layers=False" in last and "Traceback" not in r.stderr, r.stderr
