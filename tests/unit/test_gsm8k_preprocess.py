"""examples/data_preprocess/gsm8k.py on tiny synthetic jsonl and HF-parquet inputs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.data import PromptDataset, build_char_tokenizer
from megatron_rl.rewards import default_compute_score

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "data_preprocess" / "gsm8k.py"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

RECORDS = {
    "train": [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A car costs 1,000 dollars twice. Total?", "answer": "2 * 1000 = 2000\n#### 2,000"},
    ],
    "test": [{"question": "What is 5 - 8?", "answer": "5 - 8 = -3\n#### -3"}],
}


@pytest.fixture(scope="module")
def gsm8k():
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_output(out_dir: Path):
    train = pq.read_table(out_dir / "train.parquet").to_pylist()
    test = pq.read_table(out_dir / "test.parquet").to_pylist()
    assert len(train) == 2 and len(test) == 1
    row = train[1]
    assert row["prompt"] == [{"role": "user", "content": RECORDS["train"][1]["question"] + " " + INSTRUCTION}]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "2000"}
    assert row["extra_info"] == {
        "split": "train",
        "index": 1,
        "answer": RECORDS["train"][1]["answer"],
        "question": RECORDS["train"][1]["question"],
    }
    assert test[0]["reward_model"]["ground_truth"] == "-3" and test[0]["extra_info"]["split"] == "test"
    # The output feeds the dataset and the gsm8k rule: a reference answer scores 1.
    ds = PromptDataset(out_dir / "train.parquet", build_char_tokenizer())
    assert [r.ground_truth for r in ds.rows] == ["7", "2000"]
    assert default_compute_score(ds[1].data_source, RECORDS["train"][1]["answer"], ds[1].ground_truth) == 1.0


def test_from_jsonl(tmp_path, gsm8k):
    raw = tmp_path / "raw"
    raw.mkdir()
    for split, records in RECORDS.items():
        (raw / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    counts = gsm8k.main(["--local_dir", str(raw), "--output_dir", str(tmp_path / "out")])
    assert counts == {"train": 2, "test": 1}
    check_output(tmp_path / "out")


def test_from_hf_parquet_folder(tmp_path, gsm8k):
    main = tmp_path / "hf" / "main"
    main.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(RECORDS["train"][:1]), main / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(RECORDS["train"][1:]), main / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(RECORDS["test"]), main / "test-00000-of-00001.parquet")
    gsm8k.main(["--local_dir", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "out")])
    check_output(tmp_path / "out")


def test_errors_name_the_input(tmp_path, gsm8k):
    with pytest.raises(FileNotFoundError, match="train.jsonl, main/train-"):
        gsm8k.main(["--local_dir", str(tmp_path), "--output_dir", str(tmp_path / "out")])
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="train.jsonl record 0.*'####'"):
        gsm8k.to_rows(gsm8k.read_split(tmp_path, "train"), "train")
