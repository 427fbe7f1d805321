"""LoRA training on a tiny random Llama directory: configs/lora_llama.py end to end through train.py,
exact resume, checkpoints that hold only the adapters and their AdamW state, the exported adapter in
peft, an int8 (QLoRA-style) base, FSDP on 8 CPU devices equal to one device, and one-line errors."""

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import peft
import pytest
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the configs/ package

from configs import lora_llama  # noqa: E402
from flaxgpt import hf_cli, loader  # noqa: E402
from flaxgpt.data import prepare  # noqa: E402
from flaxgpt.models.cache import AdapterCache, KVCache  # noqa: E402
from flaxgpt.models.multi_lora import MultiLora  # noqa: E402
from flaxgpt.runs import checkpoint as ckpt_lib  # noqa: E402
from flaxgpt.train import trainer  # noqa: E402
from flaxgpt.train.config_check import ConfigError  # noqa: E402
from tests.hf.test_llama import TOKENS, flax_logits, make_hf_model, ref_logits  # noqa: E402
from tests.train.test_train_cli import ROOT, run  # noqa: E402

TEXT = "".join(f"the {i % 9} quick foxes jumped over {i % 4} lazy dogs.\n" for i in range(200))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    make_hf_model("llama", root / "llama")
    prepare.prepare_text(TEXT, root / "data", "char", 0.1, "generated")
    return root


def tiny(root, out, **over):
    c = lora_llama.get_config()
    c.init_from, c.data.dir, c.out_dir = str(root / "llama"), str(root / "data"), str(out)
    c.model.block_size, c.model.dtype, c.model.remat = 16, "float32", "none"
    c.batch_size, c.grad_accum, c.max_iters, c.eval_interval, c.eval_iters = 4, 1, 6, 3, 1
    c.log_interval, c.ckpt_interval, c.tensorboard, c.plot = 1, 3, False, False
    c.lora.rank, c.lora.base_dtype = 4, "float32"
    c.optim.learning_rate, c.optim.warmup_steps, c.optim.schedule = 1e-2, 0, "constant"  # resumable
    c.mesh.cpu_devices = 0
    for key, value in over.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def quiet_train(config, devices=None):
    return trainer.train(config, devices=devices, print_fn=lambda *a: None)


