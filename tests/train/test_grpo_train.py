"""GRPO through the trainer: `flaxgpt prepare --dataset prompts` (files, one-line errors naming the
line, nothing written), configs/grpo_toy.py through trainer.train on tiny shapes (rollouts, rewards
and the update logged per step into metrics.jsonl, held-out val_reward at evaluations, num_iterations
reusing a rollout), sample.py loading the run, LoRA with beta on a tiny Llama's chat prompts, and bad
GRPO settings failing in one line before anything is written."""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the configs/ package

from configs import count_sft, grpo_count, grpo_toy  # noqa: E402
from flaxgpt.data import prepare  # noqa: E402
from flaxgpt.train import grpo_rollout  # noqa: E402
from flaxgpt.train import trainer as trainer_lib  # noqa: E402
from flaxgpt.train.config_check import ConfigError  # noqa: E402


def prep(tmp_path, records, *extra) -> Path:
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = [
        "--dataset",
        "prompts",
        "--input",
        str(src),
        "--tokenizer",
        "char",
        "--out_dir",
        str(tmp_path / "d"),
    ]
    prepare.main([*args, *extra])
    return tmp_path / "d"


def test_prepare_prompts_and_bad_lines(tmp_path):
    good = [{"prompt": "ab>", "answer": "ab"}, {"prompt": "ca>", "answer": "ca", "n": 2}, {"prompt": "b>"}]
    d = prep(tmp_path, good, "--val_fraction", "0.34")
    meta = json.loads((d / "meta.json").read_text())
    assert meta["kind"] == "prompts" and meta["train_examples"] == 2 and meta["val_examples"] == 1
    assert meta["max_prompt_tokens"] == 3 and meta["tokenizer"]["chars"][meta["eos_id"]] == "\n"
    rows = [json.loads(x) for x in (d / "train.prompts.jsonl").read_text().splitlines()]
    assert rows[1]["fields"] == {"answer": "ca", "n": 2} and len(rows[1]["ids"]) == 3
    cases = {
        "line 2 has no 'prompt'": [good[0], {"answer": "x"}],
        "line 1: the prompt is empty": [{"prompt": " "}, *good],
        "line 2: the prompt must be text": [good[0], {"prompt": 3}],
        "line 1 prompt: message 0 has role 'robot'": [{"prompt": [{"role": "robot", "content": "x"}]}],
        "line 2: the prompt has 9 tokens, leaving no room": [good[0], {"prompt": "abababab>"}, good[1]],
    }
    for i, (message, records) in enumerate(cases.items()):
        case = tmp_path / f"case{i}"
        case.mkdir()
        with pytest.raises(prepare.PrepareError, match=f"prompts.jsonl {message}") as e:
            prep(case, records, "--block_size", "8")
        assert "\n" not in str(e.value) and [p.name for p in case.iterdir()] == ["prompts.jsonl"]


def toy_data(tmp_path) -> Path:
    grpo_toy.write_prompts(tmp_path / "toy.jsonl", n=80)  # 8 held out: eval batches = rollout batches
    return prep(tmp_path, [json.loads(x) for x in (tmp_path / "toy.jsonl").read_text().splitlines()])


def tiny_run(config, data, out, devices: int = 1, **over):
    config.data.dir, config.out_dir = str(data), str(out)
    config.tensorboard = config.plot = False
    for key, value in over.items():
        section, _, name = key.rpartition(".")
        (config[section] if section else config)[name] = value
    trainer_lib.train(config, devices=jax.devices()[:devices], print_fn=lambda *a: None)
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_rows_are_cut_to_lengths_a_context_axis_splits():
    """A row is as long as the longest prompt and a completion need, rounded up to 8 and to what the
    mesh's context axis splits: ring 2 x context chunks, Ulysses context (16 of a 64-token window
    over a ring of 8; it was 8, which the ring refused once the run had started)."""
    import dataclasses
    from types import SimpleNamespace

    from flaxgpt.models.gpt import GPTConfig
    from flaxgpt.train import grpo_online

    cfg = grpo_toy.get_config()  # completions of 4 tokens
    model = GPTConfig(vocab_size=8, block_size=64, n_layer=1, n_head=2, n_embd=16)
    rows = []
    for context, impl in [(1, "ring"), (4, "ring"), (8, "ring"), (8, "ulysses"), (64, "ring")]:
        cfg.mesh.context = context
        mc = dataclasses.replace(model, context_impl=impl)
        rows.append(grpo_online.objective(cfg, mc, SimpleNamespace(max_prompt_tokens=4)).T)
    assert rows == [8, 8, 16, 8, 64]  # never past the window (a multiple already)


