"""Tokenized prompt rows from verl-format parquet files, with length limits applied up front.

Everything is read and tokenized in the constructor, so bad files, bad rows and over-long prompts fail
before any model or GPU work starts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.data.parquet_source import SourceRow, read_prompt_files
from megatron_rl.distributed.runtime import read_launch_env

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "filter")


@dataclass
class PromptRow:
    """One prompt ready for generation.

    ``prompt_ids``: token ids of the rendered prompt (chat template applied when enabled).
    ``raw_prompt``: the prompt as stored (a string or a list of chat messages).
    ``prompt_text``: the text that was tokenized (before truncation).
    ``index``: row number across the concatenated files, stable when ``truncation="filter"`` drops rows.
    """

    prompt_ids: list[int]
    raw_prompt: str | list[dict]
    prompt_text: str
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    index: int = 0


def _check_messages(prompt: Any, row: SourceRow, prompt_key: str) -> list[dict]:
    ok = isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    )
    if not ok or not prompt:
        raise ValueError(
            f"'{row.file}' row {row.file_row}: column '{prompt_key}' holds {prompt!r}; expected a string or "
            "a non-empty list of {'role': str, 'content': str} messages (check data.prompt_key)"
        )
    return prompt


def render_prompt(prompt: Any, tokenizer, apply_chat_template: bool, row: SourceRow, prompt_key: str):
    """Return ``(text, add_special_tokens)`` for one stored prompt.

    A chat-rendered prompt already carries the template's special tokens, so it is tokenized without
    adding more; a raw string gets the tokenizer's own special tokens (e.g. BOS for base models).
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str):
        if not (apply_chat_template and has_template):
            return prompt, True
        prompt = [{"role": "user", "content": prompt}]
    messages = _check_messages(prompt, row, prompt_key)
    if not apply_chat_template or not has_template:
        reason = "data.apply_chat_template is false" if has_template else "the tokenizer has no chat_template"
        raise ValueError(
            f"'{row.file}' row {row.file_row}: the prompt is a list of chat messages but {reason}; "
            "set data.apply_chat_template=true with a tokenizer that has a chat template, "
            "or store plain string prompts"
        )
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, False


def _tokenize(texts: list[str], add_special: list[bool], tokenizer) -> list[list[int]]:
    """Batch-tokenize, grouped by the add_special_tokens flag (fast tokenizers batch well)."""
    ids: list[list[int]] = [[] for _ in texts]
    for flag in (True, False):
        positions = [i for i, f in enumerate(add_special) if f is flag]
        if positions:
            encoded = tokenizer([texts[i] for i in positions], add_special_tokens=flag)["input_ids"]
            for i, row_ids in zip(positions, encoded):
                ids[i] = list(row_ids)
    return ids


class PromptDataset:
    """Prompt rows from parquet files, tokenized and length-limited.

    Args:
        files: ``data.train_files`` / ``data.val_files``: a parquet path, a list of them, or a directory.
        tokenizer: a Hugging Face tokenizer (``apply_chat_template`` is used when it has a chat template).
        prompt_key: ``data.prompt_key``, the column holding the prompt.
        max_prompt_length: ``data.max_prompt_length`` in tokens; ``None`` or ``<= 0`` means no limit.
        truncation: ``data.truncation``: ``error`` (raise), ``left`` / ``right`` (cut that side), or
            ``filter`` (drop the row; ``num_filtered`` holds the count).
        apply_chat_template: render prompts with the tokenizer's chat template (string prompts become one
            user message). When false, or the tokenizer has none, string prompts are tokenized as is.
        files_key: the config key ``files`` came from, named in error messages.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer,
        prompt_key: str = "prompt",
        max_prompt_length: int | None = None,
        truncation: str = "error",
        apply_chat_template: bool = True,
        files_key: str = "data.train_files",
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r} is not one of {list(TRUNCATION_MODES)}")
        self.max_prompt_length = max_prompt_length if max_prompt_length and max_prompt_length > 0 else None
        self.truncation = truncation
        source = read_prompt_files(files, prompt_key=prompt_key, files_key=files_key)
        rendered = [render_prompt(r.prompt, tokenizer, apply_chat_template, r, prompt_key) for r in source]
        ids = _tokenize([t for t, _ in rendered], [f for _, f in rendered], tokenizer)
        self.rows: list[PromptRow] = []
        self.num_filtered = 0
        for index, (row, (text, _), row_ids) in enumerate(zip(source, rendered, ids)):
            row_ids = self._limit(row_ids, row, index)
            if row_ids is None:
                self.num_filtered += 1
                continue
            self.rows.append(
                PromptRow(row_ids, row.prompt, text, row.data_source, row.ground_truth, row.extra_info, index)
            )
        if self.num_filtered:
            logger.warning(
                "data.truncation=filter dropped %d of %d prompts longer than data.max_prompt_length=%d (%s)",
                self.num_filtered, len(source), self.max_prompt_length, files_key,
            )  # fmt: skip
        self._warn_missing_ground_truth(files_key)
        if not self.rows:
            raise ValueError(
                f"{files_key}: all {len(source)} prompts are longer than data.max_prompt_length="
                f"{self.max_prompt_length} and data.truncation=filter dropped them; raise data.max_prompt_length"
            )

    def _warn_missing_ground_truth(self, files_key: str) -> None:
        """Warn (once, rank 0) about rows without ``reward_model.ground_truth``: a rule reward scores them 0
        every time. Not an error: a reward model, or a custom function that does not read it, needs none."""
        missing = [r for r in self.rows if r.ground_truth is None]
        if missing and read_launch_env().rank == 0:
            logger.warning(
                "%s: %d of %d rows have reward_model.ground_truth = null (first: dataset index %d); rule "
                "rewards (gsm8k, math) score them 0 every time. Fill in ground_truth or drop those rows, unless "
                "the reward (reward.reward_fn=model, or a custom function) does not use it.",
                files_key, len(missing), len(self.rows), missing[0].index,
            )  # fmt: skip

    def _limit(self, ids: list[int], row: SourceRow, index: int) -> list[int] | None:
        limit = self.max_prompt_length
        if limit is None or len(ids) <= limit:
            return ids
        if self.truncation == "left":
            return ids[-limit:]
        if self.truncation == "right":
            return ids[:limit]
        if self.truncation == "filter":
            return None
        raise ValueError(
            f"prompt at row {row.file_row} of '{row.file}' (dataset index {index}) is {len(ids)} tokens, longer "
            f"than data.max_prompt_length={limit}; raise data.max_prompt_length or set data.truncation to "
            "left, right or filter"
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]
