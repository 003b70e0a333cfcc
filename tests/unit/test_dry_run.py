"""trainer.dry_run: layout, micro-batches and the memory estimate, from config.json alone."""

from __future__ import annotations

import json

import pytest

from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.dims import ParallelDims
from megatron_rl.trainer.dry_run import Arch, dry_run, padded_vocab, rank_table, stage_params

QWEN_05B = {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
            "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}  # fmt: skip


def test_param_count_matches_qwen2_5_0_5b():
    a = Arch.from_hf(QWEN_05B)
    n = stage_params(a, tp=1, pp=1, head="lm")["first"]
    # 494.0M parameters (HF), plus 128 padded vocab rows of 896.
    assert abs(n - (494_032_768 + (padded_vocab(151936, 1) - 151936) * 896)) < 1e3


def test_tp_and_pp_split_the_params():
    a = Arch.from_hf(QWEN_05B)
    full = stage_params(a, 1, 1, "lm")["first"]
    tp2 = stage_params(a, 2, 1, "lm")["first"]
    assert 0.5 * full < tp2 < 0.51 * full  # norms are replicated
    pp2 = stage_params(a, 1, 2, "lm")
    # tied embeddings at PP=2: the last stage holds a copy of the embedding as the LM head
    assert pp2["first"] == pytest.approx(pp2["last"], rel=1e-3)


def test_rank_table_megatron_order():
    rows = rank_table(ParallelDims.build(8, 2, 2, num_layers=4), layers=4)
    assert [(r["tp"], r["dp"], r["pp"]) for r in rows[:4]] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert rows[4]["pp"] == 1 and "layers 2-3" in rows[4]["holds"] and "LM/value head" in rows[4]["holds"]
    assert "embedding" in rows[0]["holds"]


def test_dry_run_prints_layout_and_memory(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN_05B))
    cfg = JobConfig()
    cfg.model.path, cfg.model.dtype, cfg.trainer.output_dir = (
        str(tmp_path / "m"),
        "bfloat16",
        str(tmp_path / "o"),
    )
    cfg.algorithm.adv_estimator = "gae"
    r = dry_run(cfg, ParallelDims.build(8, 2, 2, num_layers=24))
    text = capsys.readouterr().out
    assert "world=8 = TP 2 x PP 2 x DP 2" in text and "rank    7: tp=1 pp=1 dp=1" in text
    for key in ("params", "grads", "optimizer", "kv_cache", "activations", "peak during training"):
        assert key in text
    b = r["memory"]["bytes"]
    assert b["optimizer"] == pytest.approx(r["memory"]["params_per_gpu"] * 12)  # fp32 moments + main (bf16)
    assert b["params"] == pytest.approx(r["memory"]["params_per_gpu"] * 2)
    assert (
        "critic" in r["batches"]
        and json.loads((tmp_path / "o" / "dry_run.json").read_text())["layout"]["dp"] == 2
    )


def test_builtin_model_needs_no_files(tmp_path):
    cfg = JobConfig()
    cfg.trainer.output_dir = str(tmp_path)
    r = dry_run(cfg, ParallelDims.build(1, 1, 1))
    assert r["model"]["layers"] == cfg.model.num_layers and r["batches"]["actor"]["micro_batches"] >= 1


def test_missing_config_names_the_key(tmp_path):
    cfg = JobConfig()
    cfg.model.path = str(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.path="):
        dry_run(cfg, ParallelDims.build(1, 1, 1))


def test_cli_dry_run_exits_without_training(tmp_path):
    import subprocess
    import sys

    from tests.distributed.launch import cpu_env

    cmd = [
        sys.executable,
        "-m",
        "megatron_rl.cli",
        "train",
        "trainer.dry_run=true",
        f"trainer.output_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cpu_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "megatron-rl dry run: world=1" in proc.stdout and "peak during training" in proc.stdout
    assert (tmp_path / "dry_run.json").is_file() and not (tmp_path / "metrics.jsonl").exists()


def test_distributed_optimizer_shards_the_optimizer_estimate_over_dp(tmp_path):
    from megatron_rl.trainer.dry_run import estimate

    a = Arch.from_hf(QWEN_05B)
    dims = ParallelDims.build(4, 1, 1, num_layers=24)
    cfg = JobConfig()
    cfg.model.dtype = "bfloat16"
    local = estimate(cfg, dims, a)["bytes"]
    cfg.actor.optim.backend = "megatron"
    mcore = estimate(cfg, dims, a)["bytes"]
    cfg.actor.optim.use_distributed_optimizer = True
    dist_opt = estimate(cfg, dims, a)["bytes"]
    n = stage_params(a, 1, 1, "lm")["first"]
    assert local["optimizer"] == mcore["optimizer"] == pytest.approx(12 * n)
    assert dist_opt["optimizer"] == pytest.approx(12 * n / 4)  # main params + moments split over DP=4
    assert local["grads"] == mcore["grads"] == pytest.approx(4 * n)  # fp32 main_grad / fp32 buffers
