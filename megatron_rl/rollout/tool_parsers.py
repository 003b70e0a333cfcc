"""Tool-call parsers by name (``rollout.multi_turn.parser``): a model's turn text -> the calls it makes.

Each parser reads the format the model's chat template teaches. ``hermes`` is the Qwen2.5 / Qwen3 /
Hermes format: one ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block per call. A block
that is not valid JSON (or lacks a name) is still returned, as a call carrying an ``error``: the model
gets that error back as the tool's answer, which is how it learns the format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # set when the call could not be parsed; the tool is then not run


Parser = Callable[[str], list[ToolCall]]
PARSERS: dict[str, Parser] = {}
PARSER_END: dict[str, str] = {}  # the text that closes a call; a turn ends there when it is one token


def register_parser(name: str, fn: Parser, end: str | None = None) -> None:
    """Add a parser usable as ``rollout.multi_turn.parser=<name>``; a name is registered once. ``end``:
    the text closing a call (a turn ends at it when the tokenizer has it as a single token)."""
    if name in PARSERS:
        raise ValueError(f"tool-call parser '{name}' is already registered; pick another name")
    PARSERS[name] = fn
    if end:
        PARSER_END[name] = end


def get_parser(name: str) -> Parser:
    if name not in PARSERS:
        raise ValueError(f"rollout.multi_turn.parser='{name}' is not one of {sorted(PARSERS)}")
    return PARSERS[name]


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` block of ``text``, in order."""
    calls = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", error=f"tool call is not valid JSON ({err.msg}): {body.strip()[:200]}"))
            continue
        name = obj.get("name") if isinstance(obj, dict) else None
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(name, str) or not isinstance(args, dict):
            calls.append(
                ToolCall(str(name or ""), error='a tool call needs {"name": str, "arguments": {...}}')
            )
            continue
        calls.append(ToolCall(name, args))
    return calls


register_parser("hermes", parse_hermes, end="</tool_call>")
