"""DPO against TRL 1.16's DPOTrainer (torch, CPU) on a tiny random Llama: per-pair policy and
reference log-probabilities, the loss, the rewards and one AdamW step, for full fine-tuning (a frozen
copy as the reference) and LoRA (the base with the adapter off), text and chat pairs, sigmoid and IPO;
packing equal to one pair a row; configs/dpo_llama.py end to end; one-line errors. Nothing is
downloaded."""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the configs/ package

from configs import dpo_llama  # noqa: E402
from flaxgpt.data import preference, prepare  # noqa: E402
from flaxgpt.data.hf_tokenizer import HFTokenizer  # noqa: E402
from flaxgpt.hf import peft as hf_peft  # noqa: E402
from flaxgpt.train import trainer as trainer_lib  # noqa: E402
from flaxgpt.train.config_check import ConfigError  # noqa: E402
from tests.data.test_chat import make_chat_dir  # noqa: E402
from tests.hf.test_llama import make_hf_model  # noqa: E402

T = 96  # the row: each sequence at most T // 2 tokens (TRL's max_length)
LR, EPS = 1e-2, 1e-3  # AdamW's first step is lr * g / (|g| + eps): eps keeps tiny gradients comparable
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def text_pairs(n):
    return [
        {
            "prompt": f"what is {i} plus {i}?",
            "chosen": f" it is {2 * i}.",
            "rejected": f" it is {i + 7} or so.",
        }
        for i in range(n)
    ]


def chat_pairs(n):
    out = []
    for i, p in enumerate(text_pairs(n)):
        prompt = [{"role": "user", "content": p["prompt"]}]
        if i % 2:
            prompt = [{"role": "system", "content": "Be brief."}, *prompt]
        reply = lambda s: [{"role": "assistant", "content": s.strip()}]  # noqa: E731
        out.append({"prompt": prompt, "chosen": reply(p["chosen"]), "rejected": reply(p["rejected"])})
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_dpo")
    make_hf_model("llama", str(directory))
    make_chat_dir(directory, "llama3")
    return directory


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prep(tmp_path, directory, records, *extra):
    src = write_jsonl(tmp_path / "pairs.jsonl", records)
    args = ["--dataset", "pairs", "--input", str(src), "--hf_dir", str(directory)]
    return prepare.main(args + ["--out_dir", str(tmp_path / "d"), "--block_size", str(T), *extra])


def tiny(directory, data, out, lora_rank=0, **dpo):
    c = dpo_llama.get_config()
    c.init_from, c.data.dir, c.out_dir = str(directory), str(data), str(out)
    c.model.block_size, c.model.dtype, c.model.remat, c.model.scan_layers = T, "float32", "none", False
    c.batch_size, c.grad_accum, c.max_iters, c.eval_interval, c.eval_iters = 2, 1, 1, 1, 1
    c.log_interval, c.ckpt_interval, c.tensorboard, c.plot, c.mesh.cpu_devices = 1, 0, False, False, 0
    c.lora.rank, c.lora.alpha, c.lora.dropout, c.lora.base_dtype = lora_rank, 8.0, 0.0, "float32"
    c.optim.learning_rate, c.optim.eps, c.optim.schedule, c.optim.warmup_steps = LR, EPS, "constant", 0
    c.optim.weight_decay, c.optim.grad_clip, c.optim.loss_chunk = 0.0, 0.0, 0
    for k, v in dpo.items():
        c.dpo[k] = v
    return c


