"""``megatron-rl score``: run the configured reward function over (prompt, response, ground truth) rows.

Rows come from a JSONL (or parquet) file in the training data's verl format plus a ``response`` field:
``prompt``, ``response``, ``data_source``, ``reward_model: {"ground_truth": ...}`` (a top-level
``ground_truth`` is accepted too), optional ``extra_info``. They go through the training loader's row
checks and the training loop's scoring (``score_batch``), so a bad row or a bad return value gives the
same message here as it would mid-run, and a reward can be debugged without training.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from megatron_rl.data.parquet_source import REWARD_MODEL_COLUMN, rows_from_table
from megatron_rl.rewards import RewardFn, score_batch

INPUT_KEY = "score.input"
RESPONSE_COLUMN = "response"


class _Columns:
    """The slice of ``pa.Table`` that ``rows_from_table`` reads, over plain Python lists: pyarrow would
    force one type per column, which JSONL ground truths of mixed types (e.g. "3" and 3) do not have."""

    def __init__(self, rows: list[dict]) -> None:
        self.column_names = list(dict.fromkeys(k for r in rows for k in r))
        self.num_rows = len(rows)
        self._rows = rows

    def column(self, name: str) -> _Column:
        return _Column([r.get(name) for r in self._rows])


class _Column:
    def __init__(self, values: list) -> None:
        self._values = values

    def to_pylist(self) -> list:
        return list(self._values)


def _read_table(path: Path):
    if not path.is_file():
        raise FileNotFoundError(f"{INPUT_KEY}='{path}' does not exist; set it to a .jsonl (or .parquet) file")
    if path.suffix == ".parquet":
        return pq.read_table(path)
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"'{path}' line {number} is not JSON ({err}); {INPUT_KEY} holds one object per line"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"'{path}' line {number} is {type(row).__name__}, expected a JSON object")
        if REWARD_MODEL_COLUMN not in row and "ground_truth" in row:
            row[REWARD_MODEL_COLUMN] = {"ground_truth": row["ground_truth"]}
        rows.append(row)
    return _Columns(rows)


def read_scoring_rows(path: str | Path, prompt_key: str = "prompt"):
    """``(source_rows, responses)`` from ``path``; errors name the file, the row and the fix."""
    path = Path(path).expanduser()
    table = _read_table(path)
    if RESPONSE_COLUMN not in table.column_names:
        raise KeyError(
            f"'{path}' has no '{RESPONSE_COLUMN}' field (fields found: {table.column_names}); {INPUT_KEY} rows "
            "need the response to score (e.g. the output of megatron-rl generate, with data_source and "
            "ground_truth added)"
        )
    rows = rows_from_table(table, path, prompt_key, files_key=INPUT_KEY)
    return rows, [str(r) for r in table.column(RESPONSE_COLUMN).to_pylist()]


def score_file(fn: RewardFn, path: str | Path, output: str | Path, prompt_key: str = "prompt") -> dict:
    """Score every row of ``path`` with ``fn``; write one JSON object per row (the row's fields plus
    ``score`` and any extra keys ``fn`` returns) to ``output`` and a summary to ``<output>.summary.json``.
    Returns the summary: rows, score mean/min/max, mean per data_source, mean of each extra key."""
    rows, responses = read_scoring_rows(path, prompt_key)
    scores, extras = score_batch(
        fn,
        [r.data_source for r in rows],
        responses,
        [r.ground_truth for r in rows],
        [r.extra_info for r in rows],
    )
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for i, (row, response) in enumerate(zip(rows, responses)):
            record = {
                "prompt": row.prompt,
                "response": response,
                "data_source": row.data_source,
                "ground_truth": row.ground_truth,
                "score": scores[i],
                **{k: v[i] for k, v in extras.items()},
            }
            f.write(json.dumps(record, default=str) + "\n")
    by_source: dict[str, list[float]] = defaultdict(list)
    for row, score in zip(rows, scores):
        by_source[row.data_source].append(score)
    summary = {
        "input": str(path),
        "output": str(out),
        "rows": len(scores),
        "score/mean": sum(scores) / len(scores),
        "score/min": min(scores),
        "score/max": max(scores),
        "score/mean_by_data_source": {k: sum(v) / len(v) for k, v in sorted(by_source.items())},
        **{f"reward/{k}/mean": sum(v) / len(v) for k, v in sorted(extras.items())},
    }
    Path(f"{out}.summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