def test_recipe_trains_logs_rewards_then_sample(tmp_path, capsys, caplog):
    """configs/grpo_toy.py through trainer.train (train.py's path), 3 steps of 2 prompts x G 4
    (num_iterations 2: steps 1 and 3 sample, step 2 reuses step 1's completions): every per-step
    GRPO field is logged; the engine's decode and group-insert programs compile once over the run's
    rollouts and evaluations (a slot state placed differently at the first rollout compiled them
    twice); sample.py loads the run."""
    import logging

    import sample

    over = {
        "max_iters": 3, "batch_size": 8, "eval_interval": 3, "model.n_layer": 1, "grpo.num_generations": 4,
        "grpo.eval_prompts": 8, "grpo.num_iterations": 2, "grpo.mask_truncated_completions": True,
    }  # fmt: skip
    with jax.log_compiles(), caplog.at_level(logging.WARNING, logger="jax"):
        lines = tiny_run(grpo_toy.get_config(), toy_data(tmp_path), tmp_path / "run", **over)
    compiled = [
        r.getMessage().split(" ")[1] for r in caplog.records if r.getMessage().startswith("Compiling ")
    ]
    assert compiled.count("jit(_decode_chunk)") == compiled.count("jit(_insert_group)") == 1, compiled
    steps = [x for x in lines if "reward" in x]
    assert [x["step"] for x in steps] == [1, 2, 3]
    fields = ("reward_std", "rewards/copy_reward/mean", "rewards/copy_reward/std", "frac_reward_zero_std")
    fields += ("completion_length", "completions/clipped_ratio", "clip_region", "entropy", "update_time")
    for x in steps:
        assert all(k in x for k in fields), sorted(x)
        assert 0 <= x["reward"] <= 1 and x["update_time"] > 0
        # over the step's completions, as TRL logs it (it was the mean of the groups' stds)
        assert x["reward_std"] == pytest.approx(x["rewards/copy_reward/std"], abs=2e-6)
    assert steps[0]["rollout_time"] > 0 and steps[1]["rollout_time"] == 0.0 and steps[2]["rollout_time"] > 0
    assert steps[1]["reward"] == steps[0]["reward"]  # the same rollout, trained on twice
    evals = [x for x in lines if "val_reward" in x]
    assert [x["step"] for x in evals] == [0, 3] and "val_rewards/copy_reward" in evals[0]
    capsys.readouterr()
    args = [
        "--out_dir",
        str(tmp_path / "run"),
        "--start",
        "abc>",
        "--max_new_tokens",
        "4",
        "--temperature",
        "0",
    ]
    assert sample.main(args) == 0
    assert capsys.readouterr().out.startswith("abc>")


