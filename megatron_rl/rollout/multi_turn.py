"""Multi-turn episodes: after each assistant turn, what the engine appends to the same KV-cache slot.

A turn ends at a stop token. Its text is parsed for tool calls (``tool_parsers``); the calls run on the
host (``ToolExecutor``, concurrently, with a timeout) and their answers, rendered by the chat template as
tool messages, become a prefill appended to the sequence. A turn without a tool call goes to the
``Interaction`` (which may answer as the user) or ends the episode. The episode also ends at
``max_turns`` assistant turns, when a tool or the interaction says done, or when what would be appended
does not leave room for one more generated token in the response budget (``rollout.max_new_tokens``).

Token-exact: the appended ids are the template's rendering of the *new* messages only; earlier turns are
never decoded and re-encoded, so the trained sequence is exactly what the model saw and produced. The
new messages' text is the template's rendering of ``[history + new] `` minus its rendering of
``[history]`` (a fixed placeholder history), plus whatever the template writes after an assistant
message's content that the model's stop token did not produce (Qwen's ``"\\n"`` after ``<|im_end|>``).

With generation TP > 1 the ranks of a generation group see the same tokens; the tools run on the group's
source rank and the decisions are broadcast, so every rank appends the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_rl.rollout.tool_parsers import PARSER_END, Parser, ToolCall
from megatron_rl.rollout.tools import ToolExecutor, ToolSet

_PLACEHOLDER = "\u2063turn\u2063"  # assistant content of the placeholder history (never in real text)
_HISTORY = [{"role": "user", "content": "\u2063"}, {"role": "assistant", "content": _PLACEHOLDER}]
_MAX_MEMO = 4096  # TurnRenderer.ids entries kept (cleared when full)


class TurnRenderer:
    """Token ids of new messages appended after an assistant turn, through the tokenizer's chat template."""

    def __init__(self, tokenizer, tool_schemas: list[dict] | None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "rollout.multi_turn.enable=true needs a tokenizer with a chat template (tool answers are "
                "rendered by it); use an instruct model's tokenizer"
            )
        self.tokenizer, self.tools = tokenizer, tool_schemas or None
        base = self._render(_HISTORY, False)
        at = base.rfind(_PLACEHOLDER)
        if at < 0:
            raise ValueError(
                "the tokenizer's chat template drops assistant content; it cannot be used for tools"
            )
        self.base, self.closing = base, base[at + len(_PLACEHOLDER) :]  # e.g. "<|im_end|>\n"
        self._ids: dict[tuple, tuple[int, ...]] = {}  # (messages, last_token) -> ids, see ``ids``

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        kw = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kw
        )

    def text(self, messages: list[dict], last_token: int | None) -> str:
        """The text appended after a turn that ended with ``last_token`` (None: no stop token)."""
        full = self._render(_HISTORY + messages, True)
        if not full.startswith(self.base):
            raise ValueError(
                "the chat template renders earlier messages differently once new ones follow; multi-turn "
                "rollouts need a template whose rendering of a conversation only grows"
            )
        closing = self.closing
        ended = self.tokenizer.decode([last_token]) if last_token is not None else ""
        if ended and closing.startswith(ended):
            closing = closing[len(ended) :]
        return closing + full[len(self.base) :]

    def ids(self, messages: list[dict], last_token: int | None) -> list[int]:
        """``text`` tokenized. Memoised: rendering a template and tokenizing cost ~0.2 ms, once per turn of
        every sequence, and tool answers repeat (a tiny task's few digits; an error text)."""
        try:
            key = (tuple(tuple(sorted(m.items())) for m in messages), last_token)
            ids = self._ids.get(key)
        except TypeError:  # a message with an unhashable value: render it every time
            return list(
                self.tokenizer(self.text(messages, last_token), add_special_tokens=False)["input_ids"]
            )
        if ids is None:
            if len(self._ids) >= _MAX_MEMO:
                self._ids.clear()
            text = self.text(messages, last_token)
            ids = self._ids[key] = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(ids)


@dataclass
class Episode:
    state: dict
    turns: int = 1  # assistant turns so far (the current one included)
    turn_start: int = 0  # response index where the current assistant turn starts
    reward: float = 0.0  # sum of the tools' / interaction's reward deltas
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0


@dataclass
class Decision:
    """What follows a turn: ``append`` ids (None: the episode ends, with ``finish_reason``)."""

    append: list[int] | None
    finish_reason: str = "stop"


@dataclass
class MultiTurn:
    """The run's multi-turn settings and tools; ``session`` starts one generate call's episodes."""

    tool_set: ToolSet
    parser: Parser
    renderer: TurnRenderer
    executor: ToolExecutor
    max_turns: int = 4
    max_tool_response_chars: int = 1000
    decode: object = None  # ids -> text (the tokenizer's decode, special tokens skipped)
    turn_stop_ids: tuple[int, ...] = ()  # tokens that end a turn besides the stop ids (a tool call's end)

    def session(self, states: list[dict]) -> Session:
        return Session(self, states)

    def close(self) -> None:
        self.executor.close()