def losses(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_trains_resumes_exactly_and_checkpoints_only_the_adapters(dirs, tmp_path):
    one = quiet_train(tiny(dirs, tmp_path / "one"), jax.devices()[:1])
    seen = losses(tmp_path / "one")
    assert seen[-1] < seen[0] - 0.3, seen
    # the run stopped after step 3: its checkpoint of step 6 gone; the same command resumes at 3
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "6")
    two = quiet_train(tiny(dirs, tmp_path / "two"), jax.devices()[:1])
    logged = [json.loads(line)["step"] for line in (tmp_path / "two" / "metrics.jsonl").open()]
    # it resumed: no second evaluation at step 0; steps 4-6 logged once (the first run's rows past its
    # checkpoint leave metrics.jsonl), so the steps never go back
    assert logged.count(0) == 1 and logged.count(4) == 1 and logged == sorted(logged), logged
    for a, b in zip(
        jax.tree_util.tree_leaves(one["state"].params), jax.tree_util.tree_leaves(two["state"].params)
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt = ckpt_lib.Checkpointer(tmp_path / "one", read_only=True, async_save=False)
    names = ckpt.saved_shapes(6)
    ckpt.close()
    params = [n for n in names if n.startswith("params/")]
    assert params and all(n.split("/")[-1][-2:] in ("_a", "_b") for n in params), params
    assert not any("kernel" in n or "embedding" in n or "scale" in n for n in names), names
    adapter_values = sum(int(np.prod(s)) for n, (s, _) in names.items() if n.startswith("params/"))
    assert adapter_values == sum(x.size for x in jax.tree_util.tree_leaves(one["state"].params))


@pytest.mark.devices(2)
def test_int8_base_trains(dirs, tmp_path):
    quiet_train(tiny(dirs, tmp_path / "q", **{"lora.base_dtype": "int8", "mesh.fsdp": 2}), jax.devices()[:2])
    seen = losses(tmp_path / "q")
    assert np.all(np.isfinite(seen)) and seen[-1] < seen[0] - 0.3, seen


@pytest.mark.devices(8)
def test_fsdp_on_8_devices_equals_one_device(dirs, tmp_path):
    def steps(cfg, devices):
        t = trainer.Trainer(cfg, devices=devices, print_fn=lambda *a: None)
        state, out = t.init_state(), []
        for step in range(3):
            state, m = t.train_step(state, t.global_batch("train", step, cfg.batch_size, micro=True))
            out.append(float(m["loss"]))
        t.close()
        return np.array(out), state

    cfg = tiny(dirs, tmp_path / "x", **{"model.scan_layers": True})
    ref, _ = steps(cfg, jax.devices()[:1])
    cfg8 = tiny(
        dirs, tmp_path / "y", **{"model.scan_layers": True, "mesh.data": 2, "mesh.fsdp": 4, "batch_size": 8}
    )
    cfg1 = tiny(dirs, tmp_path / "z", **{"model.scan_layers": True, "batch_size": 8})
    got, state = steps(cfg8, jax.devices()[:8])
    want, _ = steps(cfg1, jax.devices()[:1])
    np.testing.assert_allclose(got, want, rtol=2e-5)
    assert ref[-1] < ref[0]
    kernel = state.frozen.base["h"]["block"]["mlp"]["c_fc"]["kernel"]  # [L, D, 2F]: split over fsdp
    assert kernel.sharding.spec != jax.sharding.PartitionSpec() and "fsdp" in str(kernel.sharding.spec)
    assert len({s.data.shape for s in kernel.addressable_shards}) == 1
    assert kernel.addressable_shards[0].data.size * 4 == kernel.size


@pytest.mark.devices(8)
def test_expert_adapters_train_on_an_expert_mesh_as_on_one_device(dirs, tmp_path):
    """A tiny Mixtral with adapters on q and both expert stacks: its experts split over mesh.expert 4
    (data 2) give one device's losses (the router's load-balancing loss included, which the
    adapters move), the loss falls, and the checkpoint holds the [E, ...] expert adapters."""
    from tests.hf.test_moe import make_hf_model as make_moe

    make_moe("mixtral", tmp_path / "mixtral")
    over = {"init_from": str(tmp_path / "mixtral"), "lora.targets": "q,experts_gate_up,experts_down"}
    over |= {"lora.dropout": 0.0, "batch_size": 8}  # PEFT has no dropout on expert stacks either

    def steps(devices, **mesh):
        cfg = tiny(dirs, tmp_path / "x", **over, **mesh)
        t = trainer.Trainer(cfg, devices=jax.devices()[:devices], print_fn=lambda *a: None)
        state, out = t.init_state(), []
        for step in range(3):
            state, m = t.train_step(state, t.global_batch("train", step, cfg.batch_size, micro=True))
            out.append((float(m["loss"]), float(m["router_aux"])))
        t.close()
        return np.array(out), state

    one, state = steps(1)
    eight, state8 = steps(8, **{"mesh.data": 2, "mesh.expert": 4})
    np.testing.assert_allclose(eight, one, rtol=2e-5)
    assert one[-1, 0] < one[0, 0] and np.all(one[:, 1] > 0), one
    adapters = state.params["h"]["block"]["mlp"]  # the recipe scans its layers: [L, E, ...]
    assert adapters["experts_gate_up_a"].shape == (2, 4, 32, 4) and adapters["experts_down_b"].shape == (
        2,
        4,
        4,
        32,
    )
    for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(state8.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_train_py_end_to_end_then_peft_loads_the_adapter(dirs, tmp_path, capsys):
    out, adapter = tmp_path / "run", tmp_path / "adapter"
    flags = [
        f"--config.init_from={dirs / 'llama'}",
        f"--config.data.dir={dirs / 'data'}",
        f"--config.out_dir={out}",
        "--config.model.block_size=16",
        "--config.model.dtype=float32",
        "--config.lora.base_dtype=float32",
        "--config.batch_size=4",
        "--config.grad_accum=1",
        "--config.max_iters=4",
        "--config.eval_interval=2",
        "--config.eval_iters=1",
        "--config.log_interval=1",
        "--config.optim.learning_rate=1e-2",
        "--config.optim.warmup_steps=0",
        "--config.tensorboard=False",
        "--config.plot=False",
    ]
    r = run([str(ROOT / "train.py"), f"--config={ROOT}/configs/lora_llama.py", *flags], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert hf_cli.peft_main(["export", "--out_dir", str(out), "--to", str(adapter)]) == 0
    # again into it: refused in one line naming the adapter's files and the flag that exists, then taken
    assert hf_cli.peft_main(["export", "--out_dir", str(out), "--to", str(adapter)]) == 1
    assert "pass --overwrite to replace its adapter_config.json and adapter_model" in capsys.readouterr().err
    again = ["export", "--out_dir", str(out), "--to", str(adapter), "--overwrite", "--step", "4"]
    assert hf_cli.peft_main(again) == 0
    lora_run = loader.load(str(out))  # what sample.py --out_dir loads: base + adapters merged
    base = transformers.AutoModelForCausalLM.from_pretrained(dirs / "llama")
    tokens = TOKENS[:, :16]  # the run's block_size
    want = ref_logits(peft.PeftModel.from_pretrained(base, adapter).eval(), tokens)
    assert np.abs(flax_logits(lora_run.config, lora_run.params, tokens) - want).max() < 1e-4
    plain = ref_logits(transformers.AutoModelForCausalLM.from_pretrained(dirs / "llama"), tokens)
    assert np.abs(want - plain).max() > 1e-3  # the adapters trained: not the base model
    # unmerged, as serve.py --adapter NAME=RUN serves the run: slot 1 of models.multi_lora's stack
    config, base = loader.load_pretrained(str(dirs / "llama"))
    spec, adapters = loader.load_adapter(str(out), config)
    multi = MultiLora(config, base, slots=2, rank=spec.rank)
    stack = multi.write(multi.empty_stack(), 1, multi.slot_weights(spec, adapters))
    cache = AdapterCache.wrap(KVCache.for_config(config, len(tokens), tokens.shape[1]), adapter=1)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    logits, _ = jax.jit(lambda s, t: multi.step_fn(s)(t, positions, cache))(stack, tokens)
    assert np.abs(np.asarray(logits) - want).max() < 1e-4


@pytest.mark.parametrize(
    "over, message",
    [
        ({"lora.rank": -1}, "lora.rank=-1 must be >= 0"),
        ({"lora.targets": "q,v,c_attn"}, "has no c_attn"),
        ({"lora.targets": "qkv"}, "has no qkv"),
        ({"init_from": "scratch"}, "adapts a pretrained model"),
        ({"lora.base_dtype": "int4"}, "base_dtype"),
    ],
)
def test_bad_lora_settings_fail_in_one_line_and_write_nothing(dirs, tmp_path, over, message):
    with pytest.raises((ConfigError, ValueError)) as e:
        quiet_train(tiny(dirs, tmp_path / "never", **over))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "never").exists()
