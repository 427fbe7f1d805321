"""Module docstrings say what their module defines and imports, as the import contract says what it may
import (tests/test_imports.py). Every module of flaxgpt has a docstring, read with ast (nothing is
imported), and every reference to flaxgpt code in it resolves:

- a path of the repository (`train/steps.py`, `flaxgpt/models/lora.py`, `csrc/qmatmul.cc`, `docs/aot.md`)
  exists, beside the module, in the package or at the top;
- a dotted name whose first part is `flaxgpt`, a flaxgpt module (`summary`, `tools.summary`, or as
  flaxgpt's imports spell it: `models` for models.registry) or a flaxgpt class (`Engine`) names a module,
  then a name that module itself defines (a def, a class or an assignment: an imported name is referred
  to at its owner), then a member of that class (a method, a field, an attribute set on self);
- a function its examples call bare (`state, metrics = train_step(state, batch)`) is one the module
  defines or imports, or the example imports.

Names of other libraries (`jax.lax.top_k`, `optax.adamw`) start with no flaxgpt name and are not checked;
nor are names an example binds (`steps = make_steps(...)`, then `steps.train_step`), strings in double
quotes (a logger's "flaxgpt.serve.access") or example lines that are not Python (`step(tokens) -> logits`).
"""

import ast
import builtins
import re
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flaxgpt"
ROOT = PACKAGE.parent
# A recipe's sections: `data.format`, `lora.rank` and `optim.name` are config fields, not code, though
# flaxgpt.data, models/lora.py and train/optim.py exist; one is checked only past a module's name
# (`data.batches.ParallelData`).
CONFIG_SECTIONS = {"config", "model", "data", "optim", "lora", "dpo", "grpo", "mesh", "seq2seq", "eval"}
# A path under these is a user's dataset or run (data/shakespeare_char/meta.json, out/run/metrics.png),
# unless it names source (data/batches.py).
USER_FOLDERS = {"data", "out"}
SOURCE_SUFFIXES = ("py", "md", "cc", "toml")
FILE_SUFFIXES = (*SOURCE_SUFFIXES, *"json jsonl txt tiktoken png bin npy lock en de".split())  # train.en

