"""Imports flow one way: no cycle among flaxgpt's modules, and every import (inside functions too)
within what its folder's "May import:" line allows; the allowed arrows themselves never run back up."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flaxgpt"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """flaxgpt modules that `path` imports anywhere (module level, functions, methods)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from flaxgpt.models import gpt` and `from flaxgpt.models.gpt import GPT` both import it
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:  # flaxgpt.models.gpt.GPT -> flaxgpt.models.gpt
                name = name.rpartition(".")[0]
            if name and not is_package(name):  # a package's __init__ runs first: not an edge of its own
                out.add(name)
    return out


def is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) - {module_name(p)} for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "grey"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "grey":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "black"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_is_read():
    graph = import_graph()
    assert (
        "flaxgpt.train.tasks" in graph["flaxgpt.train.trainer"]
        and "flaxgpt.models.gpt" in graph["flaxgpt.models.registry"]
    )
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_tasks_do_not_import_the_trainer():
    graph = import_graph()
    for task in (
        "flaxgpt.train.tasks",
        "flaxgpt.train.lm_task",
        "flaxgpt.train.seq2seq_task",
        "flaxgpt.tools.summary",
    ):
        assert "flaxgpt.train.trainer" not in graph[task], task


def _reaches(graph, start: str, prefix: str) -> list[str]:
    """Modules under `prefix` that `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return sorted(m for m in seen if m.startswith(prefix))


def test_decoders_import_no_model():
    graph = import_graph()
    for decoder in (
        "flaxgpt.decode.sampler",
        "flaxgpt.decode.logits",
        "flaxgpt.decode.sampling",
        "flaxgpt.decode.beam_search",
        "flaxgpt.decode.speculative",
    ):
        assert not _reaches(graph, decoder, "flaxgpt.models"), decoder


def test_the_http_layer_imports_no_model():
    graph = import_graph()
    http_layer = ("server", "openai_api", "scheduler", "grammar", "tools", "detokenize")
    for http in (f"flaxgpt.serve.{m}" for m in http_layer):
        assert not [m for m in graph[http] if m.startswith("flaxgpt.models")], http


def unit_of(module: str) -> str:
    """A folder (flaxgpt.hf) or a top-level module (flaxgpt.loader): what a "May import:" line covers."""
    return ".".join(module.split(".")[:2])


def allowed_imports(doc: str) -> set[str] | None:
    """The flaxgpt names in a docstring's "May import:" sentence (up to its first full stop); an empty
    set for "nothing of flaxgpt"; None when the docstring has no such line."""
    m = re.search(r"May import:(.*?)\.(?:\s|$)", doc, re.S)
    return None if m is None else set(re.findall(r"flaxgpt(?:\.\w+)+", m.group(1)))


def contracts() -> dict[str, set[str]]:
    """Each folder (its __init__.py) and top-level module -> the names it may import."""
    out = {}
    for path in [*PACKAGE.glob("*/__init__.py"), *PACKAGE.glob("*.py")]:
        if path == PACKAGE / "__init__.py":  # the owner table: names, imported by importlib on use
            continue
        allowed = allowed_imports(ast.get_docstring(ast.parse(path.read_text())) or "")
        assert allowed is not None, f"{path}: the docstring says what lives here and what it may import"
        out[unit_of(module_name(path))] = allowed
    return out


def outside(module: str, imported: str, allowed: set[str]) -> bool:
    """`module` importing `imported` breaks its unit's contract `allowed`."""
    if unit_of(imported) == unit_of(module):
        return False
    return not any(imported == name or imported.startswith(name + ".") for name in allowed)


def test_allowed_imports_are_parsed():
    assert allowed_imports("Models.\n\nMay import: nothing of flaxgpt.\n") == set()
    doc = "May import: flaxgpt.models, flaxgpt.data.chat (templates). Not flaxgpt.train.\n"
    assert allowed_imports(doc) == {"flaxgpt.models", "flaxgpt.data.chat"}
    assert allowed_imports("Tools.") is None
    assert outside("flaxgpt.serve.server", "flaxgpt.data.tokenizers", {"flaxgpt.data.chat"})
    assert not outside("flaxgpt.serve.server", "flaxgpt.data.chat", {"flaxgpt.data.chat"})
    assert not outside("flaxgpt.hf.gpt2", "flaxgpt.hf.files", set())


def test_every_import_is_one_its_folder_may_make():
    """Function-level imports count: an import hidden in a function to dodge a loop is a loop."""
    rules, graph = contracts(), import_graph()
    broken = [
        f"{module} imports {imported} (may import: {', '.join(sorted(rules[unit_of(module)])) or 'nothing'})"
        for module, imports in sorted(graph.items())
        if module != "flaxgpt"
        for imported in sorted(imports)
        if outside(module, imported, rules[unit_of(module)])
    ]
    assert not broken, "\n".join(broken)


def test_the_allowed_arrows_never_run_back_up():
    """The folders and top-level modules form layers: no cycle among the "May import:" lines."""
    rules = contracts()
    arrows = {unit: {unit_of(name) for name in allowed} - {unit} for unit, allowed in rules.items()}
    cycle = find_cycle(arrows)
    assert cycle is None, "the may-import lines allow a loop: " + " -> ".join(cycle)
    assert "flaxgpt.tools" not in arrows["flaxgpt.train"] and "flaxgpt.hf" not in arrows["flaxgpt.data"]


def test_every_module_reads_in_one_sitting():
    """A file per concept, readable in one sitting: no module of the package is over 500 lines."""
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, f"split these modules by concept: {long}"
