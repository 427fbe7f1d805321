"""DPO training speed: flaxgpt's trainer (configs/dpo_llama.py) against TRL's DPOTrainer, same model,
same pairs, this CPU, side by side with the alternating harness.

    python benchmarks/dpo_train.py                        # 4 rounds, LoRA r=16 (the recipe's)
    python benchmarks/dpo_train.py --rounds 6 --pause 30 --lora_rank 0    # full fine-tuning
    python benchmarks/dpo_train.py --torch_python VENV/bin/python   # TRL from another venv

One random Llama (--layers x --dim, a byte-level BPE of --vocab tokens trained here) saved with
transformers is the policy's start and the reference of both sides; the pairs are generated text
({prompt, chosen, rejected}, responses of varied length). Both sides: float32, AdamW (lr 1e-5, no
weight decay, no clipping), beta 0.1, the sigmoid loss, each sequence at most --seq tokens, no
dropout, no activation checkpointing, LoRA on every linear layer (alpha 2r) or every weight.
flaxgpt: `flaxgpt prepare --dataset pairs` (block_size 2 x --seq: a pair's two sequences to a row,
short pairs packed several to a row), then the trainer's jitted step (policy and reference in one
program) with --pairs pairs a step on average (batch_size = rows holding that many). TRL 1.16: the
DPOTrainer with per_device_train_batch_size = --pairs (padded to the batch's longest sequence), the
reference the base with the adapter disabled (LoRA) or a copy. Each side times --steps steps after
--warmup untimed ones (flaxgpt's compile among them) and counts the pairs they trained on.
Figures: pairs/s (steps/s at equal pairs a step) and steps/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import harness  # noqa: E402  (first: the benchmarks' one sys.path rule, see harness.py)

LR, BETA = 1e-5, 0.1
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WORDS = "the a quick lazy fox dog jumps over runs under red blue green one two three four five".split()


def pairs(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    reply = lambda: " " + say(rng.randint(5, 40))  # noqa: E731
    return [{"prompt": say(rng.randint(10, 40)), "chosen": reply(), "rejected": reply()} for _ in range(n)]


def make_model(directory: Path, layers: int, dim: int, vocab: int) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    special = ["<unk>", "<|begin_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS * 50)], trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": special[1], "eos_token": special[2], "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=dim, intermediate_size=int(dim * 8 / 3) // 16 * 16,
        num_hidden_layers=layers, num_attention_heads=dim // 64, num_key_value_heads=dim // 64,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    (directory / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs(2000)))


def run_flaxgpt(a) -> dict:
    import jax
    import numpy as np

    from configs import dpo_llama
    from flaxgpt.data import prepare
    from flaxgpt.train import trainer as trainer_lib
    from flaxgpt.train.config_check import check

    model, data = Path(a.dir), Path(a.dir) / f"data_{os.getpid()}"
    flags = ["--dataset", "pairs", "--input", model / "pairs.jsonl", "--hf_dir", model, "--out_dir", data]
    meta = prepare.main([*map(str, flags), "--block_size", str(2 * a.seq), "--val_fraction", "0.01"])
    per_row = meta["train_examples"] / meta["train_rows"]
    c = dpo_llama.get_config()
    c.init_from, c.data.dir, c.out_dir = str(model), str(data), str(model / f"run_{os.getpid()}")
    c.model.block_size, c.model.dtype, c.model.remat = 2 * a.seq, "float32", "none"
    c.batch_size, c.grad_accum = max(1, round(a.pairs / per_row)), 1
    c.max_iters, c.eval_interval, c.eval_iters, c.log_interval = a.warmup + a.steps, 10**6, 1, 10**6
    c.ckpt_interval, c.tensorboard, c.plot = 0, False, False
    c.lora.rank, c.lora.alpha, c.lora.base_dtype = a.lora_rank, 2.0 * a.lora_rank, "float32"
    c.optim.learning_rate, c.optim.schedule, c.optim.warmup_steps = LR, "constant", 0
    c.optim.weight_decay, c.optim.grad_clip, c.optim.loss_chunk = 0.0, 0.0, 0
    check(c)
    trainer_lib.start_process(c)  # as `train` does
    clock = {}

    class Timed(trainer_lib.Trainer):
        def after_step(self, step, state):
            if step in (a.warmup, c.max_iters):  # the window's ends, every step before them finished
                jax.block_until_ready(state.params)
                clock[step] = time.perf_counter()

    t = Timed(c, print_fn=lambda *_: None)
    t.run(t.init_state())
    t.close()
    held = 0  # the pairs the timed steps trained on: odd segment ids (chosen) of their rows
    for step in range(a.warmup, c.max_iters):
        seg = t.task.batch("train", step, c.batch_size, 0)["segment_ids"]
        held += int(sum(len(np.unique(r[r % 2 == 1])) for r in seg))
    seconds = clock[c.max_iters] - clock[a.warmup]
    rates = {"pairs_s": held / seconds, "steps_s": a.steps / seconds, "pairs_per_step": held / a.steps}
    return {**rates, "rows": c.batch_size, "devices": len(t.mesh.devices.flat)}


def run_trl(a) -> dict:
    import peft
    import torch
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model_dir = Path(a.dir)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    records = [json.loads(x) for x in (model_dir / "pairs.jsonl").read_text().splitlines()]
    args = DPOConfig(
        output_dir=str(model_dir / f"trl_{os.getpid()}"), per_device_train_batch_size=a.pairs,
        max_steps=a.warmup + a.steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", weight_decay=0.0, max_grad_norm=0.0, beta=BETA, loss_type=["sigmoid"],
        max_length=a.seq, report_to="none", save_strategy="no", logging_steps=10**6, use_cpu=True,
        bf16=False, gradient_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    lora = (
        peft.LoraConfig(r=a.lora_rank, lora_alpha=2.0 * a.lora_rank, lora_dropout=0.0, target_modules=TARGETS)
        if a.lora_rank
        else None
    )
    clock = {}

    class Timer(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (a.warmup, a.warmup + a.steps):
                clock[state.global_step] = time.perf_counter()

    trainer = DPOTrainer(
        model=model, args=args, processing_class=tok, train_dataset=Dataset.from_list(records),
        peft_config=lora, callbacks=[Timer()],
    )  # fmt: skip
    trainer.train()
    seconds = clock[a.warmup + a.steps] - clock[a.warmup]
    return {"pairs_s": a.pairs * a.steps / seconds, "steps_s": a.steps / seconds, "pairs_per_step": a.pairs,
            "threads": torch.get_num_threads()}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_arguments(p)
    p.add_argument("--steps", type=int, default=12, help="timed steps a run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    p.add_argument("--pairs", type=int, default=8, help="pairs a step")
    p.add_argument("--seq", type=int, default=128, help="tokens a sequence at most (TRL's max_length)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--lora_rank", type=int, default=16, help="0: full fine-tuning against a frozen copy")
    p.add_argument("--torch_python", default=sys.executable, help="interpreter for the TRL side")
    p.add_argument("--side", choices=["flaxgpt", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.side:
        return harness.print_result((run_flaxgpt if a.side == "flaxgpt" else run_trl)(a))
    keep = [
        "--steps",
        a.steps,
        "--warmup",
        a.warmup,
        "--pairs",
        a.pairs,
        "--seq",
        a.seq,
        "--lora_rank",
        a.lora_rank,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), a.layers, a.dim, a.vocab)
        args = [__file__, *map(str, keep), "--dir", tmp, "--side"]
        env = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
        sides = [
            harness.Side("flaxgpt", [sys.executable, *args, "flaxgpt"], env=env),
            harness.Side("trl", [a.torch_python, *args, "trl"], env=env),
        ]
        what = f"Llama {a.layers} x {a.dim}, {a.pairs} pairs a step, " + (
            f"LoRA r={a.lora_rank}" if a.lora_rank else "full fine-tuning"
        )
        figures = [
            harness.Figure(f"{what}: pairs/s", "flaxgpt", "pairs_s", "trl", "pairs_s"),
            harness.Figure(f"{what}: steps/s", "flaxgpt", "steps_s", "trl", "steps_s"),
        ]
        report = harness.compare(sides, figures, rounds=a.rounds, pause=a.pause)
    print(report.table())


if __name__ == "__main__":
    main()