def test_sft_then_grpo_from_the_run(tmp_path):
    """configs/count_sft.py then configs/grpo_count.py (docs/grpo.md's SFT -> GRPO): the prompts
    prepared with the SFT run's tokenizer (`--tokenizer RUN_DIR`), GRPO starting from the run's own
    weights and model (init_from the run directory), two steps through trainer.train; prompts with
    a character the run never saw, and a dataset of another vocabulary, are one line each."""
    from flaxgpt import loader
    from flaxgpt.train.tasks import make_task

    grpo_count.write_data(tmp_path, n=40)
    sft_data, sft_run, grpo_data = tmp_path / "sft_data", tmp_path / "sft", tmp_path / "grpo_data"
    text = ["--dataset", "text", "--input", str(tmp_path / "count_sft.txt"), "--tokenizer", "char"]
    prepare.main([*text, "--out_dir", str(sft_data)])
    over = {"max_iters": 2, "batch_size": 4, "eval_iters": 1, "optim.warmup_steps": 0}
    tiny_run(count_sft.get_config(), sft_data, sft_run, **over)
    prompts = ["--dataset", "prompts", "--input", str(tmp_path / "count_prompts.jsonl")]
    prepare.main([*prompts, "--tokenizer", str(sft_run), "--out_dir", str(grpo_data)])
    run_meta, data_meta = (json.loads((d / "meta.json").read_text()) for d in (sft_run, grpo_data))
    assert data_meta["tokenizer"] == run_meta["tokenizer"] and data_meta["val_examples"] == 4

    c = grpo_count.get_config()
    c.init_from, c.data.dir = str(sft_run), str(grpo_data)
    task, sft = make_task(c), loader.load(sft_run)
    assert task.model_config == sft.config  # the run's model, not the recipe's default one
    assert all(np.array_equal(a, b) for a, b in zip(*map(jax.tree.leaves, (task.pretrained, sft.params))))
    over = {"init_from": str(sft_run), "max_iters": 2, "batch_size": 8, "grpo.num_generations": 4}
    lines = tiny_run(c, grpo_data, tmp_path / "grpo", **over, **{"grpo.eval_prompts": 4, "eval_interval": 2})
    assert [x["step"] for x in lines if "val_reward" in x] == [0, 2]

    (tmp_path / "odd.jsonl").write_text('{"prompt": "abxa=", "answer": "2"}\n')
    odd = ["--dataset", "prompts", "--input", str(tmp_path / "odd.jsonl"), "--tokenizer", str(sft_run)]
    with pytest.raises(prepare.PrepareError, match="odd.jsonl line 1: characters not in the vocabulary: 'x'"):
        prepare.main([*odd, "--out_dir", str(tmp_path / "never")])
    with pytest.raises(ValueError, match="was trained with another tokenizer than the dataset's") as e:
        tiny_run(c, toy_data(tmp_path), tmp_path / "never", init_from=str(sft_run))
    assert "\n" not in str(e.value) and not (tmp_path / "never").exists()


@pytest.fixture(scope="module")
def llama_prompts(tmp_path_factory):
    """A tiny random Llama (HF directory, llama3 chat template) and chat prompts prepared with it."""
    from tests.data.test_chat import make_chat_dir
    from tests.hf.test_llama import make_hf_model

    tmp = tmp_path_factory.mktemp("llama_prompts")
    model = tmp / "llama"
    make_hf_model("llama", str(model))
    make_chat_dir(model, "llama3")
    records = [{"prompt": [{"role": "user", "content": f"what is {i}"}], "answer": str(i)} for i in range(8)]
    src = tmp / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ["--dataset", "prompts", "--input", str(src), "--hf_dir", str(model), "--val_fraction", "0.5"]
    prepare.main([*args, "--out_dir", str(tmp / "d")])
    return model, tmp / "d"


def llama_recipe(model):
    c = grpo_toy.get_config()
    c.init_from = str(model)
    c.model.block_size, c.model.dtype, c.model.remat, c.model.scan_layers = 32, "float32", "none", False
    return c


