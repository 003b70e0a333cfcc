"""`megatron-rl report`: PNGs + a self-contained report.html from metrics.jsonl, one run or a sweep overlaid."""

import json

import pytest

from megatron_rl.logging.report import CHARTS, find_runs, read_metrics, write_report


def _write_run(run_dir, lr: float, steps: int = 6, overrides: list[str] | None = None, gpu: bool = False):
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "val/score/mean": 0.0}]
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "critic/score/mean": min(1.0, s * lr * 50),
            "actor/kl_loss": 0.01 * s,
            "actor/reference_kl": 0.02 * s,
            "actor/entropy": 3.0 - 0.3 * s,
            "response_length/mean": 3.5,
            "response_length/max": 4,
            "timing_s/gen": 1.0,
            "timing_s/update_actor": 2.0,
            "timing_s/step": 3.2,
            "perf/throughput": 100.0 + s,
            "reward/acc/mean": 0.1 * s,
        }
        if gpu:
            row |= {
                "perf/mfu": 0.4,
                "perf/max_memory_allocated_gb/gen": 10.0,
                "perf/max_memory_allocated_gb/update_actor": 20.0,
            }
        if s % 3 == 0:
            row["val/score/mean"] = 0.2 * s
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "crit')
    if overrides is not None:
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))


def test_one_run_gives_every_chart_with_its_series(tmp_path):
    _write_run(tmp_path / "run", 0.003, gpu=True)
    report = write_report(tmp_path / "run")
    assert set(report.pngs) == {c.name for c in CHARTS} and not report.skipped
    for png in report.pngs.values():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert report.series["score"] == ["critic/score/mean", "val/score/mean"]
    assert report.series["kl"] == ["actor/kl_loss", "actor/reference_kl"]
    assert report.series["entropy"] == ["actor/entropy"]
    assert report.series["response_length"] == ["response_length/mean", "response_length/max"]
    assert report.series["timing"] == ["gen", "update_actor", "step (total)"]  # stacked phases + the total
    assert report.series["memory"] == ["gen", "update_actor"]
    assert report.series["reward_extra"] == ["acc/mean"]
    page = report.html.read_text()
    assert page.count('src="data:image/png;base64,') == len(CHARTS)  # self-contained: no file links


def test_cpu_run_skips_charts_without_data_and_says_so(tmp_path):
    _write_run(tmp_path / "run", 0.003)
    report = write_report(tmp_path / "run", tmp_path / "elsewhere")
    assert report.skipped == ["mfu", "memory"]
    assert report.html == tmp_path / "elsewhere" / "report.html"
    assert "Charts without data in these runs: mfu, memory." in report.html.read_text()


def test_sweep_overlays_runs_with_their_overrides_as_legend(tmp_path):
    sweep = tmp_path / "multirun" / "2026-12-01" / "10-00-00"
    _write_run(sweep / "0", 0.001, overrides=["actor.optim.lr=1e-3", "trainer.output_dir=x"])
    _write_run(sweep / "1", 0.002, overrides=["actor.optim.lr=2e-3"])
    assert [r.label for r in find_runs(sweep)] == ["actor.optim.lr=1e-3", "actor.optim.lr=2e-3"]
    report = write_report(sweep)
    assert report.series["score"] == [
        "critic/score/mean [actor.optim.lr=1e-3]",
        "val/score/mean [actor.optim.lr=1e-3]",
        "critic/score/mean [actor.optim.lr=2e-3]",
        "val/score/mean [actor.optim.lr=2e-3]",
    ]
    assert report.series["timing"] == ["step [actor.optim.lr=1e-3]", "step [actor.optim.lr=2e-3]"]
    assert "2 runs" in report.html.read_text()


def test_resumed_rows_and_a_partial_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 2, "a": 5.0}\n{"step": 3, "a"')
    assert read_metrics(path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 5.0}]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2 is not a JSON object"):
        read_metrics(path)


def test_cli_names_a_directory_without_metrics(tmp_path, capsys):
    from megatron_rl.cli import main

    _write_run(tmp_path / "run", 0.003)
    main(["report", str(tmp_path / "run")])
    assert "megatron-rl report: wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path / "nothing")])
    assert exit_info.value.code == 2 and "no metrics.jsonl in" in capsys.readouterr().err
