"""The ``calculate(expression)`` tool of the GSM8K tool recipe: arithmetic parsed with ``ast``, never ``eval``.

Only number literals, ``+ - * / // % **`` and unary signs are accepted; anything else (names, calls,
attributes) is refused with a message the model reads. Exponents and intermediate sizes are bounded so a
call cannot burn the CPU (``9**9**9``).
"""

from __future__ import annotations

import ast
import operator

from megatron_rl.rollout.tools import Tool, ToolSet, register_tool_set

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_MAGNITUDE = 10**30
_MAX_CHARS = 200


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
            raise ValueError("the result is out of range")
        return value
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ``ValueError`` (or ``ZeroDivisionError``) otherwise."""
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"the expression is longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression ({err.msg})") from err
    return _eval(tree.body)


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return f"{value:.10g}" if isinstance(value, float) else str(value)


class Calculator(Tool):
    name = "calculate"
    schema = {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression (numbers and + - * / // % ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (48 / 2) * 3"}},
                "required": ["expression"],
            },
        },
    }

    def call(self, args: dict, state: dict) -> tuple[str, float, bool]:
        expression = args.get("expression")
        if not isinstance(expression, str):
            return 'Error: calculate needs {"expression": "<arithmetic>"}', 0.0, False
        try:
            return format_number(evaluate(expression)), 0.0, False
        except (ValueError, ZeroDivisionError, OverflowError) as err:
            return f"Error: {err}", 0.0, False


register_tool_set("calculator", lambda: ToolSet({"calculate": Calculator()}))
