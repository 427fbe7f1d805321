"""Two shipped tool environments: a calculator and a Python executor.

    Calculator()       # tool `calculator(expression)`: + - * / // % ** and parentheses over numbers
    PythonExecutor()   # tool `python(code)`: the code run by sandbox.run_python, its output returned

The calculator parses the expression (ast) and computes it node by node: nothing is evaluated as
Python, exponents and results are bounded (2 ** 10 ** 10 would take the trainer's memory), and a bad
expression is an "error: ..." observation the model reads. Both end an episode on a reply without a
call; the recipe's reward functions (e.g. `answer`) score that reply.
"""

from __future__ import annotations

import ast
import operator

from flaxgpt.envs import sandbox
from flaxgpt.envs.base import ToolEnvironment

MAX_CHARS, MAX_EXPONENT, MAX_MAGNITUDE = 200, 64, 1e60
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _tool(name: str, description: str, argument: str, about: str) -> dict:
    schema = {"type": "object", "properties": {argument: {"type": "string", "description": about}}}
    schema["required"] = [argument]
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


CALCULATOR = _tool(
    "calculator", "Evaluate an arithmetic expression exactly.", "expression",
    "numbers with + - * / // % ** and parentheses, e.g. (1234 * 5678) - 9",
)  # fmt: skip
PYTHON = _tool("python", "Run a Python program and return what it prints.", "code", "the program's source")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError saying what is wrong with it otherwise."""
    if not isinstance(expression, str) or len(expression) > MAX_CHARS:
        raise ValueError(f"the expression must be text of at most {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as arithmetic") from None
    return _value(tree.body)


def _value(node):
    """Every value, the numbers written included (1e999 reads as inf), within MAX_MAGNITUDE."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
            raise ValueError(f"exponents are limited to {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](a, b))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")


def _bounded(x):
    if isinstance(x, complex) or not abs(x) <= MAX_MAGNITUDE:  # NaN compares False too
        raise ValueError(f"numbers and results are limited to magnitude {MAX_MAGNITUDE:g}")
    return x


def _number(x) -> str:
    """An integer as itself, a float with up to 12 significant digits (no 0.30000000000000004)."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.12g}"


class Calculator(ToolEnvironment):
    tools = [CALCULATOR]
    max_turns = 4

    def __init__(self, family: str = "hermes", max_turns: int = 4):
        self.family, self.max_turns = family, max_turns

    def call(self, name: str, arguments: dict) -> str:
        return _number(evaluate(arguments.get("expression", "")))


class PythonExecutor(ToolEnvironment):
    tools = [PYTHON]
    max_turns = 4

    def __init__(self, family: str = "hermes", max_turns: int = 4, **limits):
        self.family, self.max_turns = family, max_turns
        self.limits = sandbox.Limits(**limits)  # cpu_s, wall_s, memory_mb, file_mb, output_chars

    def call(self, name: str, arguments: dict) -> str:
        return sandbox.run_python(str(arguments.get("code", "")), self.limits).observation()
