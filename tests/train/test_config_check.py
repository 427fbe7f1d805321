"""flaxgpt.train.config_check: every nonsense value of a run config, and every broken recipe file, is a
one-line error before anything is written or compiled."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flaxgpt.train import config_check
from flaxgpt.train.config_check import ConfigError

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "configs").glob("*.py") if p.name != "__init__.py")

BAD = {  # override -> what the message says
    "batch_size=0": ("batch_size", 0, "--config.batch_size=0 must be >= 1"),
    "grad_accum=0": ("grad_accum", 0, "--config.grad_accum=0 must be >= 1"),
    "eval_interval=0": ("eval_interval", 0, "--config.eval_interval=0 must be >= 1"),
    "log_interval=0": ("log_interval", 0, "--config.log_interval=0 must be >= 1"),
    "eval_iters=0": ("eval_iters", 0, "--config.eval_iters=0 must be >= 1"),
    "ckpt_interval=-1": ("ckpt_interval", -1, "--config.ckpt_interval=-1 must be >= 0"),
    "keep_checkpoints=0": ("keep_checkpoints", 0, "--config.keep_checkpoints=0 must be >= 1"),
    "max_iters=-3": ("max_iters", -3, "--config.max_iters=-3 must be >= 1"),
    "max_iters=0": ("max_iters", 0, "--config.max_iters=0 must be >= 1 (optimizer steps to train"),
    "negative lr": ("optim.learning_rate", -1e-3, "--config.optim.learning_rate=-0.001 must be > 0"),
    "nan lr": ("optim.learning_rate", float("nan"), "--config.optim.learning_rate=nan must be > 0"),
    # the cosine "decay" climbed from 1e-5 to the default min_lr 6e-5, silently
    "min_lr above lr": ("optim.learning_rate", 1e-5, "optim.min_lr 6e-05 is above optim.learning_rate 1e-05"),
    "beta2=1": ("optim.beta2", 1.0, "--config.optim.beta2=1.0 must be in [0, 1)"),
    "dropout 2.0": ("model.dropout", 2.0, "--config.model.dropout=2.0 must be in [0, 1)"),
    "attn_dropout 1.5": ("model.attn_dropout", 1.5, "--config.model.attn_dropout=1.5 must be in [0, 1)"),
    "dtype float99": ("model.dtype", "float99", "--config.model.dtype='float99' is not one of"),
    "param_dtype int8": ("model.param_dtype", "int8", "--config.model.param_dtype='int8' is not one of"),
    "activation": ("model.activation", "swish", "activation='swish' is not one of"),
    "heads": ("model.n_head", 5, "n_embd 768 is not divisible by n_head 5"),
    # sizes before the divisibility that divides by them (tracebacks: ZeroDivisionError, jax's TypeError)
    "no heads": ("model.n_head", 0, "n_head must be >= 1, got 0"),
    "no width": ("model.n_embd", 0, "n_embd must be >= 1, got 0"),
    "negative width": ("model.n_embd", -32, "n_embd must be >= 1, got -32"),
    "batch vs accum": ("grad_accum", 3, "batch_size 512 is not divisible by grad_accum 3"),
    "layout": ("model.sinusoid_layout", "cosines", "sinusoid_layout='cosines' is not one of"),
    "fsdp=0": ("mesh.fsdp", 0, "--config.mesh.fsdp=0 must be >= 1, or -1 for all devices left"),
    "loss_chunk=-1": ("optim.loss_chunk", -1, "--config.optim.loss_chunk=-1 must be >= 0"),
    "loss_impl": ("optim.loss_impl", "fast", "--config.optim.loss_impl='fast' is not one of logits, fused"),
    "loss_block=-1": ("optim.loss_block", -1, "--config.optim.loss_block=-1 must be >= 0"),
    "z_loss<0": ("optim.z_loss", -0.1, "--config.optim.z_loss=-0.1 must be >= 0 (the z-loss coefficient)"),
    # Muon's and the per-group rates: they trained (a rising loss, no orthogonalisation, NaN at step 2)
    "muon lr<0": ("optim.muon_learning_rate", -1.0, "--config.optim.muon_learning_rate=-1.0 must be > 0"),
    "muon momentum": ("optim.muon_momentum", 1.5, "--config.optim.muon_momentum=1.5 must be in [0, 1)"),
    "ns_steps=0": ("optim.muon_ns_steps", 0, "--config.optim.muon_ns_steps=0 must be >= 1"),
    "embed lr<0": ("optim.embed_learning_rate", -1.0, "--config.optim.embed_learning_rate=-1.0 must be >= 0"),
    "head lr nan": (
        "optim.head_learning_rate",
        float("nan"),
        "--config.optim.head_learning_rate=nan must be",
    ),
    "warmup past the decay": (
        "max_iters",
        5,
        "the cosine decay ends at max_iters (optim.decay_steps=0) = 5, not",
    ),
    # accepted silently before: a yarn stretch of learned positions, experts in float8 without fp8, and
    # float64 weights that jax made float32
    "yarn, learned": ("model.rope_scaling", "yarn", "rope_scaling='yarn' stretches rotary positions, and"),
    "fp8_experts": ("model.fp8_experts", True, "fp8_experts adds the routed experts to model.fp8's"),
    "float64, 32-bit jax": ("model.param_dtype", "float64", "needs 64-bit jax: run with JAX_ENABLE_X64=1"),
    "muon wd<0": ("optim.muon_weight_decay", -1.0, "--config.optim.muon_weight_decay=-1.0 must be >= 0"),
}


def recipe(name="default"):
    return config_check.load_recipe(str(ROOT / "configs" / f"{name}.py"))


def test_every_recipe_passes():
    for path in RECIPES:
        config_check.check(config_check.load_recipe(str(path)))


@pytest.mark.parametrize("case", sorted(BAD))
def test_nonsense_values_are_one_line_errors(case):
    key, value, message = BAD[case]
    c = recipe()
    *parents, leaf = key.split(".")
    node = c
    for part in parents:
        node = node[part]
    node[leaf] = value
    with pytest.raises(ConfigError) as e:
        config_check.check(c)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_defaulted_dropout_rates_and_seq2seq_section():
    c = recipe("reverse")
    config_check.check(c)
    c.seq2seq.beam_size = 0
    with pytest.raises(ConfigError, match="seq2seq.beam_size=0 must be >= 1"):
        config_check.check(c)
    c = recipe()
    c.model.attn_dropout = -1.0  # -1 = model.dropout
    config_check.check(c)
    with pytest.raises(ConfigError, match="not an ml_collections.ConfigDict"):
        config_check.check({"batch_size": 1})


BROKEN = {
    "syntax": ("def get_config(:\n", "syntax.py:1: invalid syntax"),
    "non-config": ("def get_config():\n    return 5\n", "returned a value of type int, not an"),
    "dict": ("def get_config():\n    return {'seed': 1}\n", "returned a value of type dict"),
    "no get_config": ("x = 1\n", "has no get_config()"),
    "raises": ("def get_config():\n    return 1 / 0\n", "get_config() failed (ZeroDivisionError"),
    "import": ("import no_such_module_xyz\n", "failed to load (ModuleNotFoundError"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_recipe_files(tmp_path, case):
    text, message = BROKEN[case]
    path = tmp_path / ("syntax.py" if case == "syntax" else "recipe.py")
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        config_check.load_recipe(str(path))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "unknown config key" not in str(e.value)
    with pytest.raises(ConfigError, match="not found"):
        config_check.load_recipe(str(tmp_path / "missing.py"))


def test_train_checks_before_writing_anything(tmp_path):
    from flaxgpt.train.trainer import train

    c = recipe()
    c.out_dir = str(tmp_path / "out")
    c.data.dir = str(tmp_path / "no_data")
    c.eval_interval = 0
    with pytest.raises(ConfigError, match="eval_interval=0"):
        train(c)
    assert not (tmp_path / "out").exists()


def test_train_cli_broken_recipe_is_one_line(tmp_path):
    (tmp_path / "bad.py").write_text("def get_config():\n    return None\n")
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)  # keep what is there
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    r = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"--config={tmp_path}/bad.py", "--config.seed=3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "NoneType" in lines[0], r.stderr[-2000:]


@pytest.mark.parametrize(
    "key, near",
    [
        ("learning_rate", "optim.learning_rate"),  # nanoGPT's flat spelling: the key's section
        ("optim.lerning_rate", "optim.learning_rate"),
        ("n_layr", "model.n_layer"),
        ("model.n_layr", "model.n_layer"),
        ("warmup_iters", "optim.warmup_steps"),
        ("zzzz", None),
    ],
)
def test_an_unknown_key_suggests_the_closest_across_sections(key, near):
    c = recipe("shakespeare_char_cpu")
    assert config_check.suggest_key(c, key) == near
    msg = config_check.unknown_override(c, [f"--config.{key}=1", "--config.max_iters=5"])
    assert msg.startswith(f"unknown config key {key!r}") and (near is None or f"did you mean {near}?" in msg)
    assert (
        config_check.unknown_override(c, ["--config.optim.learning_rate=1", "--config.model.rope_theta=5"])
        is None
    )


def test_architecture_overrides_pretrained_weights_would_replace_are_refused(tmp_path):
    """init_from a Hugging Face model: its checkpoint fixes the architecture, and --config.model.n_layer
    was silently dropped (flaxgpt aot then reported the full model); layout and run-time fields stay.
    A flaxgpt run likewise (its n_layer, n_embd, activation were dropped without a word), its own
    layout included."""
    c = recipe("finetune_llama")
    c.init_from = "mixtral-8x7b"  # a name the family table knows: pretrained, nothing read here
    msg = config_check.ignored_model_override(c, ["--config.model.n_layer=2", "--config.batch_size=8"])
    assert msg.startswith("--config.model.n_layer: init_from=mixtral-8x7b fixes the model's architecture")
    free = ["--config.model.block_size=512", "--config.model.dtype=bfloat16", "--config.model.remat=full"]
    assert config_check.ignored_model_override(c, free) is None
    c.init_from = "scratch"  # the recipe's own model: every field is the recipe's
    assert config_check.ignored_model_override(c, ["--config.model.n_layer=2"]) is None
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text("{}")
    c.init_from = str(tmp_path / "run")
    for flag in ("--config.model.activation=relu", "--config.model.block_size=512"):
        field = flag.split("=")[0].rpartition(".")[2]
        assert config_check.ignored_model_override(c, [flag]).startswith(
            f"--config.model.{field}: init_from="
        )
    assert config_check.ignored_model_override(c, ["--config.model.dtype=bfloat16"]) is None
    c.init_from = str(tmp_path / "no_such_run")  # a path that is not there: said so, not the override
    msg = config_check.ignored_model_override(c, ["--config.model.n_layer=2"])
    assert (
        msg
        == f"init_from={c.init_from} does not exist; give a run directory, Hugging Face weights, or scratch"
    )


def test_a_max_iters_that_cuts_the_schedule_short_is_noted():
    from flaxgpt.train.optim import make_schedule

    def note(**overrides):
        c = recipe("shakespeare_char_cpu_modern")  # wsd: warmup 20, decay 400, lr 2e-3
        c.unlock()
        for key, value in overrides.items():
            section, _, leaf = key.rpartition("__")
            (c[section] if section else c)[leaf] = value
        o = c.optim
        sched = make_schedule(o.schedule, o.learning_rate, o.warmup_steps, o.decay_steps or c.max_iters,
                              o.min_lr, o.cooldown_frac)  # fmt: skip
        return config_check.schedule_note(c, sched)

    assert note() is None  # the recipe as written: the schedule ends with the run
    msg = note(max_iters=50)
    assert msg.startswith(
        "note: max_iters 50 stops before the learning-rate decay ends (optim.decay_steps 400)"
    )
    assert "the last step's lr is 2.00e-03" in msg and msg.endswith(
        "--config.optim.decay_steps=50 fits it to the run"
    )
    msg = note(max_iters=10)  # inside the warmup: said first
    assert (
        msg.startswith("note: max_iters 10 ends inside the warmup (optim.warmup_steps 20)")
        and "\n" not in msg
    )
    assert note(max_iters=50, optim__decay_steps=0) is None


def test_every_recipe_resumes_by_running_its_command_again():
    """init_from=scratch refuses an out_dir with checkpoints, so a recipe that set it could not be rerun
    to resume as the README says (configs/grpo_toy.py, #55); auto starts fresh or resumes."""
    for path in RECIPES:
        assert config_check.load_recipe(str(path)).init_from != "scratch", path.name


def test_an_environment_may_score_alone():
    """grpo.env without reward_funcs passes (the environment scores alone); neither is one line."""
    c = recipe("grpo_calc")
    c.grpo.reward_funcs = ()
    config_check.check(c)
    c.grpo.env = ""
    with pytest.raises(ConfigError, match="reward_funcs is empty: name a reward, or an environment") as e:
        config_check.check(c)
    assert "\n" not in str(e.value)
