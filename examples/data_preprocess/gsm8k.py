"""Turn a local copy of GSM8K into megatron_rl's (verl's) prompt parquet format.

Input (``--local_dir``), either layout:
  - the original release: ``train.jsonl`` / ``test.jsonl`` with ``question`` and ``answer``;
  - a Hugging Face datasets folder: ``main/train-*.parquet`` / ``main/test-*.parquet`` (or the same files
    directly in ``--local_dir``) with the same columns.
Output (``--output_dir``): ``train.parquet`` and ``test.parquet`` with columns ``prompt`` (one user
message), ``data_source``, ``ability``, ``reward_model`` ({style, ground_truth}) and ``extra_info``.

    python examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k_raw --output_dir ~/data/gsm8k
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")


def _split_files(local_dir: Path, split: str) -> list[Path]:
    """The files holding ``split``: the jsonl release first, then HF parquet shards."""
    jsonl = local_dir / f"{split}.jsonl"
    if jsonl.is_file():
        return [jsonl]
    for folder in (local_dir / "main", local_dir):
        shards = sorted(folder.glob(f"{split}-*.parquet"))
        if shards:
            return shards
    raise FileNotFoundError(
        f"--local_dir '{local_dir}' has no GSM8K {split} split: looked for {split}.jsonl, "
        f"main/{split}-*.parquet and {split}-*.parquet; point --local_dir at the downloaded GSM8K folder"
    )


def _read_records(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    table = pq.read_table(path)
    missing = {"question", "answer"} - set(table.column_names)
    if missing:
        raise KeyError(
            f"'{path}' lacks column(s) {sorted(missing)} (found {table.column_names}); is it GSM8K?"
        )
    return table.select(["question", "answer"]).to_pylist()


def read_split(local_dir: str | Path, split: str) -> list[dict]:
    """All ``{"question", "answer"}`` records of ``split``, in file order."""
    records: list[dict] = []
    for path in _split_files(Path(local_dir).expanduser(), split):
        for i, record in enumerate(_read_records(path)):
            if not isinstance(record.get("question"), str) or not isinstance(record.get("answer"), str):
                raise ValueError(
                    f"'{path}' record {i} has no string 'question' and 'answer': {record!r:.200}"
                )
            records.append({**record, "_origin": f"{path} record {i}"})
    return records


def extract_ground_truth(answer: str, origin: str = "") -> str:
    """The final answer after ``#### ``, commas removed (``"#### 1,200"`` -> ``"1200"``)."""
    if "####" not in answer:
        raise ValueError(f"{origin}: the answer has no '####' final-answer marker: {answer[-200:]!r}")
    return answer.split("####")[-1].strip().replace(",", "")


def to_rows(records: list[dict], split: str) -> list[dict]:
    """verl-format rows: chat prompt, data_source, ability, reward_model, extra_info."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {
                "style": "rule",
                "ground_truth": extract_ground_truth(r["answer"], r["_origin"]),
            },
            "extra_info": {"split": split, "index": i, "answer": r["answer"], "question": r["question"]},
        }
        for i, r in enumerate(records)
    ]


def write_rows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_dir", required=True, help="folder with the downloaded GSM8K files")
    parser.add_argument("--output_dir", required=True, help="where train.parquet and test.parquet go")
    args = parser.parse_args(argv)
    counts = {}
    for split in SPLITS:
        rows = to_rows(read_split(args.local_dir, split), split)
        write_rows(rows, Path(args.output_dir).expanduser() / f"{split}.parquet")
        counts[split] = len(rows)
    print(f"wrote {counts} rows to {args.output_dir}")
    return counts


if __name__ == "__main__":
    main()