def test_qlora_with_beta_on_chat_prompts(tmp_path, llama_prompts):
    """A tiny Llama with LoRA over its int8-quantized base (QLoRA), rolled out by generate (the adapters
    unmerged, as the engine adds them: test_qlora_over_4_devices runs the engine's), chat prompts (its
    template), beta > 0 (the reference: the int8 base, adapters off): the KL is 0 while the adapters
    are zero, > 0 after an update."""
    model, data = llama_prompts
    over = {
        "grpo.rollout": "generate",
        "lora.rank": 4, "lora.alpha": 8.0, "lora.base_dtype": "int8", "grpo.num_generations": 2,
        "batch_size": 4, "max_iters": 2, "eval_interval": 2, "grpo.beta": 0.04,
        # TRL's own reward reads a chat completion as TRL passes it: [{"role": "assistant", ...}]
        "grpo.reward_funcs": ("answer", "length=3", "trl.rewards:think_format_reward"),
        "grpo.reward_weights": (1.0, 0.5, 1.0),
        "grpo.eval_prompts": 4,  # a rollout's 4 rows: one compiled sampler
    }  # fmt: skip
    lines = tiny_run(llama_recipe(model), data, tmp_path / "run", **over)
    steps = [x for x in lines if "reward" in x]
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6) and steps[1]["kl"] > 0
    assert all(np.isfinite(x["loss"]) for x in steps)
    assert all(k in steps[0] for k in ("rewards/answer/mean", "rewards/length/std"))
    assert [x["step"] for x in lines if "val_reward" in x] == [0, 2]


def test_lora_rollouts_decode_the_merged_weights(tmp_path, llama_prompts, monkeypatch):
    """LoRA over a float32 base (grpo.merge_lora's default): the engine's rollouts decode the base with
    the adapters merged (train.policy's merge, once a rollout; no adapter product a decoded token),
    and the run's completions, rewards and losses are the unmerged run's (float32: 1e-5); bfloat16 and
    int8 bases, or merge_lora=False, decode unmerged (test_grpo_rollout: grpo_rollout.merged)."""
    from flaxgpt.models import lora

    model, data = llama_prompts
    over = {
        "lora.rank": 4, "lora.alpha": 8.0, "grpo.num_generations": 2, "batch_size": 4, "max_iters": 2,
        "eval_interval": 2, "grpo.eval_prompts": 0, "grpo.reward_funcs": ("length=3",),
        "optim.learning_rate": 3e-2,
    }  # fmt: skip
    unmerged_steps = []  # lora.step_fn: the adapters added to every product
    monkeypatch.setattr(lora, "step_fn", lambda *a, real=lora.step_fn: unmerged_steps.append(1) or real(*a))
    runs = []
    for merge in (True, False):
        over["grpo.merge_lora"] = merge
        lines = tiny_run(llama_recipe(model), data, tmp_path / f"m{merge}", **over)
        runs.append([x for x in lines if "reward" in x])
        assert bool(unmerged_steps) != merge
    (merged, unmerged), keys = runs, ("reward", "completions/mean_length", "loss")
    assert len(merged) == 2
    for a, b in zip(merged, unmerged, strict=True):
        assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], abs=1e-5)


@pytest.mark.devices(4)
def test_full_fine_tuning_with_beta_over_4_devices(tmp_path, llama_prompts):
    """Full fine-tuning with beta > 0, FSDP over 4 devices with the engine's rollouts over the same 4
    (the weights placed by SERVE_RULES for each rollout; before, a mesh of several devices failed at
    the first rollout): the reference is a copy of init_from's weights (the policy's start is donated
    to the train step), so the KL is 0 at the first step and > 0 after an update."""
    model, data = llama_prompts
    over = {
        "grpo.num_generations": 2, "batch_size": 4, "max_iters": 2, "eval_interval": 2, "grpo.beta": 0.04,
        "grpo.eval_prompts": 0, "grpo.reward_funcs": ("length=3",), "optim.learning_rate": 3e-2,
        "mesh.data": 1, "mesh.fsdp": 4, "mesh.cpu_devices": 4,
    }  # fmt: skip
    lines = tiny_run(llama_recipe(model), data, tmp_path / "run", devices=4, **over)
    steps = [x for x in lines if "reward" in x]
    assert [x["step"] for x in steps] == [1, 2]
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6) and steps[1]["kl"] > 0
    assert all(np.isfinite(x["loss"]) for x in steps)


