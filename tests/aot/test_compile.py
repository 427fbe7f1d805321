"""flaxgpt.aot on a tiny GPT recipe for a TPU v5e-8 (libtpu's abstract devices, no TPU): every program
compiles and is reported (memory, kernel, collectives, FLOPs); an FSDP mesh shows its all-gathers; bad
input is one line."""

import re

import pytest

from configs import default
from flaxgpt.aot import compile as aot
from flaxgpt.aot import report, targets

pytest.importorskip("libtpu", reason="the TPU targets need libtpu: pip install 'jax[tpu]==<jax version>'")


def tiny(**kw):
    c = default.get_config()
    c.data.dir = "/nonexistent"  # never read: the vocabulary is the recipe's
    c.model.vocab_size, c.model.pad_vocab_multiple = 256, 8
    c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size = 1, 2, 64, 32
    c.batch_size, c.grad_accum = 16, 2
    for k, v in kw.items():
        section, _, key = k.rpartition("__")
        (c[section] if section else c)[key] = v
    return c


def test_every_program_compiles_for_v5e_8_and_is_reported():
    target = targets.get("v5e-8")
    lines = []
    rows, mc = aot.run(tiny(), target, print_fn=lines.append)
    by = {r.program: r for r in rows}
    serve = ["serve.prefill", "serve.generate"]
    assert list(by) == ["train", "eval", "sample.prefill", "sample.decode", *serve]
    # a progress line as each program is compiled (#55: minutes of silence for a big model), its time
    assert lines[0].startswith("model: ") and len(lines) == 1 + len(rows)
    for line, r in zip(lines[1:], rows):
        assert line == f"compiled {r.program} in {r.compile_s:.1f} s"
    train = by["train"]
    assert train.devices == 8 and train.fits(0.1)
    # parameters replicated over the data-parallel mesh: each device holds all of them in float32
    n_params = sum(x.size for x in __import__("jax").tree.leaves(aot_params(mc)))
    assert train.parameters == 4 * n_params and train.optimizer >= 2 * train.parameters  # Adam mu, nu
    assert train.total >= train.arguments > train.parameters + train.optimizer
    assert train.kernel == "xla"
    assert "all-reduce" in train.collectives and "all-gather" not in train.collectives  # gradients summed
    assert train.flops >= train.model_flops > 0 and 0 < train.mfu_ceiling <= 1
    assert by["serve.generate"].devices == 1 and not by["serve.generate"].collectives
    for r in rows:
        assert r.total > 0 and r.compile_s > 0 and r.memory == target.memory
    text = report.table(rows, target)
    assert "serve.generate" in text and "all-reduce" in text
    assert by["serve.generate"].kernel == "xla"  # head_dim 32: the TPU paged kernel needs 128


def test_paged_serving_takes_the_tpu_paged_attention_kernel_at_head_dim_128():
    """And with --speculative_tokens the speculative step too: K + 1 positions a slot, through the xla
    paged path (more than one query a row), its FLOPs K + 1 decode steps'."""
    quiet = lambda *_: None  # noqa: E731
    rows, _ = aot.run(
        tiny(model__n_embd=256), targets.get("v5e-1"), ("serve",), print_fn=quiet, speculative_tokens=3
    )
    by = {r.program: r for r in rows}
    assert by["serve.generate"].kernel == "pallas paged (mosaic)"
    assert by["serve.speculate"].kernel == "xla" and by["serve.speculate"].fits(0.1)
    assert by["serve.speculate"].model_flops == by["serve.generate"].model_flops  # 8 x 4 positions each


def aot_params(mc):
    from flax import linen as nn

    from flaxgpt.models import gpt

    return nn.unbox(gpt.abstract_params(mc))


def test_an_fsdp_mesh_gathers_the_parameters():
    rows, mc = aot.run(tiny(mesh__fsdp=8), targets.get("v5e-8"), ("train",), print_fn=lambda *_: None)
    (train,) = rows
    count, nbytes = train.collectives["all-gather"]
    assert count > 0 and nbytes > 0
    n_params = sum(x.size for x in __import__("jax").tree.leaves(aot_params(mc)))
    assert train.parameters < 4 * n_params  # each device holds an eighth of every embed axis


