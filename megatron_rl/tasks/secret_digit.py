"""A built-in task that can only be solved by calling a tool: `megatron-rl train` with
``rollout.multi_turn.enable=true rollout.multi_turn.tool_path=secret_digit`` and no data or model.

Task ("secret digit"): the prompt is a few random digits; the answer is a digit derived from the prompt by
a hash, which only the ``secret`` tool returns. The call format is the smallest one possible for a tiny
char-level model: a turn that ends with ``?`` calls the tool (parser ``secret_call``, registered by ``register`` to
show the parser registry; real models use ``hermes``). The reward is 1 when the tool answered in this
response and the final turn starts with the digit it answered, else 0: no credit for calling alone, and
none for a right guess without a call. Validation prompts never occur in training (they end in an odd
digit, training prompts in an even one), so the hash cannot be memorised: a policy that never calls
scores 0, one that calls and then guesses 0.1 in expectation.
Everything is made in code, as for the built-in task: tokenizer, tiny model and parquet files. The
tokenizer's chat template is ChatML with one-letter role names and no newlines (a tool message renders as
``<|im_start|>t7<|im_end|>``), so the tool's digit sits 3 tokens before the position that answers it
(11 with ChatML's full role names) and a call with its answer fits in 9 response tokens: copying it is a
short-range pattern for a 2-layer char model, and episodes stay cheap.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_rl.config.schema import ModelConfig
from megatron_rl.data import build_char_tokenizer
from megatron_rl.rewards.registry import register_rule
from megatron_rl.rollout.tool_parsers import ToolCall, register_parser
from megatron_rl.rollout.tools import Tool, ToolSet, register_tool_set
from megatron_rl.tasks.last_digit import prepare_task_files

TOOL_SET = REWARD_NAME = "secret_digit"
DATA_SOURCE = "megatron_rl/secret_digit"
ALPHABET = "0123456789?"  # digits and the call marker (the template's role letters are added by the builder)
# ChatML with a message's role as its first letter (u, a, t) and no newlines
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'][0] }}{{ message['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>a{% endif %}"
)


def secret(prompt: str) -> str:
    return str(int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 10)


class SecretTool(Tool):
    name = "secret"
    schema = {"type": "function", "function": {"name": "secret", "description": "The answer.",
                                               "parameters": {"type": "object", "properties": {}}}}  # fmt: skip

    def call(self, args: dict, state: dict) -> tuple[str, float, bool]:
        return secret(state["extra_info"]["prompt"]), 0.0, False


def _parse(text: str) -> list[ToolCall]:
    return [ToolCall("secret", {})] if text.endswith("?") else []


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_) -> float:
    """1.0 when the tool answered and the final turn starts with its answer. ``solution_str`` has the
    special tokens dropped: ``x?t7a7`` for a first turn ``x?`` (a call), the tool's message ``t7`` and the
    final turn ``a`` + ``7``. The first ``?`` always ends the first turn, so what follows it is the tool's
    message, or nothing when the episode ended there (no room for the answer)."""
    _, called, after = solution_str.replace("\n", "").partition("?")
    return 1.0 if called and after.startswith(f"t{ground_truth}a{ground_truth}") else 0.0


def register() -> None:
    """Its tool set, its call parser and its reward rule (``megatron_rl.tasks.register_builtin_tasks``)."""
    register_tool_set(TOOL_SET, lambda: ToolSet({"secret": SecretTool()}))
    register_parser("secret_call", _parse, end="?")
    register_rule(REWARD_NAME, compute_score, data_sources=(DATA_SOURCE,))


def _write_split(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    last = "02468" if path.stem == "train" else "13579"  # validation prompts never occur in training
    prompts = [
        "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3))) + rng.choice(last)
        for _ in range(n)
    ]
    table = pa.table(
        {
            "prompt": prompts,
            "data_source": [DATA_SOURCE] * n,
            "reward_model": [{"style": "rule", "ground_truth": secret(p)} for p in prompts],
            "extra_info": [{"index": i, "prompt": p} for i, p in enumerate(prompts)],
        }
    )
    pq.write_table(table, path)


def prepare_tool_task(model_cfg: ModelConfig, workdir: Path, seed: int) -> tuple[str, str, str]:
    """The tiny model + chat tokenizer and the train/val files of this task under ``workdir``."""
    tokenizer = build_char_tokenizer(ALPHABET, chat_template=CHAT_TEMPLATE)
    return prepare_task_files(model_cfg, workdir, seed, tokenizer, _write_split)
