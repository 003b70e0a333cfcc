"""Tools and environments of multi-turn rollouts, loaded from a user's Python file, and the pool that runs them.

A tool file (``rollout.multi_turn.tool_path``) defines ``get_tools() -> list[Tool]`` and may define
``get_interaction() -> Interaction``. The key may instead name a built-in tool set (``register_tool_set``).

- ``Tool``: ``name``, ``schema`` (the OpenAI function schema the chat template shows the model) and
  ``call(args, state) -> (text, reward_delta, done)``; ``state`` is the episode's dict (the prompt row's
  ``data_source`` / ``ground_truth`` / ``extra_info``, ``turn``; tools may keep their own keys in it).
- ``Interaction``: speaks as the user after a turn with no tool call:
  ``respond(turn_text, state) -> (user_text | None, reward_delta, done)``; without one, such a turn ends
  the episode.

``ToolExecutor`` runs a batch of calls concurrently on a bounded thread pool with a per-call timeout. A
tool that raises or runs past the timeout answers an error text instead, and is counted; it never stops
the run. (A timed-out call's thread cannot be killed: it keeps its worker until it returns. Workers are
daemon threads, so a call that never returns does not keep the process alive at exit.)
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config.user_code import import_user_file
from megatron_rl.rollout.tool_parsers import ToolCall

PATH_KEY = "rollout.multi_turn.tool_path"


class Tool:
    """Subclass and set ``name`` / ``schema``; ``call`` returns ``(text, reward_delta, done)``."""

    name: str = ""
    schema: dict = {}

    def call(self, args: dict, state: dict) -> tuple[str, float, bool]:
        raise NotImplementedError


class Interaction:
    """The user side of an episode: called after each assistant turn that made no tool call."""

    def respond(self, turn_text: str, state: dict) -> tuple[str | None, float, bool]:
        return None, 0.0, True


@dataclass
class ToolSet:
    tools: dict[str, Tool]
    interaction: Interaction | None = None

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]


TOOL_SETS: dict[str, Callable[[], ToolSet]] = {}


def register_tool_set(name: str, factory: Callable[[], ToolSet]) -> None:
    """A built-in tool set usable as ``rollout.multi_turn.tool_path=<name>``; a name is registered once."""
    if name in TOOL_SETS:
        raise ValueError(f"tool set '{name}' is already registered; pick another name")
    TOOL_SETS[name] = factory


def _check_tools(tools, where: str) -> dict[str, Tool]:
    if not isinstance(tools, (list, tuple)) or not tools:
        raise TypeError(f"{where}: get_tools() returned {tools!r}; return a non-empty list of Tool objects")
    by_name: dict[str, Tool] = {}
    for tool in tools:
        name, schema = getattr(tool, "name", None), getattr(tool, "schema", None)
        if not isinstance(name, str) or not name or not callable(getattr(tool, "call", None)):
            raise TypeError(
                f"{where}: {tool!r} needs a non-empty str `name` and a `call(args, state)` method"
            )
        if not isinstance(schema, dict) or schema.get("function", {}).get("name") != name:
            raise ValueError(
                f"{where}: tool '{name}' needs `schema` = {{'type': 'function', 'function': {{'name': '{name}', "
                "'description': ..., 'parameters': {...}}}}} (the chat template shows it to the model)"
            )
        if name in by_name:
            raise ValueError(f"{where}: two tools are named '{name}'; tool names must be unique")
        by_name[name] = tool
    return by_name


def load_tool_set(path_or_name: str | None) -> ToolSet:
    """The tools (and interaction) of a tool file, or of a built-in tool set by name."""
    if not path_or_name:
        raise ValueError(
            f"rollout.multi_turn.enable=true needs {PATH_KEY}: a .py file defining get_tools(), "
            f"or one of the built-in tool sets {sorted(TOOL_SETS)}"
        )
    if path_or_name in TOOL_SETS:
        return TOOL_SETS[path_or_name]()
    file = Path(path_or_name).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(
            f"{PATH_KEY}='{path_or_name}' is neither a file nor a built-in tool set {sorted(TOOL_SETS)}; "
            "set it to a .py file defining get_tools()"
        )
    module = import_user_file(file, PATH_KEY)
    where = f"{PATH_KEY}='{file}'"
    if not callable(getattr(module, "get_tools", None)):
        raise AttributeError(f"{where} defines no get_tools(); define get_tools() -> list[Tool]")
    interaction = module.get_interaction() if callable(getattr(module, "get_interaction", None)) else None
    if interaction is not None and not callable(getattr(interaction, "respond", None)):
        raise TypeError(f"{where}: get_interaction() returned {interaction!r}, which has no respond()")
    return ToolSet(_check_tools(module.get_tools(), where), interaction)


@dataclass
class ToolResult:
    text: str
    reward: float = 0.0
    done: bool = False
    status: str = "ok"  # ok | error (unparsable, unknown tool, raised, bad return) | timeout


@dataclass
class ToolExecutor:
    """Runs calls on ``max_workers`` threads; each may take ``timeout_s`` seconds from when it starts."""

    tools: dict[str, Tool]
    timeout_s: float = 10.0
    max_workers: int = 8

    def __post_init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for k in range(self.max_workers):
            threading.Thread(target=self._work, name=f"tool-{k}", daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as err:  # handed to the caller, who turns it into an error text
                fut.set_exception(err)

    def _submit(self, fn) -> Future:
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def _call(self, call: ToolCall, state: dict, started: dict, i: int) -> ToolResult:
        started[i] = time.monotonic()
        text, reward, done = self.tools[call.name].call(call.arguments, state)
        if not isinstance(text, str):
            raise TypeError(
                f"tool '{call.name}' returned text={text!r}; call() must return (str, float, bool)"
            )
        return ToolResult(text, float(reward), bool(done))

    def run(self, calls: list[tuple[ToolCall, dict]]) -> list[ToolResult]:
        """``(call, episode state)`` pairs -> one result each, in order; never raises for a tool's fault."""
        out: list[ToolResult | None] = [None] * len(calls)
        started: dict[int, float] = {}
        pending = {}
        for i, (call, state) in enumerate(calls):
            if call.error is not None or call.name not in self.tools:
                why = call.error or f"unknown tool {call.name!r}; the tools are {sorted(self.tools)}"
                out[i] = ToolResult(f"Error: {why}", status="error")
            else:
                pending[i] = self._submit(functools.partial(self._call, call, state, started, i))
        while pending:
            now = time.monotonic()
            for i, fut in list(pending.items()):
                name = calls[i][0].name
                if fut.done():
                    del pending[i]
                    try:
                        out[i] = fut.result()
                    except Exception as err:  # the tool's fault: the model reads it, the run goes on
                        out[i] = ToolResult(
                            f"Error: tool '{name}' raised {type(err).__name__}: {err}", status="error"
                        )
                elif i in started and now - started[i] > self.timeout_s:
                    del pending[i]
                    out[i] = ToolResult(
                        f"Error: tool '{name}' timed out after {self.timeout_s:g} s", status="timeout"
                    )
            if pending:
                time.sleep(0.002)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        for _ in range(self.max_workers):
            self._jobs.put(None)
