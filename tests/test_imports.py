"""Imports flow one way: no cycle among flaxgpt's modules, counting imports inside functions too."""

import ast
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
    for decoder in ("flaxgpt.decode.sampling", "flaxgpt.decode.beam_search", "flaxgpt.decode.speculative"):
        assert not _reaches(graph, decoder, "flaxgpt.models"), decoder


def test_the_http_layer_imports_no_model():
    graph = import_graph()
    for http in ("flaxgpt.serve.server", "flaxgpt.serve.openai_api", "flaxgpt.serve.scheduler"):
        assert not [m for m in graph[http] if m.startswith("flaxgpt.models")], http


def test_every_folder_says_what_lives_there():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "may import" in doc.lower(), (
            f"{init}: the docstring says what lives here and what it may import"
        )
