"""Metrics logging (console, jsonl, tensorboard, wandb), standard metric names, and phase timing."""

from megatron_rl.logging.console import format_generations, format_metrics
from megatron_rl.logging.metric_names import STANDARD_METRICS, TIMING_PHASES, timing_key
from megatron_rl.logging.metrics_logger import BACKENDS, MetricsLogger, check_backends, to_float
from megatron_rl.logging.timer import Timer

__all__ = [
    "BACKENDS",
    "STANDARD_METRICS",
    "TIMING_PHASES",
    "MetricsLogger",
    "Timer",
    "check_backends",
    "format_generations",
    "format_metrics",
    "timing_key",
    "to_float",
]