PATH = re.compile(
    r"(?<![\w/.<$~-])((?:[\w.-]+/)+(?:[\w.-]+\.(?:" + "|".join(FILE_SUFFIXES) + r"))?)(?![\w/<])"
)
DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
QUOTED = re.compile(r'"[^"\n]*"')


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class Module:
    """What one module defines (top level, and each class's members) and the names its imports bind."""

    def __init__(self, path: Path, doc: str | None = None):
        self.path, self.name = path, module_name(path)
        self.tree = ast.parse(path.read_text())
        self.doc = ast.get_docstring(self.tree) if doc is None else doc
        self.defined: set[str] = set()
        self.members: dict[str, set[str]] = {}
        self._read_body(self.tree.body)
        self.imports = [  # (the name bound here, the dotted name it stands for)
            bound_by(node, a)
            for node in ast.walk(self.tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for a in node.names
        ]
        self.imported = {local for local, _ in self.imports}

    def _read_body(self, body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.defined.add(node.name)
            elif isinstance(node, ast.ClassDef):
                self.defined.add(node.name)
                self.members[node.name] = class_members(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                if self.name == "flaxgpt" and isinstance(node.value, ast.Dict):  # the owner table (PEP 562)
                    self.defined |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            elif isinstance(node, (ast.If, ast.Try, ast.With)):  # definitions under `if`, `try`, `with`
                for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                    self._read_body(block)
                for handler in getattr(node, "handlers", []):
                    self._read_body(handler.body)


def bound_by(node: ast.Import | ast.ImportFrom, alias: ast.alias) -> tuple[str, str]:
    """(the name an import binds, the dotted name it stands for): `import a.b` binds a, `import a.b as
    c` binds c to a.b, `from a import b as c` c to a.b."""
    if isinstance(node, ast.ImportFrom):
        return alias.asname or alias.name, f"{'.' * node.level}{node.module or ''}.{alias.name}"
    if alias.asname:
        return alias.asname, alias.name
    return alias.name.split(".")[0], alias.name.split(".")[0]


def class_members(node: ast.ClassDef) -> set[str]:
    out = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    for sub in ast.walk(node):  # self.x = ... in any method
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
            if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                out.add(sub.attr)
    return out


@cache
def modules() -> dict[str, Module]:
    return {module_name(p): Module(p) for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def aliases() -> dict[str, set[str]]:
    """A name flaxgpt's imports give a module (`models` for flaxgpt.models.registry) -> those modules."""
    out: dict[str, set[str]] = {}
    for m in modules().values():
        for local, dotted in m.imports:
            if dotted in modules() and local != dotted.rpartition(".")[2]:
                out.setdefault(local, set()).add(dotted)
    return out


@cache
def classes() -> dict[str, list[set[str]]]:
    """Class name -> the members of each flaxgpt class of that name."""
    out: dict[str, list[set[str]]] = {}
    for m in modules().values():
        for name, members in m.members.items():
            out.setdefault(name, []).append(members)
    return out


def resolve_in(module: Module, rest: list[str]) -> bool:
    """`rest` (after the module's name) names something `module` defines: a submodule, a top-level
    name, then a member of that class; or a member of one of its classes (`cache.take_rows`)."""
    if not rest:
        return True
    head = rest[0]
    if f"{module.name}.{head}" in modules():
        return resolve_in(modules()[f"{module.name}.{head}"], rest[1:])
    if head in module.defined:
        if len(rest) == 1 or head not in module.members:
            return True  # a function's or an instance's attributes are not checked
        return rest[1] in module.members[head]
    return len(rest) == 1 and any(head in members for members in module.members.values())


def owners(prefix: str) -> list[Module]:
    """The flaxgpt modules a dotted prefix names: the full name, the tail of one (`tools.summary`), or
    an import's alias (`models`)."""
    names = {n for n in modules() if n == prefix or n.endswith("." + prefix)} | aliases().get(prefix, set())
    return [modules()[n] for n in sorted(names)]


def dotted_problem(ref: str) -> str | None:
    """Why a dotted name that starts like flaxgpt code does not resolve; None when it does or is not
    flaxgpt's."""
    parts = ref.split(".")
    if parts[-1] in FILE_SUFFIXES:  # a file: model.safetensors, config.json
        return None
    for k in range(len(parts), 0, -1):
        found = owners(".".join(parts[:k]))
        if not found:
            continue
        if any(resolve_in(m, parts[k:]) for m in found) or (k == 1 and parts[0] in CONFIG_SECTIONS):
            return None
        return f"{ref}: {'.'.join(parts[k:])} is not defined in {', '.join(m.name for m in found)}"
    if parts[0] in classes() and not any(parts[1] in members for members in classes()[parts[0]]):
        return f"{ref}: class {parts[0]} has no member {parts[1]}"
    return None


def path_problem(module: Module, ref: str) -> str | None:
    first, suffix = ref.split("/")[0], ref.rpartition(".")[2]
    bases = (module.path.parent, PACKAGE, ROOT)
    if (
        first in USER_FOLDERS or not any((b / first).is_dir() for b in bases)
    ) and suffix not in SOURCE_SUFFIXES:
        return None  # a user's file, not the repository's
    if any((b / ref).exists() for b in bases):
        return None
    return f"{ref}: no such file"


def examples(doc: str) -> list[ast.AST]:
    """The docstring's indented lines that are Python (a statement may run over a few lines)."""
    lines = [line.strip() for line in doc.splitlines() if line.startswith("    ")]
    out, i = [], 0
    while i < len(lines):
        for j in range(i + 1, min(i + 5, len(lines)) + 1):
            try:
                out.append(ast.parse("\n".join(lines[i:j])))
                i = j
                break
            except SyntaxError:
                continue
        else:
            i += 1
    return out


def problems(module: Module) -> list[str]:
    doc = module.doc
    if not doc:
        return ["no module docstring"]
    out = [path_problem(module, ref) for ref in PATH.findall(doc)]
    code = examples(doc)
    bound = {
        name
        for tree in code
        for node in ast.walk(tree)
        for name in (
            [node.id]
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
            else [a.asname or a.name for a in node.names]
            if isinstance(node, (ast.Import, ast.ImportFrom))
            else []
        )
    }
    text = QUOTED.sub(" ", PATH.sub(" ", doc))
    out += [dotted_problem(ref) for ref in DOTTED.findall(text) if ref.split(".")[0] not in bound]
    known = module.defined | module.imported | bound | set(dir(builtins))
    for tree in code:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in known:
                out.append(f"{node.func.id}(...) in an example: {module.name} neither defines nor imports it")
    return [p for p in out if p]


def test_the_rule_reads_references():
    summary, trainer = modules()["flaxgpt.tools.summary"], modules()["flaxgpt.train.trainer"]
    assert "flops_per_token" in summary.imported and "flops_per_token" not in summary.defined
    assert dotted_problem("flaxgpt.tools.summary.flops_per_token")  # imported there, owned by models.flops
    assert dotted_problem("flaxgpt.models.flops.flops_per_token") is None
    assert dotted_problem("tools.summary.summarize") is None and dotted_problem("summary.summarize") is None
    assert dotted_problem("models.config_from") is None  # `from flaxgpt.models import registry as models`
    assert (
        dotted_problem("runs.run_dir.check_resume") is None and dotted_problem("Trainer.init_state") is None
    )
    assert dotted_problem("Trainer.no_such_method") and dotted_problem("flaxgpt.train.no_such_module")
    assert dotted_problem("jax.lax.top_k") is None and dotted_problem("optax.adamw") is None
    assert dotted_problem("lora.rank") is None and dotted_problem("data.batches.ParallelData") is None
    assert dotted_problem("data.batches.NoSuchData") and dotted_problem("lora.no_such_function") is None
    assert dotted_problem("flaxgpt.load") is None and dotted_problem("flaxgpt.no_such_name")
    assert path_problem(trainer, "train/steps.py") is None and path_problem(trainer, "train/stepz.py")
    assert path_problem(trainer, "flaxgpt/models/lora.py") is None and path_problem(trainer, "docs/nope.md")
    assert path_problem(trainer, "data/shakespeare_char/meta.json") is None  # a user's dataset
    assert path_problem(modules()["flaxgpt.kernels.qmatmul"], "csrc/qmatmul.cc") is None


def test_the_rule_catches_the_trainers_old_docstring():
    """train/trainer.py's docstring once showed the train step and counted FLOPs with tools.summary,
    after both had moved (to train/steps.py and models/flops.py)."""
    old = """The training loop: TrainState, the loss, the sharded train step, evaluation and logging.

    state, metrics = train_step(state, batch)   # pure, jitted once, state donated

MFU counts FLOPs with flaxgpt.tools.summary.flops_per_token, as `summary` prints them."""
    found = problems(Module(modules()["flaxgpt.train.trainer"].path, doc=old))
    assert len(found) == 2 and "train_step(...)" in found[1] and "summary.flops_per_token" in found[0], found
    assert problems(Module(PACKAGE / "errors.py", doc="")) == ["no module docstring"]


def test_every_module_docstring_resolves():
    broken = [f"{m.path.relative_to(ROOT)}: {p}" for m in modules().values() for p in problems(m)]
    assert not broken, "\n".join(broken)