@dataclass
class Session:
    """The episodes of one generate call; ``states[i]`` seeds the state of every sample of prompt ``i``."""

    mt: MultiTurn
    states: list[dict]
    episodes: dict[tuple[int, int], Episode] = field(default_factory=dict)

    @property
    def turn_stop_ids(self) -> tuple[int, ...]:
        return self.mt.turn_stop_ids

    def episode(self, seq) -> Episode:
        key = (seq.prompt_index, seq.sample_index)
        if key not in self.episodes:
            base = self.states[seq.prompt_index] if self.states else {}
            self.episodes[key] = Episode({**base, "turn": 1})
        return self.episodes[key]

    def after_turns(self, items: list[tuple], group=None, src: int = 0) -> list[Decision]:
        """``items``: ``(seq, response ids so far, stopped, room)`` per sequence whose turn ended
        (``room``: response tokens left). Runs on the source rank of ``group`` and is broadcast."""
        decisions: list = [None]
        if group is None or dist.get_rank() == src:
            decisions = [self._decide(items)]
        if group is not None and dist.get_world_size(group) > 1:
            dist.broadcast_object_list(decisions, src=src, group=group)
        out, episodes = decisions[0]
        for (seq, *_), ep in zip(items, episodes):  # keep the counts on every rank of the group
            self.episodes[seq.prompt_index, seq.sample_index] = ep
        return out

    def _decide(self, items: list[tuple]) -> tuple[list[Decision], list[Episode]]:
        mt = self.mt
        texts, calls_of = [], []
        for seq, response, stopped, _ in items:
            ep = self.episode(seq)
            texts.append(mt.decode(response[ep.turn_start :]))
            calls_of.append(mt.parser(texts[-1]) if stopped and ep.turns < mt.max_turns else [])
        flat: list[tuple[ToolCall, dict]] = [
            (c, self.episode(s).state) for (s, *_), cs in zip(items, calls_of) for c in cs
        ]
        results = iter(mt.executor.run(flat))
        out = []
        for (seq, response, stopped, room), text, calls in zip(items, texts, calls_of):
            ep = self.episode(seq)
            messages, done = [], not stopped or ep.turns >= mt.max_turns
            for r in (next(results) for _ in calls):
                ep.tool_calls += 1
                ep.tool_errors += r.status == "error"
                ep.tool_timeouts += r.status == "timeout"
                ep.reward += r.reward
                done = done or r.done
                messages.append({"role": "tool", "content": r.text[: mt.max_tool_response_chars]})
            if not calls and not done and mt.tool_set.interaction is not None:
                user, reward, done = mt.tool_set.interaction.respond(text, ep.state)
                ep.reward += float(reward)
                if user is not None and not done:
                    messages.append({"role": "user", "content": str(user)})
            if done or not messages:
                out.append(Decision(None, "stop" if stopped else "length"))
                continue
            ids = mt.renderer.ids(messages, response[-1])
            if len(ids) + 1 > room:  # no room for the answer to what would be appended
                out.append(Decision(None, "length"))
                continue
            ep.turns += 1
            ep.state["turn"] = ep.turns
            ep.turn_start = len(response) + len(ids)
            out.append(Decision(ids))
        return out, [self.episode(s) for s, *_ in items]


def build_multi_turn(cfg, tokenizer) -> MultiTurn | None:
    """``rollout.multi_turn`` (a ``MultiTurnConfig``) -> the run's ``MultiTurn``, or None when disabled.
    The tool file is imported first, so a parser it registers can be named in ``parser``."""
    if not cfg.enable:
        return None
    from megatron_rl.rollout import calculator  # noqa: F401  (registers the built-in tool set)
    from megatron_rl.rollout.tool_parsers import get_parser
    from megatron_rl.rollout.tools import load_tool_set

    tool_set = load_tool_set(cfg.tool_path)
    return MultiTurn(
        tool_set=tool_set,
        parser=get_parser(cfg.parser),
        renderer=TurnRenderer(tokenizer, tool_set.schemas),
        executor=ToolExecutor(tool_set.tools, cfg.tool_timeout_s, cfg.max_parallel_calls),
        max_turns=cfg.max_turns,
        max_tool_response_chars=cfg.max_tool_response_chars,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        turn_stop_ids=_single_token(tokenizer, PARSER_END.get(cfg.parser)),
    )


def _single_token(tokenizer, text: str | None) -> tuple[int, ...]:
    """The id of ``text`` when the tokenizer has it as one token (Qwen's ``</tool_call>``), else ()."""
    if not text:
        return ()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tuple(ids) if len(ids) == 1 else ()


def episode_state(row) -> dict:
    """The state an episode starts from: the prompt row's reward fields (tools may read them)."""
    return {"data_source": row.data_source, "ground_truth": row.ground_truth, "extra_info": row.extra_info}