def trl_side(directory, records, tmp_path, loss, rank):
    """TRL's DPOTrainer on `records` (float32: TRL's default is bf16): before and after one AdamW step
    on the batch of all pairs, per-pair policy and reference logps, the loss and the logged metrics;
    the trained tensors before and after (PEFT's names with LoRA, its new adapter saved to tmp_path)."""
    import peft
    import torch
    import transformers

    # the reference itself: installed by the dev extra (CI); an accelerator image without it skips
    pytest.importorskip("trl", reason="TRL, the reference, is not installed (pip install -e '.[dev]')")
    pytest.importorskip("datasets", reason="datasets (TRL's input) is not installed")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(records), max_steps=1,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_epsilon=EPS, weight_decay=0.0, max_grad_norm=0.0, beta=0.1, loss_type=[loss],
        max_length=T // 2, report_to="none", save_strategy="no", logging_steps=1, use_cpu=True,
        bf16=False, gradient_checkpointing=False, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    lora = peft.LoraConfig(r=rank, lora_alpha=8.0, target_modules=LLAMA_TARGETS) if rank else None
    trainer = DPOTrainer(
        model=model,
        args=args,
        processing_class=tok,
        train_dataset=Dataset.from_list(records),
        peft_config=lora,
    )
    model = trainer.model
    if rank:
        model.save_pretrained(str(tmp_path / "adapter"))  # its fresh adapter (B = 0): our start too
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])

    def measure():
        model.train()
        with torch.no_grad():
            reference = trainer.ref_model or model  # LoRA: the policy, its adapter disabled inside
            ref = [x.numpy() for x in trainer.compute_ref_log_probs(reference, batch)]
            # the policy's sums, as _compute_loss takes them from the fused head's per-token log-probs
            labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                        fused_lm_head=True, use_cache=False)  # fmt: skip
            policy = [x.numpy() for x in out.log_probs.sum(1).chunk(2)]
            trainer._metrics["train"].clear()
            value = float(trainer._compute_loss(model, batch, False))
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        return dict(policy=policy, ref=ref, loss=value, metrics=metrics)

    def trained():
        return {k: v.detach().numpy().copy() for k, v in model.named_parameters() if v.requires_grad}

    before, params_before = measure(), trained()
    trainer.train()
    return before, measure(), params_before, trained()


def flax_trainer(config):
    t = trainer_lib.Trainer(config, devices=jax.devices()[:1], print_fn=lambda *a: None)
    return t, t.init_state()