def test_bad_grpo_settings_fail_in_one_line_and_write_nothing(tmp_path):
    d = toy_data(tmp_path)
    cases = {
        "grpo.num_generations=1: a group needs >= 2": {"grpo.num_generations": 1},
        "grpo.loss_type='ppo'; choose one of grpo,": {"grpo.loss_type": "ppo"},
        "reward 'oops': choose answer, format=REGEX": {"grpo.reward_funcs": ("oops",)},
        "reward no_such_module:f: cannot load it": {"grpo.reward_funcs": ("no_such_module:f",)},
        "reward length=ten: the length limit 'ten' is not an integer": {"grpo.reward_funcs": ("length=ten",)},
        "a prompt of 4 tokens: + grpo.max_completion_length 4 > model.block_size 6": {"model.block_size": 6},
        "must be multiples of grpo.num_generations 8": {"batch_size": 12},
        "grpo.beta=0.1 needs a reference": {"grpo.beta": 0.1},
        "grpo.rollout='vllm'; choose one of engine, generate": {"grpo.rollout": "vllm"},
    }
    for message, over in cases.items():
        with pytest.raises((ConfigError, ValueError)) as e:
            tiny_run(grpo_toy.get_config(), d, tmp_path / "never", **over)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert not (tmp_path / "never").exists()


@pytest.mark.devices(4)
def test_qlora_over_4_devices(tmp_path, llama_prompts):
    """LoRA over an int8 base, FSDP over 4 devices, the engine's rollouts over the same 4 (its copy of
    the base placed by SERVE_RULES): two steps train. Before, the engine's base aliased buffers of the
    trainer's (the int8 leaves placed alike), the train step donated them, and the next rollout
    crashed ("Buffer has been deleted or donated", then a segfault)."""
    model, data = llama_prompts
    over = {
        "lora.rank": 4, "lora.alpha": 8.0, "lora.base_dtype": "int8", "grpo.num_generations": 2,
        "batch_size": 4, "max_iters": 2, "eval_interval": 2, "grpo.eval_prompts": 0,
        "grpo.reward_funcs": ("length=3",), "mesh.data": 1, "mesh.fsdp": 4, "mesh.cpu_devices": 4,
    }  # fmt: skip
    lines = tiny_run(llama_recipe(model), data, tmp_path / "run", devices=4, **over)
    steps = [x for x in lines if "reward" in x]
    assert [x["step"] for x in steps] == [1, 2] and all(np.isfinite(x["loss"]) for x in steps)
    assert all(x["rollout_time"] > 0 for x in steps)


def test_qlora_engine_replicas_read_the_trainers_base(tmp_path, llama_prompts, monkeypatch):
    """grpo.engine_replicas=2 on one device with LoRA over an int8 base (decoded unmerged): each
    rollout's replicas read the base the trainer holds then, not a copy, across updates that donate
    the trainer's state: three steps train."""
    made = []

    def replicas(self, *args, real=grpo_rollout.Replicas.__init__):
        real(self, *args)
        made.append(self)

    monkeypatch.setattr(grpo_rollout.Replicas, "__init__", replicas)
    model, data = llama_prompts
    over = {
        "lora.rank": 4, "lora.alpha": 8.0, "lora.base_dtype": "int8", "grpo.num_generations": 2,
        "batch_size": 4, "max_iters": 3, "eval_interval": 3, "grpo.eval_prompts": 4,
        "grpo.reward_funcs": ("length=3",), "grpo.engine_replicas": 2,
    }  # fmt: skip
    lines = tiny_run(llama_recipe(model), data, tmp_path / "run", **over)
    steps = [x for x in lines if "reward" in x]
    assert [x["step"] for x in steps] == [1, 2, 3] and all(np.isfinite(x["loss"]) for x in steps)
    assert [x["step"] for x in lines if "val_reward" in x] == [0, 3]
    assert len(made) == 1 and made[0].bases == {}  # no copy of the base made
