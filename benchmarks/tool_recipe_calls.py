"""Tool file of ``benchmarks/gpu_tool_recipe.sh``: the recipe's calculator, called after every turn.

A random-weight model never writes a ``<tool_call>`` block, so with the recipe's ``hermes`` parser the run
would measure no tool call at all. The parser registered here (``every_turn_calculate``) turns every
stopped turn into one ``calculate`` call on the numbers the turn wrote (``1+1`` when it wrote none), so
the timed steps carry the multi-turn path: parse, pool, tool answer prefilled onto the slot, masks.
"""

import re

from megatron_rl.rollout.calculator import Calculator
from megatron_rl.rollout.tool_parsers import ToolCall, register_parser


def _every_turn(text: str) -> list[ToolCall]:
    numbers = re.findall(r"\d+", text)[:4]
    return [ToolCall("calculate", {"expression": "+".join(numbers) or "1+1"})]


register_parser("every_turn_calculate", _every_turn)


def get_tools():
    return [Calculator()]