def per_pair(task, params, frozen, tok, records):
    """Our per-pair logps with each pair alone in a row, in the records' order."""
    pairs = [preference.tokenize_pair(tok, preference.check_pair(dict(r), "x"), T // 2, "x") for r in records]
    rows = [preference.pack_pairs([p], T) for p in pairs]
    batch = {k: np.concatenate([r[k] for r in rows]).astype(np.float32 if k == "loss_mask" else np.int32)
             for k in rows[0]}  # fmt: skip
    out = jax.jit(lambda p, f, b: task.objective.pair_logps(task.policy, p, f, b))(params, frozen, batch)
    return {k: np.asarray(v)[:, 0] for k, v in out.items()}


CASES = {  # name -> (pairs, LoRA rank, loss)
    "full_text_sigmoid": (text_pairs, 0, "sigmoid"),
    "lora_chat_sigmoid": (chat_pairs, 4, "sigmoid"),
    "full_chat_ipo": (chat_pairs, 0, "ipo"),
}
METRICS = {  # ours -> TRL's
    "reward_chosen": "rewards/chosen",
    "reward_rejected": "rewards/rejected",
    "reward_accuracy": "rewards/accuracies",
    "reward_margin": "rewards/margins",
    "logp_chosen": "logps/chosen",
    "logp_rejected": "logps/rejected",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_trl(model_dir, tmp_path, case):
    make, rank, loss = CASES[case]
    records = make(7)
    train_records = records[:6]  # prepare keeps the last pair for val
    prep(tmp_path, model_dir, records, "--val_fraction", "0.1")
    trl_before, trl_after, trl_p0, trl_p1 = trl_side(model_dir, train_records, tmp_path, loss, rank)
    config = tiny(model_dir, tmp_path / "d", tmp_path / "run", lora_rank=rank, loss=loss)
    config.batch_size = json.loads((tmp_path / "d/meta.json").read_text())["train_rows"]  # every pair
    t, state = flax_trainer(config)
    if rank:  # TRL's fresh adapter (random A, B = 0) is our start too
        _, adapters = hf_peft.load_adapter(str(tmp_path / "adapter"), t.task.model_config)
        state = state.replace(params=jax.device_put(adapters, t.param_shardings))
    tok, diffs = HFTokenizer(model_dir), {}

    def compare(when, trl, params, metrics):
        ours = per_pair(t.task, params, state.frozen, tok, train_records)
        for side in ("policy", "ref"):
            for i, part in enumerate(("chosen", "rejected")):
                d = np.abs(ours[f"{side}_{part}"] - trl[side][i]).max()
                diffs[f"{when} {side}"] = max(diffs.get(f"{when} {side}", 0.0), float(d))
        diffs[f"{when} loss"] = abs(float(metrics["loss"]) - trl["loss"])
        for name, trl_name in METRICS.items():
            if name != "reward_accuracy" or when == "after":  # before: policy == reference, ties
                diffs[f"{when} {name}"] = abs(float(metrics[name]) - trl["metrics"][trl_name])

    before = jax.tree.map(np.array, state.params)
    state, metrics = t.train_step(state, t.global_batch("train", 0, config.batch_size, micro=True))
    compare("before", trl_before, before, jax.device_get(metrics))  # a step's metrics: its start's
    batch = t.global_batch("train", 0, config.batch_size, micro=False)
    loss_sum, (n, sums) = jax.jit(lambda p, b, f: t.task.loss(p, b, None, False, f))(
        state.params, batch, state.frozen
    )
    compare("after", trl_after, state.params, {"loss": loss_sum / n, **{k: v / n for k, v in sums.items()}})

    # one AdamW step: every trained tensor moved as TRL moved it (compared in Hugging Face's names)
    cfg = t.task.model_config
    if rank:
        from safetensors.numpy import load_file

        def hf_names(adapters, where):
            hf_peft.export_adapter(
                cfg, t.task.policy.lora, jax.tree.map(np.asarray, adapters), str(tmp_path / where)
            )
            return load_file(str(tmp_path / where / "adapter_model.safetensors"))

        ours_p0, ours_p1 = hf_names(before, "a0"), hf_names(state.params, "a1")
        trl_p0, trl_p1 = (
            {k.replace(".default.weight", ".weight"): v for k, v in p.items()} for p in (trl_p0, trl_p1)
        )
    else:
        from flaxgpt.hf import families

        llama = families.FAMILIES["llama"]
        ours_p0, ours_p1 = (
            llama.export_state(cfg, jax.tree.map(np.asarray, p), "llama", llama)[1]
            for p in (before, state.params)
        )
    assert set(ours_p1) == set(trl_p1), sorted(set(ours_p1) ^ set(trl_p1))[:4]
    moved = {k: np.asarray(ours_p1[k]) - np.asarray(ours_p0[k]) for k in ours_p1}
    diffs["step"] = max(float(np.abs(moved[k] - (trl_p1[k] - trl_p0[k])).max()) for k in moved)
    assert max(np.abs(v).max() for v in moved.values()) > 1e-3  # the step did move them
    assert trl_after["metrics"]["rewards/margins"] != 0  # after the step the rewards say something
    print(case, {k: f"{v:.1e}" for k, v in diffs.items()})
    assert max(diffs.values()) < 1e-4, diffs


def test_packing_grad_accum_and_the_losses(model_dir, tmp_path):
    """Several pairs to a row (segments) give each pair's log-probabilities as a row of its own;
    micro-batches holding different numbers of pairs step as the whole batch at once (sums over pairs,
    divided once); conservative DPO and IPO are their closed forms."""
    records = text_pairs(13)
    meta = prep(tmp_path, model_dir, records, "--val_fraction", "0.1")
    assert meta["kind"] == "pairs" and meta["train_rows"] < meta["train_examples"]  # packed
    t, state = flax_trainer(tiny(model_dir, tmp_path / "d", tmp_path / "run"))
    rows = t.task.batch("train", 0, meta["train_rows"], 0)  # a permutation of every row
    pair_logps = lambda p, f, b: t.task.objective.pair_logps(t.task.policy, p, f, b)  # noqa: E731
    packed = jax.device_get(jax.jit(pair_logps)(state.params, state.frozen, rows))
    held = packed["n_chosen"] > 0
    assert held.sum() == meta["train_examples"]
    alone = per_pair(
        t.task, state.params, state.frozen, HFTokenizer(model_dir), records[: meta["train_examples"]]
    )
    for k in ("policy_chosen", "policy_rejected", "n_chosen", "n_rejected"):
        assert np.abs(np.sort(packed[k][held]) - np.sort(alone[k])).max() < 1e-4, k

    rows, out = meta["train_rows"] - meta["train_rows"] % 2, []
    for accum in (1, 2):
        config = tiny(model_dir, tmp_path / "d", tmp_path / f"run{accum}", lora_rank=4)
        config.batch_size, config.grad_accum = rows, accum
        t, state = flax_trainer(config)
        state, metrics = t.train_step(state, t.global_batch("train", 0, rows, micro=True))
        out.append((jax.device_get(metrics), jax.device_get(state.params)))
    (m1, p1), (m2, p2) = out
    assert set(m1) == set(m2) and "reward_margin" in m1
    assert all(abs(float(m1[k]) - float(m2[k])) < 1e-5 for k in m1), (m1, m2)
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), p1, p2))) < 1e-6

    from flaxgpt.train.dpo_task import dpo_losses

    logps = {k: np.asarray(v, np.float32)[None] for k, v in alone.items()}
    logps["policy_chosen"] = logps["policy_chosen"] + np.linspace(
        -1, 1, len(alone["n_chosen"]), dtype=np.float32
    )
    d = (logps["policy_chosen"] - logps["ref_chosen"]) - (logps["policy_rejected"] - logps["ref_rejected"])
    log_sigmoid = lambda x: -np.logaddexp(0, -x)  # noqa: E731
    got, _ = dpo_losses(logps, 0.5, "sigmoid", 0.2)
    want = -0.8 * log_sigmoid(0.5 * d) - 0.2 * log_sigmoid(-0.5 * d)
    assert np.abs(np.asarray(got) - want).max() < 1e-5
    got, (chosen, rejected) = dpo_losses(logps, 0.5, "ipo")
    ratio = lambda side: (logps[f"policy_{side}"] - logps[f"ref_{side}"]) / logps[f"n_{side}"]  # noqa: E731
    assert np.abs(np.asarray(got) - (ratio("chosen") - ratio("rejected") - 1.0) ** 2).max() < 1e-4
    assert np.abs(np.asarray(chosen) - 0.5 * (logps["policy_chosen"] - logps["ref_chosen"])).max() < 1e-5


