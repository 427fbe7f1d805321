"""The docs' commands run: the README's quickstart end to end on a tiny scale, and every `python train.py`,
`python sample.py`, `python serve.py` and `flaxgpt ...` line of a ```bash block in README.md and docs/*.md
names a script or subcommand and flags that exist (config overrides: real config fields)."""

import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from tests import readme_extras
from tests.procs import xla_flags

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = ("train.py", "sample.py", "serve.py")
MAX_README_LINES = 250
OVERRIDES = {"summary", "attention-map"}  # they take model-config fields as --field=value too


def env():
    """A user's shell: not the device count the tests simulate (conftest), only the suite's compile
    flags (tests/procs.py); PYTHONPATH: this checkout's flaxgpt, not an installed one."""
    e = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    return dict(e, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())


def cli() -> list[str] | None:
    """The `flaxgpt` command of this checkout (an installed console script may be another's)."""
    return [sys.executable, "-m", "flaxgpt.cli"]


def bash_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every command in the text's ```bash blocks: continuation lines joined,
    `a && b`, `a; b` and `a | b` split, comments and leading environment assignments dropped."""
    out, block, start, joined = [], False, 0, ""
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            block = line.strip() == "```bash" and not block
            continue
        if not block:
            continue
        joined, start = (joined + " " + line.rstrip("\\").strip(), start or i)
        if line.rstrip().endswith("\\"):
            continue
        for part in re.split(r"&&|\|\||;|\|", joined):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:  # quotes across a split (a quoted shell snippet): not ours
                words = []
            while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):  # VAR=value cmd: the command
                words = words[1:]
            if words:
                out.append((start, shlex.join(words)))
        joined, start = "", 0
    return out


def ours(cmd: str) -> bool:
    return cmd.startswith(("flaxgpt ", "python benchmarks/", *(f"python {s}" for s in SCRIPTS)))


@functools.cache
def help_text(argv: tuple[str, ...]) -> str:
    r = subprocess.run([*argv, "--help"], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, f"{' '.join(argv)} --help failed:\n{r.stderr[-2000:]}"
    return r.stdout


def flags_of(text: str) -> set[str]:
    """The --flags an argparse help text lists (usage and options)."""
    return set(
        re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", text.split("\n\n")[0] + text.partition("options:")[2])
    )


def subcommands_of(text: str) -> set[str]:
    m = re.search(r"positional arguments:\n\s+\{([\w,-]+)\}", text)  # subparsers, not a flag's choices
    if m:
        return set(m.group(1).split(","))
    m = re.search(r"^commands:\n((?:  \S.*\n?)+)", text, re.M)  # the flaxgpt command's own table
    return {line.split()[0] for line in m.group(1).splitlines()} if m else set()


@functools.cache
def recipe(path: str):
    from flaxgpt.train.config_check import load_recipe

    return load_recipe(str(ROOT / path))


def check_train(words: list[str]) -> list[str]:
    errors, config = [], None
    for i, w in enumerate(words):
        if w == "--config" and i + 1 < len(words):
            config = words[i + 1]
        elif w.startswith("--config="):
            config = w.split("=", 1)[1]
    if config is None:
        config = "configs/shakespeare_char_cpu.py"  # train.py's default
    if not (ROOT / config.partition(":")[0]).is_file():
        return [f"no recipe {config}"]
    c = recipe(config)
    for w in words[2:]:
        if w.startswith("--config."):
            node = c
            for key in w[len("--config.") :].split("=", 1)[0].split("."):
                if key not in node:
                    errors.append(f"{w}: {key!r} is not a config field")
                    break
                node = node[key]
        elif w.startswith("-") and w not in ("--config",) and not w.startswith("--config="):
            errors.append(f"unknown flag {w}")
    return errors


def check_script(words: list[str]) -> list[str]:
    script = words[1]
    if script == "train.py":
        return check_train(words)
    if not (ROOT / script).is_file():
        return [f"no script {script}"]
    if "argparse" not in (ROOT / script).read_text():  # no flags at all (and --help would run it)
        return [f"{script} takes no flags, got {w}" for w in words[2:] if w.startswith("-")]
    known = flags_of(help_text((sys.executable, str(ROOT / script))))
    return [f"unknown flag {w}" for w in words[2:] if w.startswith("--") and w.split("=")[0] not in known]


def check_cli(words: list[str]) -> list[str]:
    """Errors of a `flaxgpt ...` line."""
    base, rest = cli(), words[1:]
    if not rest:
        return ["no subcommand"]
    if rest[0] not in subcommands_of(help_text(tuple(base))):
        return [f"no subcommand {rest[0]!r}"]
    argv = (*base, rest[0])
    text = help_text(argv)
    rest = rest[1:]
    subs = subcommands_of(text)
    if subs:  # hf export | info
        if not rest or rest[0] not in subs:
            return [f"{words[1]} needs one of {sorted(subs)}"]
        text, rest = help_text((*argv, rest[0])), rest[1:]
    known = flags_of(text)
    errors = []
    if words[1] == "aot":  # the recipe and its --config.key=value overrides, as train.py takes them
        i = rest.index("--config") if "--config" in rest else -1
        recipe_words = rest[i : i + 2] if i >= 0 else []
        recipe_words += [w for w in rest if w.startswith("--config.")]
        errors = check_train(["python", "train.py", *recipe_words])
        rest = [w for w in rest if not w.startswith("--config.")]
    if words[1] in OVERRIDES:
        from flaxgpt.models.gpt_config import GPTConfig
        from flaxgpt.models.seq2seq import TransformerConfig

        known |= {f"--{f.name}" for cls in (GPTConfig, TransformerConfig) for f in fields(cls)}
    return errors + [f"unknown flag {w}" for w in rest if w.startswith("--") and w.split("=")[0] not in known]


def all_commands():
    return [(p, n, c) for p in DOCS for n, c in bash_commands(p.read_text()) if ours(c)]


def test_readme_is_a_front_page():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines; at most {MAX_README_LINES}: move the rest to docs/"
    )


def test_every_documented_command_names_real_flags():
    commands = all_commands()
    assert len(commands) > 50, "the parser found too few commands: is the ```bash fence still used?"
    errors = []
    for path, line, cmd in commands:
        words = shlex.split(cmd)
        found = check_cli(words) if words[0] == "flaxgpt" else check_script(words)
        errors += [f"{path.relative_to(ROOT)}:{line}: {e}  ({cmd[:100]})" for e in found]
    assert not errors, "\n".join(errors)


def test_the_checker_catches_mistakes():
    assert check_train(
        ["python", "train.py", "--config", "configs/shakespeare_char_cpu.py", "--config.lerning_rate=1"]
    )
    assert check_train(["python", "train.py", "--config", "configs/nope.py"])
    assert not check_train(
        [
            "python",
            "train.py",
            "--config",
            "configs/shakespeare_char_cpu.py",
            "--config.optim.learning_rate=1",
        ]
    )
    assert check_script(["python", "sample.py", "--out_dir", "x", "--temprature", "0"])
    # a command after environment assignments is still checked
    assert bash_commands("```bash\nA=1 B=x python sample.py --top_k 5  # c\n```") == [
        (2, "python sample.py --top_k 5")
    ]
    assert not check_script(["python", "sample.py", "--out_dir", "x", "--temperature", "0"])
    assert check_cli(["flaxgpt", "prepare", "--datset", "x"]) == ["unknown flag --datset"]
    assert check_cli(["flaxgpt", "summary", "--preset", "gpt2", "--n_layer=2"]) == []
    aot = ["flaxgpt", "aot", "--config", "configs/grpo_toy.py", "--target", "cpu"]
    assert check_cli([*aot, "--config.grpo.beta=0.1"]) == []
    assert check_cli([*aot, "--config.grpo.betta=0.1"]) == [
        "--config.grpo.betta=0.1: 'betta' is not a config field"
    ]
    assert check_cli(["flaxgpt", "summary", "--preset", "gpt2", "--n_layers=2"]) == [
        "unknown flag --n_layers=2"
    ]


def quickstart() -> list[str]:
    """The commands of the first ```bash block under the README's "## Quickstart"."""
    section = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [c for _, c in bash_commands(f"```bash{block}```")]


def test_quickstart_runs_as_written(tmp_path):
    """The README's quickstart on a tiny scale: 10 steps instead of 2000, 20 new tokens instead of 300."""
    for name in ("configs", *SCRIPTS):
        (tmp_path / name).symlink_to(ROOT / name)
    commands = quickstart()
    assert [c.split()[:2] for c in commands] == [
        ["flaxgpt", "prepare"],
        ["python", "train.py"],
        ["python", "sample.py"],
    ]
    for cmd in commands:
        words = shlex.split(cmd)
        if words[0] == "flaxgpt":
            argv = [*cli(), *words[1:]]
        elif words[1] == "train.py":
            argv = [sys.executable, *words[1:], "--config.max_iters=10", "--config.eval_interval=5"]
            argv += ["--config.eval_iters=2", "--config.optim.warmup_steps=2"]
        else:
            argv = [sys.executable, *words[1:], "--max_new_tokens", "20"]
        r = subprocess.run(argv, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{cmd}\n{r.stderr[-3000:]}"
    assert (tmp_path / "data/shakespeare_char/meta.json").exists()
    assert r.stdout.count("ROMEO:") >= 3, r.stdout  # three samples, each starting with the prompt


def readme_lines_with_commands() -> list[tuple[int, str, list[str]]]:
    """(line number, raw line, its commands) of every line of the README's ```bash blocks that holds
    one of our commands (none of them continues over lines)."""
    text = (ROOT / "README.md").read_text()
    in_blocks = {n for n, _ in bash_commands(text)}
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        cmds = [c for _, c in bash_commands(f"```bash\n{line}\n```") if ours(c)]
        if cmds and n in in_blocks:
            out.append((n, line, cmds))
    return out


def test_every_readme_command_names_the_extras_it_needs():
    """A fresh venv per command is too slow for CI; instead each command's comment names exactly the
    extras flaxgpt.extras says it needs (`# [serve,hf] ...`), and the Install table says how to get each."""
    from flaxgpt import extras

    lines = readme_lines_with_commands()
    assert len(lines) > 10
    errors, used = [], set()
    for n, line, cmds in lines:
        need = {e for c in cmds for e in readme_extras.needed_by(c, str(ROOT))}
        m = re.search(r"#\s*\[([\w,-]+)\]", line)
        named = set(m.group(1).split(",")) if m else set()
        used |= need
        if named != need:
            errors.append(
                f"README.md:{n}: needs {sorted(need) or 'no extra'}, its comment names {sorted(named)}"
            )
    assert not errors, "\n".join(errors)
    assert {"serve", "hf", "tpu-aot"} <= used  # the checker sees them (the tour has all three)
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    for extra in extras.EXTRAS:
        assert f"`{extra}`" in install, f"the README's Install section does not name the {extra} extra"
        if extra in used:
            assert extras.install_command(extra) in install, extra


def test_the_extras_checker_catches_mistakes():

    assert readme_extras.needed_by("python serve.py --init_from gpt2", str(ROOT)) == ["serve", "hf"]
    assert readme_extras.needed_by("python train.py --config configs/finetune_shakespeare.py", str(ROOT)) == [
        "hf"
    ]
    assert (
        readme_extras.needed_by("python train.py --config configs/shakespeare_char_cpu.py", str(ROOT)) == []
    )


def test_the_model_option_table_is_gptconfigs_own():
    from flaxgpt.models import gpt_config
    from flaxgpt.models.gpt_config import GPTConfig

    text = (ROOT / "docs/training.md").read_text()
    start, end = (
        "<!-- options: generated by python -m flaxgpt.models.gpt_config -->\n",
        "\n<!-- end options -->",
    )
    assert start in text and end in text, "docs/training.md lost the option table's markers"
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == gpt_config.options_table(), (
        "run python -m flaxgpt.models.gpt_config into docs/training.md"
    )
    documented = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert documented == [f.name for f in fields(GPTConfig)]
    for name in ("pos_embedding", "activation", "norm", "rope_scaling", "attention_impl", "remat"):
        row = next(r for r in table.splitlines() if r.startswith(f"| `{name}` |"))
        for choice in choice_values(name):  # a new choice must reach the comment (and so the docs)
            assert re.search(rf"(?<![\w]){re.escape(choice)}(?![\w])", row), f"{name}: {choice} missing"


def choice_values(name: str) -> tuple[str, ...]:
    from flaxgpt.models import gpt_config

    return {
        "pos_embedding": ("learned", "sinusoidal", "rope"),
        "activation": gpt_config.ACTIVATIONS,
        "norm": gpt_config.NORMS,
        "rope_scaling": gpt_config.ROPE_SCALINGS,
        "attention_impl": gpt_config.ATTENTION_IMPLS,
        "remat": gpt_config.REMAT_POLICIES,
    }[name]


def test_every_guide_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{p.name}" not in readme]
    assert not missing, f"guides the README does not link: {missing}"


def test_serving_docs_curl_examples_fit_the_quickstart_model():
    """Every /v1/completions body in docs/serving.md is a valid request to the quickstart's model
    (Tiny Shakespeare characters, context 64): none gets the 400 a newcomer would (#55)."""
    import json

    from flaxgpt.data.tokenizers import CharTokenizer
    from flaxgpt.serve import openai_api

    text = (ROOT / "docs" / "serving.md").read_text()
    shakespeare = (ROOT / "flaxgpt" / "assets" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    tok = CharTokenizer(sorted(set(shakespeare)))
    bodies = re.findall(r"curl [^\n]*/v1/completions -H '[^']*' \\?\s*-d '([^']*)'", text)
    assert len(bodies) >= 4, bodies
    for body in bodies:
        req = json.loads(body)
        if "response_format" in req or "structured_outputs" in req:
            req = {k: v for k, v in req.items() if k not in ("response_format", "structured_outputs")}
        openai_api.parse_completion(req, model="m", tokenizer=tok, vocab_size=tok.vocab_size, max_len=64)
    for n in re.findall(r'model="shakespeare_char_cpu"[^\n]*max_tokens=(\d+)', text):
        assert len("ROMEO:") + int(n) <= 64


def test_the_readme_clone_is_not_taken_for_the_package(tmp_path):
    """A clone folder named `flaxgpt` shadows the installed package from its parent directory (an empty
    namespace package: `cannot import name 'GPT' from 'flaxgpt' (unknown location)`, #55). The
    README's clone folder has another name; the same layout named `flaxgpt` shows why."""
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if x.startswith("git clone"))
    folder = shlex.split(line.split("&&")[0])[-1]
    assert folder != "flaxgpt" and shlex.split(line.split("&&")[1].split("#")[0]) == ["cd", folder]
    probe = [sys.executable, "-c", "from flaxgpt import GPT"]
    clean = {k: v for k, v in env().items() if k != "PYTHONPATH"}  # the installed package, as a user has it
    for name, ok in ((folder, True), ("flaxgpt", False)):
        (tmp_path / name / "flaxgpt").mkdir(parents=True)  # the clone: the package folder inside
        (tmp_path / name / "README.md").write_text("")
        r = subprocess.run(probe, cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=120)
        if ok:
            assert r.returncode == 0, (name, r.stderr[-1000:])
        elif r.returncode:  # an editable install's finder (pip's default) is shadowed; a path entry is not
            assert "(unknown location)" in r.stderr, r.stderr[-1000:]
        (tmp_path / name / "flaxgpt").rmdir()
        (tmp_path / name / "README.md").unlink()
        (tmp_path / name).rmdir()
