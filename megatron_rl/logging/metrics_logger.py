"""``MetricsLogger``: one object the trainer calls on every rank; only rank 0 writes anything."""

from __future__ import annotations

import importlib.util
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_rl.logging.console import ConsoleBackend
from megatron_rl.logging.file_backends import (
    JsonlBackend,
    MlflowBackend,
    TensorboardBackend,
    WandbBackend,
    check_wandb_mode,
)

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
WANDB_MODES = (None, "offline", "online", "disabled")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
_EXTRAS = {"mlflow": 'pip install -e ".[mlflow]"'}


def _scalar_item(value: Any) -> Any:
    """0-d / 1-element tensors and arrays (and numpy scalars) as Python scalars; anything else unchanged."""
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1:
        return value.item()  # torch
    if getattr(value, "size", None) == 1 and hasattr(value, "item"):
        return value.item()  # numpy
    return value


def to_float(key: str, value: Any) -> float:
    """A metric value as a float: Python/numpy numbers, bools, and 0-d (or 1-element) tensors/arrays."""
    value = _scalar_item(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"metric {key!r} is {type(value).__name__} {str(value)[:80]}; metrics must be numbers or 0-d tensors "
        "(reduce it to a scalar, e.g. .mean(), before logging)"
    )


def check_backends(backends: str | Sequence[str]) -> list[str]:
    """Validate ``trainer.logger``; also fails when a backend's package is not installed."""
    names = [backends] if isinstance(backends, str) else list(backends)
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"trainer.logger has unknown backend(s) {unknown}; valid names: {list(BACKENDS)}")
    for name in names:
        package = _PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ImportError(
                f"trainer.logger includes '{name}' but the '{package}' package is not installed; "
                f"{_EXTRAS.get(name, f'pip install {package}')}, or remove '{name}' from trainer.logger"
            )
    return list(dict.fromkeys(names))


class MetricsLogger:
    """Fan metrics out to the ``trainer.logger`` backends on rank 0; other ranks only validate.

    Args:
        backends: ``trainer.logger``, names from ``BACKENDS``.
        output_dir: ``trainer.output_dir``; jsonl, tensorboard and wandb files go under it.
        project / experiment: ``trainer.project_name`` / ``trainer.experiment_name`` (wandb run names).
        config: the resolved run config as a plain dict (stored with the wandb run).
        rank: global rank; only rank 0 writes.
        total_steps: length of the console progress bar (``None``: unknown).
        wandb_mode: ``logger.wandb_mode`` (offline | online | disabled); ``None`` defers to ``WANDB_MODE``.
        mlflow_tracking_uri: ``logger.mlflow_tracking_uri``; ``None``: ``<output_dir>/mlruns``.
    """

    def __init__(
        self,
        backends: str | Sequence[str],
        output_dir: str | Path,
        project: str = "megatron_rl",
        experiment: str = "run",
        config: dict | None = None,
        rank: int = 0,
        total_steps: int | None = None,
        wandb_mode: str | None = None,
        mlflow_tracking_uri: str | None = None,
    ) -> None:
        self.names = check_backends(backends)
        if wandb_mode not in WANDB_MODES:
            raise ValueError(
                f"logger.wandb_mode={wandb_mode!r} is not one of {[m for m in WANDB_MODES if m]}"
            )
        if "wandb" in self.names:
            check_wandb_mode(wandb_mode)  # on every rank: all of them stop, not only rank 0
        self.output_dir = Path(output_dir)
        self.rank = rank
        self.backends: list = []
        if rank != 0:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for name in self.names:
            if name == "console":
                self.backends.append(ConsoleBackend(total_steps))
            elif name == "jsonl":
                self.backends.append(JsonlBackend(self.output_dir))
            elif name == "tensorboard":
                self.backends.append(TensorboardBackend(self.output_dir))
            elif name == "mlflow":
                run = MlflowBackend(
                    self.output_dir, project, experiment, dict(config or {}), mlflow_tracking_uri
                )
                self.backends.append(run)
            else:
                wandb = WandbBackend(self.output_dir, project, experiment, dict(config or {}), wandb_mode)
                self.backends.append(wandb)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Log one step's metrics (floats, numpy scalars or 0-d tensors); no-op off rank 0."""
        if not self.backends:
            return
        if "step" in metrics:
            raise ValueError(
                "metrics contain a key 'step'; the step is the `step` argument, rename the metric"
            )
        values = {key: to_float(key, value) for key, value in metrics.items()}
        for backend in self.backends:
            backend.log(values, int(step))

    def log_generations(self, samples: list[dict], step: int, max_samples: int = 3) -> None:
        """Show a few generations: dicts with ``prompt``, ``response``, ``score`` (and any short fields)."""
        if not self.backends:
            return
        samples = [{k: _plain(v) for k, v in s.items()} for s in samples]
        for backend in self.backends:
            backend.log_generations(samples, int(step), max_samples)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _plain(value: Any) -> Any:
    """Tensor/numpy scalars as Python numbers so every backend can print and serialise them."""
    value = _scalar_item(value)
    if isinstance(value, numbers.Real) and not isinstance(value, int):
        return float(value)
    return value