def test_recipe_end_to_end_then_sample(model_dir, tmp_path, capsys):
    """train.py --config configs/dpo_llama.py (LoRA) on chat pairs: the reward margin grows, the
    rewards are logged; sample.py talks to the run."""
    from tests.train.test_train_cli import ROOT, run

    prep(tmp_path, model_dir, chat_pairs(16))
    overrides = dict(
        init_from=model_dir, out_dir=tmp_path / "run", max_iters=4, batch_size=2, grad_accum=1,
        eval_interval=4, eval_iters=1, log_interval=1, **{"data.dir": tmp_path / "d", "model.block_size": T,
        "model.dtype": "float32", "model.remat": "none", "optim.warmup_steps": 0, "optim.learning_rate": 1e-2,
        "lora.base_dtype": "float32", "lora.rank": 4, "mesh.cpu_devices": 1},
    )  # fmt: skip
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    r = run([str(ROOT / "train.py"), f"--config={ROOT}/configs/dpo_llama.py", *flags], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "reward_margin" in x]
    assert len(steps) == 4 and steps[0]["reward_margin"] == pytest.approx(0, abs=1e-3)
    assert steps[-1]["reward_margin"] > 0.01 and steps[-1]["loss"] < steps[0]["loss"]
    assert all(k in steps[-1] for k in ("reward_chosen", "reward_rejected", "reward_accuracy", "logp_chosen"))
    assert any("val_loss" in x for x in lines)
    import sample  # in this process (tests/decode/test_sample_cli.py runs sample.py as a command)

    capsys.readouterr()
    args = ["--out_dir", str(tmp_path / "run"), "--start", "what is", "--max_new_tokens", "4"]
    assert sample.main(args) == 0
    assert capsys.readouterr().out.startswith("what is")