def test_collectives_are_parsed_from_hlo_text():
    hlo = """
  %all-gather-start = (bf16[8,64]{1,0}, bf16[64,64]{1,0}) all-gather-start(bf16[8,64]{1,0} %p), dimensions={0}
  %all-gather-done = bf16[64,64]{1,0} all-gather-done(%all-gather-start)
  %all-reduce.1 = (f32[10]{0}, f32[2,3]{1,0}) all-reduce(f32[10]{0} %a, f32[2,3]{1,0} %b), to_apply=%add
  %cp = s32[4]{0} collective-permute(s32[4]{0} %x), source_target_pairs={{0,1}}
"""
    assert report.collectives(hlo) == {
        "all-gather": (1, 64 * 64 * 2),
        "all-reduce": (1, 40 + 24),
        "collective-permute": (1, 16),
    }
    assert report.attention_kernel('custom_call_target="__cudnn$fmhaSoftmax"') == "cudnn flash"
    assert report.attention_kernel("%d = f32[2] dot(%a, %b)") == "xla"
    assert (
        report.attention_kernel('custom_call_target="tpu_custom_call" paged_attention')
        == "pallas paged (mosaic)"
    )


def run_main(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        aot.main(list(argv))
    assert e.value.code not in (0, None)
    return str(e.value.code)


def test_bad_input_is_one_line(capsys, tmp_path):
    msg = run_main(capsys, "--config", "configs/shakespeare_char_cpu.py", "--target", "v9z-8")
    assert msg.startswith("error: unknown target 'v9z-8'") and "v5e-8" in msg and "\n" not in msg
    recipe = tmp_path / "r.py"
    recipe.write_text(
        "from configs import default\n"
        "def get_config():\n"
        "    c = default.get_config()\n"
        "    c.model.vocab_size, c.model.n_layer, c.model.n_embd, c.model.n_head = 256, 1, 96, 2\n"
        "    c.model.block_size, c.batch_size = 32, 48\n"
        "    return c\n"
    )
    msg = run_main(capsys, "--config", str(recipe), "--config.mesh.fsdp=3", "--target", "v5e-8")
    assert "mesh.data x mesh.fsdp must equal the 8 devices" in msg and "\n" not in msg
    msg = run_main(capsys, "--config", str(recipe), "--config.lerning_rate=1", "--target", "v5e-8")
    assert msg.startswith("error: unknown config key") and "\n" not in msg
    for flags, want in [  # (a reshape traceback, a false "does not fit", or silently accepted)
        (["--slots", "-3"], "error: --slots -3 must be >= 1"),
        (["--slots", "0"], "error: --slots 0 must be >= 1"),
        (["--max_len", "-5"], "error: --max_len -5 must be >= 0 (0: block_size)"),
        (["--speculative_tokens", "-1"], "error: --speculative_tokens -1 must be >= 0 (0: off)"),
    ]:
        msg = run_main(capsys, "--config", str(recipe), "--target", "cpu", "--programs", "serve", *flags)
        assert msg == want, msg


def test_a_missing_plugin_names_the_install_command(monkeypatch):
    from jax.experimental import topologies

    def missing(**_):
        raise RuntimeError("Unable to initialize backend 'tpu': no libtpu")

    monkeypatch.setattr(topologies, "get_topology_desc", missing)
    with pytest.raises(SystemExit) as e:
        targets.get("v5e-1").devices()
    assert 'pip install "jax[tpu]==' in str(e.value) and "\n" not in str(e.value)


def test_a_recipe_that_does_not_fit_exits_1_with_the_table(capsys, tmp_path):
    recipe = tmp_path / "big.py"  # [512, 256, 50304] float32 logits: 26 GB on one 16 GiB v5e
    recipe.write_text(  # with the logits made whole (the fused loss blocks them: 3.2 GB, it would fit)
        "from configs import default\n"
        "def get_config():\n"
        "    c = default.get_config()\n"
        "    c.model.vocab_size, c.model.n_layer, c.model.n_embd, c.model.n_head = 50257, 1, 64, 2\n"
        "    c.model.block_size, c.batch_size, c.optim.loss_impl = 256, 512, 'logits'\n"
        "    return c\n"
    )
    code = aot.main(["--config", str(recipe), "--target", "v5e-1", "--programs", "train"])
    out, err = capsys.readouterr()
    assert code == 1 and "train" in out and "NO" in out and "does not fit v5e-1" in err
    assert re.search(r"^compiled train in \d+\.\d s", out, re.M)  # the progress line, as it compiled


def test_recipes_name_their_targets():
    from pathlib import Path

    for path in sorted(Path("configs").glob("*.py")):
        names = targets.recipe_targets(str(path))
        assert names, path


def test_a_pod_slice_compiles_as_every_host_runs_it():
    target = targets.get("v5e-256")  # 256 devices on 64 hosts: one program, the same on every host
    rows, _ = aot.run(tiny(batch_size=256, grad_accum=1, mesh__fsdp=4), target, ("train",), print_fn=print)
    (train,) = rows
    assert train.devices == 256 and train.fits(0.1) and "all-gather" in train.collectives
    assert target.n_devices == 256 and target.hosts == 64


def test_every_tpu_target_has_its_devices_and_hosts():
    for t in targets.TARGETS.values():
        if t.platform == "tpu":
            devices = t.devices()
            assert len(devices) == t.n_devices, t.name
            assert len({d.process_index for d in devices}) == t.hosts, t.name
    assert targets.smallest(["v5e-8", "v5e-1", "h100-1"]).name == "v5e-1"


def test_decoding_programs_with_int8_weights_and_window_rings():
    """--quantize: the sample/serve programs over int8 weights (gpt.quantize_params on abstract arrays);
    a Gemma-like model's window layers decode over rings of their window."""
    target = targets.get("v5e-8")
    c = tiny(model__pos_embedding="rope", model__sliding_window=8, model__window_pattern=2, model__n_layer=2)
    c.model.scan_layers = False

    rows, mc = aot.run(c, target, ("sample", "serve"), quantize="int8", print_fn=lambda *_: None)
    int8 = {r.program: r for r in rows}
    assert {"sample.prefill", "sample.decode", "serve.prefill", "serve.generate"} <= set(int8)
    # float32 weights would be 4 bytes a parameter (the train test's figure): int8 is under half
    n_params = sum(x.size for x in __import__("jax").tree.leaves(aot_params(mc)))
    assert int8["serve.generate"].parameters < 4 * n_params / 2


def test_the_serve_command_runs_the_compiled_serving_programs():
    """flaxgpt aot --programs serve ends with the serve.py command of the same weights, dtype, slots,
    window, prefill chunk (128, as compiled), quantization and devices (--mesh N: --serve_devices N's)."""
    from flaxgpt.models.gpt import GPTConfig

    mc = GPTConfig(block_size=8192, param_dtype="bfloat16")
    c = tiny(init_from="path/to/Meta-Llama-3-8B")
    assert aot.serve_command(c, mc, slots=16, max_len=0, devices=8) == (
        "python serve.py --init_from path/to/Meta-Llama-3-8B --dtype bfloat16 --slots 16 --max_len 8192 "
        "--prefill_chunk 128 --mesh 8"
    )
    c = tiny(out_dir="out/run")  # trained from scratch: its run directory
    assert aot.serve_command(c, GPTConfig(block_size=1024), slots=8, max_len=4096, quantize="int8") == (
        "python serve.py --out_dir out/run --dtype float32 --slots 8 --max_len 1024 --prefill_chunk 128 "
        "--quantize int8"
    )


def test_a_kernel_that_does_not_lower_is_a_row_not_a_crash():
    """A Pallas kernel's refusal to lower (NotImplementedError / ValueError) is that program's row,
    "does not compile: ...", not fitting; the other programs' figures still print; other errors raise."""
    import types

    def program(error):
        def trace():
            raise error

        return types.SimpleNamespace(
            name="rollout.generate", devices=1, note="", state_bytes={}, model_flops=0.0, trace=trace
        )

    target = types.SimpleNamespace(memory=80e9)
    refusal = NotImplementedError("Mosaic kernels cannot be automatically partitioned.\nmore")
    row = report.analyze(program(refusal), target)
    assert (
        row.error
        == "does not compile: NotImplementedError: Mosaic kernels cannot be automatically partitioned."
    )
    assert not row.fits() and "NO: does not compile" in report.table([row], target)
    train = report.Row("train", 1, total=10, memory=80e9)
    budget = report.grpo_budget([train, row])  # nothing to add up: the refusal, not a made-up total
    assert (
        budget.error == row.error and budget.total == 0 and "rollout.generate does not compile" in budget.note
    )
    with pytest.raises(TypeError):
        report.analyze(program(TypeError("a bug")), target)


def test_serving_programs_alone_do_not_check_the_training_batch():
    """--programs serve over 8 devices with a recipe whose batch of 12 rows 8 devices cannot split:
    the training batch is the train / eval programs' (it was refused)."""
    from flaxgpt.aot import programs

    devices = targets.get("v5e-8").devices()
    c = tiny(batch_size=12, grad_accum=1)
    built = programs.build(c, devices, groups=("serve",), serve_devices=8)
    assert built and all(p.name.startswith("serve.") for p in built)
    with pytest.raises(ValueError, match="batch_size // grad_accum 12 is not divisible"):
        programs.build(c, devices, groups=("train",))
