"""MetricsLogger backends, rank-0-only writing, value conversion, generations display and the Timer."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
import torch

from megatron_rl.logging import (
    BACKENDS,
    STANDARD_METRICS,
    MetricsLogger,
    Timer,
    format_generations,
    timing_key,
    to_float,
)
from megatron_rl.logging import metric_names as names
from megatron_rl.logging.console import ConsoleBackend


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_one_line_per_step_with_converted_values(tmp_path):
    with MetricsLogger(["jsonl"], tmp_path, config={"x": 1}) as logger:
        for step in range(1, 4):
            logger.log({names.SCORE_MEAN: torch.tensor(0.25 * step), names.ACTOR_LR: np.float32(1e-6)}, step)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1][names.SCORE_MEAN] == 0.5
    assert rows[0][names.ACTOR_LR] == pytest.approx(1e-6)
    with MetricsLogger("jsonl", tmp_path) as logger:  # a resumed run appends
        logger.log({names.SCORE_MEAN: 1.0}, 4)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_only_rank_zero_writes(tmp_path, capsys):
    logger = MetricsLogger(["console", "jsonl"], tmp_path / "r1", rank=1)
    logger.log({"a": 1.0}, 1)
    logger.log_generations([{"prompt": "p", "response": "r", "score": 1.0}], 1)
    logger.close()
    assert not (tmp_path / "r1").exists()
    assert capsys.readouterr().out == ""


def test_bad_backend_and_bad_values(tmp_path, monkeypatch):
    with pytest.raises(ValueError) as err:
        MetricsLogger(["console", "neptune"], tmp_path)
    assert "trainer.logger" in str(err.value) and "neptune" in str(err.value)
    assert all(name in str(err.value) for name in BACKENDS)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ImportError, match="trainer.logger includes 'wandb'"):
        MetricsLogger(["wandb"], tmp_path, rank=3)  # every rank validates, so no rank hangs alone
    monkeypatch.undo()
    with MetricsLogger(["jsonl"], tmp_path) as logger:
        with pytest.raises(TypeError, match="metric 'v' is Tensor"):
            logger.log({"v": torch.ones(3)}, 1)
        with pytest.raises(ValueError, match="key 'step'"):
            logger.log({"step": 1.0}, 1)
    assert to_float("x", torch.tensor([2.5])) == 2.5 and to_float("b", True) == 1.0


def test_tensorboard_writes_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(["tensorboard"], tmp_path) as logger:
        logger.log({names.SCORE_MEAN: 0.5}, 1)
        logger.log({names.SCORE_MEAN: 0.75}, 2)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars(names.SCORE_MEAN)] == [(1, 0.5), (2, 0.75)]


def test_wandb_offline_writes_under_output_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")  # the explicit mode wins; online would need network
    monkeypatch.setenv("WANDB_SILENT", "true")
    with pytest.raises(ValueError, match="logger.wandb_mode='local'"):
        MetricsLogger(["wandb"], tmp_path, wandb_mode="local")
    kw = dict(project="proj", experiment="exp", config={"lr": 1e-6}, wandb_mode="offline")
    with MetricsLogger(["wandb"], tmp_path, **kw) as logger:
        logger.log({names.SCORE_MEAN: 0.5}, 1)
        logger.log_generations([{"prompt": "p", "response": "r", "score": 1.0}], 1)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb"))


def test_console_progress_and_generations(tmp_path, capsys):
    with MetricsLogger(["console"], tmp_path, total_steps=2) as logger:
        logger.log({names.SCORE_MEAN: 0.5, names.ACTOR_PPO_KL: 0.01}, 1)
        logger.log_generations(
            [{"prompt": "What is 2+2?", "response": "#### 4", "score": np.float64(1.0), "data_source": "d"}]
            * 5,
            step=1,
            max_samples=2,
        )
    out = capsys.readouterr().out
    assert "step 1 | actor/ppo_kl 0.01 | critic/score/mean 0.5" in out
    assert "2 of 5 generations" in out and out.count("[response]") == 2
    assert "score=1  data_source='d'" in out and "What is 2+2?" in out
    long = format_generations([{"prompt": "x" * 5000, "response": "y", "score": 0.0}], 0, max_chars=100)
    assert "[... 4900 chars ...]" in long and len(long) < 400


def test_progress_postfix_shows_step_score_kl_and_seconds_per_step():
    bar = ConsoleBackend(total_steps=10, stream=io.StringIO())
    bar.log({names.SCORE_MEAN: 0.5, names.ACTOR_PPO_KL: 1e-3, names.TIMING_STEP: 2.0}, 3)
    assert bar.bar.postfix == "step=3, score=0.500, kl=1.00e-03, s/step=2.00"
    bar.log({names.ACTOR_KL_LOSS: 0.02}, 5)  # no timing metric: wall clock between calls
    assert "kl=2.00e-02" in bar.bar.postfix and "s/step=" in bar.bar.postfix
    bar.close()


def test_metric_names_cover_the_standard_set():
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "perf/mfu", "val/score/mean"):
        assert key in STANDARD_METRICS
    for phase in ("gen", "reshard", "old_log_prob", "ref", "update_actor", "step"):
        assert timing_key(phase) in STANDARD_METRICS


def test_timer_accumulates_phases_and_resets():
    timer = Timer(cuda_sync=False)
    with timer("gen"):
        time.sleep(0.02)
    with timer("gen"):
        time.sleep(0.02)
    with pytest.raises(RuntimeError):
        with timer("reward"):
            raise RuntimeError("inside")
    metrics = timer.metrics()
    assert set(metrics) == {"timing_s/gen", "timing_s/reward"}
    assert metrics["timing_s/gen"] >= 0.04
    assert timer.metrics() == {}
    with pytest.raises(ValueError, match="without '/'"):
        with timer("a/b"):
            pass


def test_wandb_online_without_a_key_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a wandb login
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    with pytest.raises(RuntimeError) as err:
        MetricsLogger(["wandb"], tmp_path, wandb_mode="online", rank=1)  # every rank stops, before wandb.init
    message = str(err.value)
    assert "\n" not in message and "logger.wandb_mode=online" in message and "wandb login" in message
    assert not (tmp_path / "wandb").exists()


def test_mlflow_run_reads_back_with_mlflows_client(tmp_path):
    from mlflow.tracking import MlflowClient

    config = {"actor": {"optim": {"lr": 3e-3}}, "trainer": {"total_training_steps": 2}}
    with MetricsLogger(["mlflow"], tmp_path, project="proj", experiment="exp", config=config) as logger:
        logger.log({names.SCORE_MEAN: 0.25, "timing_s/gen": 1.5}, 1)
        logger.log({names.SCORE_MEAN: 0.75, "timing_s/gen": 1.0}, 2)
        logger.log_generations([{"prompt": "12=", "response": "2", "score": 1.0}], 2)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, names.SCORE_MEAN)
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert run.data.params["actor.optim.lr"] == "0.003"
    assert [a.path for a in client.list_artifacts(run.info.run_id, "generations")] == [
        "generations/step_2.txt"
    ]
