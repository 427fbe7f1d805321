"""LoRA fine-tuning tokens/s: flaxgpt against transformers + peft on the same small Llama, this CPU.

    python benchmarks/lora_train.py                     # 4 rounds x 20 steps (~3 min on 2 cores)
    python benchmarks/lora_train.py --rounds 6 --steps 40 --layers 4 --dim 256

One random Llama (LLAMA below, saved once with transformers) is the frozen base of both sides; each
side trains rank-16 adapters on every linear layer (q, k, v, o, gate, up, down; alpha 32, no
dropout) with AdamW (lr 1e-4, no weight decay) on the same random token batch [batch, seq], float32.
flaxgpt: models/lora.py's apply under one jitted step (value_and_grad over the adapters only,
optax.adamw, the state donated), as the trainer's train_step does. transformers + peft:
get_peft_model, model(input_ids, labels=input_ids).loss.backward(), torch.optim.AdamW over the
trainable parameters, torch's default threads. Each side runs in its own subprocess, the order
alternating every round; a round times `steps` steps after `warmup` untimed ones (flaxgpt's compile
among them), tokens/s = batch x seq x steps / seconds. Printed: each round's figures and ratio, the
medians, and the versions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK, ALPHA, LR = 16, 32.0, 1e-4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_base(directory: Path, layers: int, dim: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=dim,
        intermediate_size=int(dim * 8 / 3) // 16 * 16,
        num_hidden_layers=layers,
        num_attention_heads=dim // 64,
        num_key_value_heads=dim // 64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)


def tokens(batch: int, seq: int):
    import numpy as np

    return np.random.RandomState(0).randint(0, 2048, (batch, seq + 1))


def run_flaxgpt(base: str, batch: int, seq: int, warmup: int, steps: int) -> dict:
    import jax
    import optax

    sys.path.insert(0, str(ROOT))
    from flaxgpt.hf import gpt2 as hf
    from flaxgpt.models import lora
    from flaxgpt.train.losses import cross_entropy

    config, params = hf.load_pretrained(base)
    spec = lora.LoraSpec.make(config, RANK, ALPHA, 0.0, "all-linear")
    adapters = lora.init_adapters(config, spec, jax.random.key(0))
    tx = optax.adamw(LR, weight_decay=0.0)
    data = tokens(batch, seq)
    x, y = jax.numpy.asarray(data[:, :-1]), jax.numpy.asarray(data[:, 1:])

    def loss_fn(a, base_params):
        logits = lora.apply(config, spec, base_params, a, x)
        loss_sum, n = cross_entropy(logits, y)
        return loss_sum / n

    def step(a, opt, base_params):
        loss, grads = jax.value_and_grad(loss_fn)(a, base_params)
        updates, opt = tx.update(grads, opt, a)
        return optax.apply_updates(a, updates), opt, loss

    step = jax.jit(step, donate_argnums=(0, 1))  # the base is an argument, not a baked-in constant
    opt = tx.init(adapters)
    for _ in range(warmup):
        adapters, opt, loss = step(adapters, opt, params)
    loss.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps):
        adapters, opt, loss = step(adapters, opt, params)
    loss.block_until_ready()
    return {"seconds": time.perf_counter() - t0, "loss": float(loss), "version": f"jax {jax.__version__}"}


def run_torch(base: str, batch: int, seq: int, warmup: int, steps: int) -> dict:
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)
    model = peft.get_peft_model(model, cfg).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    ids = torch.from_numpy(tokens(batch, seq)[:, :-1]).long()  # labels shift inside the model

    def one():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        one()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = one()
    seconds = time.perf_counter() - t0
    version = f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
    return {"seconds": seconds, "loss": float(loss), "version": version}


def worker(argv) -> None:
    side, base, batch, seq, warmup, steps = argv[0], argv[1], *map(int, argv[2:])
    run = run_flaxgpt if side == "flaxgpt" else run_torch
    print("RESULT " + json.dumps(run(base, batch, seq, warmup, steps)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_base(Path(tmp), a.layers, a.dim)
        rates: dict = {"flaxgpt": [], "torch": []}
        versions = {}
        for r in range(a.rounds):
            order = ["flaxgpt", "torch"] if r % 2 == 0 else ["torch", "flaxgpt"]
            for side in order:
                args = [side, tmp, a.batch, a.seq, a.warmup, a.steps]
                cmd = [sys.executable, __file__, "--worker", *map(str, args)]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if out.returncode:
                    sys.exit(f"{side} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.split("RESULT ", 1)[1])
                rates[side].append(a.batch * a.seq * a.steps / res["seconds"])
                versions[side] = res["version"]
            ratio = rates["flaxgpt"][-1] / rates["torch"][-1]
            print(
                f"round {r} ({' then '.join(order)}): flaxgpt {rates['flaxgpt'][-1]:,.0f} tok/s, "
                f"transformers+peft {rates['torch'][-1]:,.0f} tok/s, ratio {ratio:.2f}x",
                flush=True,
            )
    ratios = [f / t for f, t in zip(rates["flaxgpt"], rates["torch"])]
    print(
        f"Llama {a.layers} layers x {a.dim}, batch {a.batch} x seq {a.seq}, LoRA r={RANK} all-linear, AdamW; "
        f"median flaxgpt {statistics.median(rates['flaxgpt']):,.0f} tok/s, transformers+peft "
        f"{statistics.median(rates['torch']):,.0f} tok/s, median ratio {statistics.median(ratios):.2f}x "
        f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})"
    )
    py = sys.version.split()[0]
    print(f"versions: flaxgpt side {versions['flaxgpt']}; reference {versions['torch']}; python {py}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
