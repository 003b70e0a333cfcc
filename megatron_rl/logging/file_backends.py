"""Metric backends that write files: jsonl, tensorboard and wandb (offline works without network)."""

from __future__ import annotations

import json
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


class WandbBackend:
    """A wandb run with ``dir=output_dir``. ``mode="offline"`` (or ``WANDB_MODE=offline`` when ``mode`` is
    None) logs without network; sync later with ``wandb sync <output_dir>/wandb/offline-run-*``."""

    def __init__(
        self, output_dir: Path, project: str, experiment: str, config: dict, mode: str | None
    ) -> None:
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
