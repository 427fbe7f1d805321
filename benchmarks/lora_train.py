"""LoRA fine-tuning tokens/s: flaxgpt against transformers + peft on the same small Llama, this CPU.

    JAX_PLATFORMS=cpu python benchmarks/lora_train.py              # 4 rounds x 20 steps, 20 s pauses
    JAX_PLATFORMS=cpu python benchmarks/lora_train.py --rounds 6 --steps 40 --layers 4 --dim 256
    JAX_PLATFORMS=cpu python benchmarks/lora_train.py --rounds 4 --pause 1 --steps 5   # a smoke run
    JAX_PLATFORMS=cpu python benchmarks/lora_train.py --torch_python VENV/bin/python   # peft from a venv

One random Llama (make_base, saved once with transformers) is the frozen base of both sides; each
side trains rank-16 adapters on every linear layer (q, k, v, o, gate, up, down; alpha 32, no
dropout) with AdamW (lr 1e-4, no weight decay) on the same random token batch [batch, seq], float32
everywhere (weights, activations, matmuls, softmax, loss).
flaxgpt: models/lora.py's apply under one jitted step (value_and_grad over the adapters only,
optax.adamw, the state donated) on one CPU device, as the trainer's train_step does with the Llama
recipes (mesh.cpu_devices = 1), after runtime.keep_cpu_step_memory() as the trainer calls it.
transformers + peft, the loop its users write: get_peft_model,
model(input_ids, labels=input_ids).loss.backward(), torch.optim.AdamW over the trainable
parameters, eager (not torch.compile), transformers' default attention (sdpa), torch's default
threads (one per core, as XLA's pool).
Each side runs in its own process (benchmarks/harness.py: the order alternates every round, a
pause before each run); a run times `steps` steps after `warmup` untimed ones (flaxgpt's compile
among them): tokens/s = batch x seq x steps / seconds. Printed: each round's ms/step, the median
tokens/s of each side, the per-round ratios and their median, and the versions.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)

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

    from flaxgpt import runtime
    from flaxgpt.hf import pretrained as hf
    from flaxgpt.models import lora
    from flaxgpt.train.losses import cross_entropy

    runtime.keep_cpu_step_memory()  # as `train` does before it starts: steps reuse their memory
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: run one side, print RESULT
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps first (flaxgpt compiles in the first)"
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--torch_python", default=sys.executable, help="interpreter for the peft side")
    harness.add_arguments(p)
    a = p.parse_args()
    shape = [f"--steps={a.steps}", f"--warmup={a.warmup}", f"--batch={a.batch}", f"--seq={a.seq}"]
    if a.side:
        res = SIDES[a.side](a.base, a.batch, a.seq, a.warmup, a.steps)
        res["tokens_per_s"] = a.batch * a.seq * a.steps / res["seconds"]
        res["ms_per_step"] = 1e3 * res["seconds"] / a.steps
        return harness.print_result(res)
    with tempfile.TemporaryDirectory() as tmp:
        make_base(Path(tmp), a.layers, a.dim)
        python = {"flaxgpt": sys.executable, "torch": a.torch_python}
        sides = [
            harness.Side(name, [python[name], __file__, "--side", name, "--base", tmp, *shape], cwd=str(ROOT))
            for name in SIDES
        ]
        figures = [harness.Figure("LoRA train tokens/s", "flaxgpt", "tokens_per_s", "torch", "tokens_per_s")]
        report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    for name in SIDES:
        ms = [f"{x:.1f}" for x in report.values(name, "ms_per_step")]
        print(f"{name} ms/step per round: {' '.join(ms)} ({report.results[0][name]['version']})")
    print(
        f"Llama {a.layers} layers x {a.dim}, batch {a.batch} x seq {a.seq}, LoRA r={RANK} all-linear, AdamW, "
        f"float32; torch = transformers + peft"
    )
    print("\n" + report.table())


SIDES = {"flaxgpt": run_flaxgpt, "torch": run_torch}

if __name__ == "__main__":
    main()
