"""Metric backends that write files: jsonl, tensorboard, wandb (offline works without network), mlflow."""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_rl.logging.console import format_generations


class JsonlBackend:
    """``<output_dir>/metrics.jsonl``: one ``{"step": s, ...metrics}`` object per line, appended (a resumed
    run continues the file). ``log_generations`` appends every sample to ``generations.jsonl``.
    Non-finite values are written as ``NaN`` / ``Infinity`` (Python's json reads them back)."""

    def __init__(self, output_dir: Path) -> None:
        self.metrics_path = output_dir / "metrics.jsonl"
        self.generations_path = output_dir / "generations.jsonl"
        self._file = self.metrics_path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def log_generations(self, samples: list[dict], step: int, max_samples: int = 3) -> None:
        with self.generations_path.open("a", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}, default=str) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorboardBackend:
    """Event files under ``<output_dir>/tensorboard``; generations go in as text."""

    def __init__(self, output_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = output_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_generations(self, samples: list[dict], step: int, max_samples: int = 3) -> None:
        # Markdown needs the code fence to keep newlines and indentation.
        text = format_generations(samples, step, max_samples)
        self.writer.add_text("generations", f"```\n{text}\n```", global_step=step)

    def close(self) -> None:
        self.writer.close()


def wandb_has_api_key() -> bool:
    """Whether wandb would find a key without asking: ``WANDB_API_KEY`` or a ``wandb login`` entry in
    ``~/.netrc`` (where ``wandb login`` stores it)."""
    import netrc

    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        hosts = netrc.netrc().hosts
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


def check_wandb_mode(mode: str | None) -> None:
    """``logger.wandb_mode=online`` without an API key would stop the run at an interactive prompt (or
    fail deep inside wandb); say so in one line before anything starts."""
    if mode == "online" and not wandb_has_api_key():
        raise RuntimeError(
            "logger.wandb_mode=online but no wandb API key was found (WANDB_API_KEY or ~/.netrc); run "
            "`wandb login`, or use logger.wandb_mode=offline and `wandb sync` the run later"
        )


class WandbBackend:
    """A wandb run with ``dir=output_dir``. ``mode="offline"`` (``logger.wandb_mode``'s default; with
    ``mode`` None, ``WANDB_MODE`` decides) logs without network or key; sync later with
    ``wandb sync <output_dir>/wandb/offline-run-*``."""

    def __init__(
        self, output_dir: Path, project: str, experiment: str, config: dict, mode: str | None
    ) -> None:
        check_wandb_mode(mode)
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=experiment, config=config, dir=str(output_dir), mode=mode)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_generations(self, samples: list[dict], step: int, max_samples: int = 3) -> None:
        columns = sorted({k for s in samples for k in s})
        rows = [
            [str(s.get(c, "")) if not isinstance(s.get(c), float) else s[c] for c in columns] for s in samples
        ]
        self.run.log({"generations": self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()
        # end wandb's service process now, while connected: the entry point ends leftover children on
        # exit, and wandb's own exit hook would then print a traceback about the lost connection
        self.wandb.teardown()


class MlflowBackend:
    """An MLflow run in ``tracking_uri`` (default: a file store at ``<output_dir>/mlruns``, readable with
    ``mlflow ui --backend-store-uri <output_dir>/mlruns``); experiment = ``trainer.project_name``, run name =
    ``trainer.experiment_name``. The resolved config is logged as flattened params. Needs the ``mlflow``
    extra (``pip install -e ".[mlflow]"``, which installs ``mlflow-skinny``)."""

    def __init__(
        self, output_dir: Path, project: str, experiment: str, config: dict, tracking_uri: str | None = None
    ) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self._param = Metric, Param
        self.tracking_uri = tracking_uri or (output_dir / "mlruns").resolve().as_uri()
        if self.tracking_uri.startswith("file:"):
            # MLflow 3 keeps the file store in maintenance mode behind this switch; a local run needs no
            # database server, and `mlflow ui --backend-store-uri` reads the folder
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(project)
        exp_id = found.experiment_id if found else self.client.create_experiment(project)
        self.run_id = self.client.create_run(exp_id, run_name=experiment).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in _flatten(config).items()]
        for start in range(0, len(params), 100):  # the store takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        now = int(time.time() * 1000)
        batch = [self._metric(_mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_generations(self, samples: list[dict], step: int, max_samples: int = 3) -> None:
        self.client.log_text(
            self.run_id, format_generations(samples, step, max_samples), f"generations/step_{step}.txt"
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    # MLflow keys allow letters, digits, _ - . / and spaces; anything else (e.g. '@') becomes '_'.
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in key)


def _flatten(config: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
