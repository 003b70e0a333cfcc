"""Bad inputs produce the documented one-paragraph error, naming the file/key, before training starts."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.integration.cli import train


def _parquet(path, **columns):
    pq.write_table(pa.table(columns), path)
    return path


def _rows(prompts, truth="1"):
    n = len(prompts)
    return dict(
        prompt=prompts,
        data_source=["custom"] * n,
        reward_model=[{"ground_truth": truth}] * n,
        extra_info=[{"index": i} for i in range(n)],
    )


def _fails(tmp_path, *overrides):
    out = train(
        tmp_path / "run", "trainer.val_before_train=false", "trainer.total_training_steps=1", *overrides
    )
    assert out.returncode != 0, out.stdout[-2000:]
    err = out.stderr.strip().splitlines()[-1]
    assert err.startswith("megatron-rl: error:"), out.stderr[-3000:]
    return err


def test_missing_prompt_column(tmp_path):
    f = _parquet(
        tmp_path / "p.parquet", question=["12="], data_source=["x"], reward_model=[{"ground_truth": "2"}]
    )
    err = _fails(tmp_path, f"data.train_files={f}")
    assert "p.parquet" in err and "question" in err and "data.prompt_key" in err


def test_empty_parquet(tmp_path):
    f = _parquet(
        tmp_path / "empty.parquet", **{k: pa.array([], pa.string()) for k in ("prompt", "data_source")}
    )
    err = _fails(tmp_path, f"data.train_files={f}")
    assert "empty.parquet" in err


def test_overlong_prompt_with_truncation_error(tmp_path):
    f = _parquet(tmp_path / "long.parquet", **_rows(["1" * 50 + "="] * 32))
    err = _fails(tmp_path, f"data.train_files={f}", "data.max_prompt_length=20", "data.truncation=error")
    assert "data.max_prompt_length" in err and "data.truncation" in err


@pytest.mark.parametrize(
    "body,needle",
    [("raise KeyError('boom')", "sample 0"), ("return float('nan')", "nan")],
)
def test_custom_reward_function_errors(tmp_path, body, needle):
    f = _parquet(tmp_path / "ok.parquet", **_rows(["12="] * 32))
    fn = tmp_path / "my_reward.py"
    fn.write_text(
        f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    {body}\n"
    )
    err = _fails(
        tmp_path,
        f"data.train_files={f}",
        "reward.reward_fn=custom",
        f"reward.custom_reward_function.path={fn}",
    )
    assert needle in err.lower() or needle in err
    assert "custom" in err


def test_tokenizer_larger_than_the_embedding_is_refused_before_weights_load(tmp_path):
    import json

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.tasks.last_digit import prepare_builtin_task

    model_dir, train_file, _ = prepare_builtin_task(ModelConfig(), tmp_path / "task", seed=0)
    config = json.loads((tmp_path / "task" / "model" / "config.json").read_text())
    tokens, config["vocab_size"] = config["vocab_size"], config["vocab_size"] - 4
    (tmp_path / "task" / "model" / "config.json").write_text(json.dumps(config))
    err = _fails(tmp_path, f"model.path={model_dir}", f"data.train_files={train_file}")
    assert f"has {tokens} tokens" in err and f"embedding has {tokens - 4} rows" in err and model_dir in err


def test_bad_decode_gemm_table_fails_at_launch(tmp_path, monkeypatch):
    table = tmp_path / "table.json"
    table.write_text(
        '{"device": "x", "parts": {"fc1": {"weight": null, "rows": {"8": {"bn": 48, "bk": 64}}}}}'
    )
    monkeypatch.setenv("MEGATRON_RL_DECODE_GEMM_TABLE", str(table))
    err = _fails(tmp_path)
    assert (
        f"MEGATRON_RL_DECODE_GEMM_TABLE={table}" in err and "fc1 at 8 rows" in err and "powers of two" in err
    )
