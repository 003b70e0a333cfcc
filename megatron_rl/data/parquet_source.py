"""Read verl-format prompt parquet files into plain Python rows.

Columns (verl's RL format): ``prompt`` (a string or a list of ``{"role", "content"}`` messages; the name
is ``data.prompt_key``), ``data_source`` (string, picks the reward rule), ``reward_model`` (a struct with
``ground_truth`` and optionally ``style``), ``extra_info`` (optional dict, passed to reward functions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE_COLUMN = "data_source"
REWARD_MODEL_COLUMN = "reward_model"
EXTRA_INFO_COLUMN = "extra_info"


@dataclass
class SourceRow:
    """One row as read from a file; ``file_row`` is its 0-based position inside ``file``."""

    prompt: Any
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    file: str = ""
    file_row: int = 0


def resolve_files(files: str | Path | Sequence[str | Path], files_key: str) -> list[Path]:
    """Turn one path or a list of paths into parquet files; a directory stands for its ``*.parquet``."""
    if isinstance(files, (str, Path)):
        files = [files]
    if len(files) == 0:
        raise ValueError(f"{files_key} is empty; set it to a parquet file or a list of parquet files")
    resolved: list[Path] = []
    for entry in files:
        path = Path(entry).expanduser()
        if path.is_dir():
            found = sorted(path.glob("*.parquet"))
            if not found:
                raise FileNotFoundError(
                    f"{files_key}: directory '{path}' holds no *.parquet files; point {files_key} at the "
                    "parquet files themselves (e.g. the output of examples/data_preprocess/gsm8k.py)"
                )
            resolved.extend(found)
        elif not path.is_file():
            raise FileNotFoundError(
                f"{files_key}: file '{path}' does not exist; set {files_key} to existing parquet file(s)"
            )
        else:
            resolved.append(path)
    return resolved


def _read_table(path: Path, files_key: str) -> pa.Table:
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException) as err:
        raise ValueError(
            f"{files_key}: could not read '{path}' as parquet ({type(err).__name__}: {err}); "
            f"check that the file is a parquet file or fix {files_key}"
        ) from err


def _require_columns(table: pa.Table, path: Path, prompt_key: str) -> None:
    found = table.column_names
    needed = {
        prompt_key: f"set data.prompt_key to the column that holds the prompt (one of {found})",
        DATA_SOURCE_COLUMN: "add a string column 'data_source' (e.g. 'openai/gsm8k'; it picks the reward rule)",
        REWARD_MODEL_COLUMN: "add a struct column 'reward_model' with a 'ground_truth' field",
    }
    for column, fix in needed.items():
        if column not in found:
            raise KeyError(f"'{path}' has no column '{column}' (columns found: {found}); {fix}")


def _ground_truth(reward_model: Any, path: Path, row: int) -> Any:
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(
            f"'{path}' row {row}: column 'reward_model' is {reward_model!r}, expected a struct with a "
            "'ground_truth' field (verl format: {'style': 'rule', 'ground_truth': ...})"
        )
    return reward_model["ground_truth"]


def read_prompt_file(
    path: Path, prompt_key: str = "prompt", files_key: str = "data.train_files"
) -> list[SourceRow]:
    """Read one parquet file into a list of ``SourceRow``; raise naming the file on any problem."""
    return rows_from_table(_read_table(path, files_key), path, prompt_key, files_key)


def rows_from_table(
    table: pa.Table, path: Path, prompt_key: str = "prompt", files_key: str = "data.train_files"
) -> list[SourceRow]:
    """The ``SourceRow`` of each row of a verl-format table read from ``path`` (parquet, or the JSONL rows
    of ``megatron-rl score``): the same column and row checks, the same messages."""
    _require_columns(table, path, prompt_key)
    if table.num_rows == 0:
        raise ValueError(f"{files_key}: '{path}' has no rows; remove it from {files_key} or regenerate it")
    prompts = table.column(prompt_key).to_pylist()
    sources = table.column(DATA_SOURCE_COLUMN).to_pylist()
    reward_models = table.column(REWARD_MODEL_COLUMN).to_pylist()
    if EXTRA_INFO_COLUMN in table.column_names:
        extras = table.column(EXTRA_INFO_COLUMN).to_pylist()
    else:
        extras = [None] * table.num_rows
    return [
        SourceRow(
            prompt=prompts[i],
            data_source=sources[i],
            ground_truth=_ground_truth(reward_models[i], path, i),
            extra_info=dict(extras[i] or {}),
            file=str(path),
            file_row=i,
        )
        for i in range(table.num_rows)
    ]


def read_prompt_files(
    files: str | Path | Sequence[str | Path], prompt_key: str = "prompt", files_key: str = "data.train_files"
) -> list[SourceRow]:
    """Read and concatenate the prompt rows of every file, in the order given.

    ``files_key`` is the config key the files came from (``data.train_files`` or ``data.val_files``);
    error messages name it.
    """
    rows: list[SourceRow] = []
    for path in resolve_files(files, files_key):
        rows.extend(read_prompt_file(path, prompt_key, files_key))
    return rows
