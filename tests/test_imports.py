"""Imports flow one way: no cycle among flaxgpt's modules, counting imports inside functions too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flaxgpt"


def module_name(path: Path) -> str:
    return "flaxgpt" if path.stem == "__init__" else f"flaxgpt.{path.stem}"


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """flaxgpt modules that `path` imports anywhere (module level, functions, methods)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from flaxgpt import gpt` imports flaxgpt.gpt; `from flaxgpt.gpt import GPT` flaxgpt.gpt
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:  # flaxgpt.gpt.GPT -> flaxgpt.gpt
                name = name.rpartition(".")[0]
            if name and name != "flaxgpt":  # a package's __init__ runs first: not an edge of its own
                out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.glob("*.py"))
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
    assert "flaxgpt.tasks" in graph["flaxgpt.trainer"] and "flaxgpt.gpt" in graph["flaxgpt.models"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_tasks_do_not_import_the_trainer():
    graph = import_graph()
    for task in ("flaxgpt.tasks", "flaxgpt.lm_task", "flaxgpt.seq2seq_task", "flaxgpt.summary"):
        assert "flaxgpt.trainer" not in graph[task], task