def test_bad_pairs_are_one_line_naming_the_line_and_write_nothing(model_dir, tmp_path):
    good = text_pairs(3)
    cases = {
        "line 2: chosen is empty": [good[0], {**good[1], "chosen": " "}],
        "line 3: chosen and rejected are identical": [*good[:2], {**good[2], "rejected": good[2]["chosen"]}],
        r"line 2 has no 'rejected'": [good[0], {"prompt": "a", "chosen": "b"}],
        r"line 1: the prompt has \d+ tokens, leaving no room": [
            {**good[0], "prompt": "what is 1 " * 40},
            *good,
        ],
        "line 1 .*rejected: message 0 has role 'robot'": [
            {**chat_pairs(1)[0], "rejected": [{"role": "robot", "content": "x"}]}
        ],
    }
    for message, records in cases.items():
        with pytest.raises(prepare.PrepareError, match=f"pairs.jsonl {message}") as e:
            prep(tmp_path, model_dir, records)
        assert "\n" not in str(e.value) and not (tmp_path / "d").exists()


def test_a_pair_whose_reply_calls_a_tool_is_a_pair():
    """An agent's preference pair: the chosen turn is a tool call (no content: check_messages drops a null
    one), a KeyError once; an empty turn without a call is still refused."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"x": 1}'}}
    record = {
        "prompt": [{"role": "user", "content": "1 + 1?"}],
        "chosen": [{"role": "assistant", "content": None, "tool_calls": [call]}],
        "rejected": [{"role": "assistant", "content": "3"}],
    }
    checked = preference.check_pair(dict(record), "pairs.jsonl line 1")
    assert checked["chosen"][0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    empty = {**record, "chosen": [{"role": "assistant", "content": " "}]}
    with pytest.raises(prepare.PrepareError, match="line 1: chosen is empty"):
        preference.check_pair(empty, "pairs.jsonl line 1")


def test_bad_dpo_settings_fail_in_one_line_and_write_nothing(model_dir, tmp_path):
    prep(tmp_path, model_dir, text_pairs(6))
    other = tmp_path / "other"
    make_hf_model("llama", str(other), num_hidden_layers=3)
    cases = {
        "is not the policy's architecture: n_layer 3 (policy 2)": dict(reference=str(other)),
        "with LoRA: the reference is the base": dict(lora_rank=4, reference=str(model_dir)),
        "dpo.loss='kto'": dict(loss="kto"),
        "dpo.beta=0.0 must be > 0": dict(beta=0.0),
        "dpo.label_smoothing=0.5 must be in [0, 0.5)": dict(label_smoothing=0.5),
        "DPO tunes a pretrained model": dict(init_from="scratch"),
    }
    for message, over in cases.items():
        rank, init = over.pop("lora_rank", 0), over.pop("init_from", None)
        config = tiny(model_dir, tmp_path / "d", tmp_path / "never", lora_rank=rank, **over)
        config.init_from = init or config.init_from
        with pytest.raises((ConfigError, ValueError)) as e:
            trainer_lib.train(config, devices=jax.devices()[:1], print_fn=lambda *a: None)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert not (tmp_path / "never").exists()
