"""Rank-0 console output: a progress bar (step, score, KL, s/step), one metrics line per step, and
readable sample generations."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

from megatron_rl.logging.metric_names import ACTOR_KL_LOSS, ACTOR_PPO_KL, SCORE_MEAN, TIMING_STEP

_FIRST_KEYS = ("score", "data_source", "ground_truth")


def format_metrics(metrics: dict[str, float], step: int) -> str:
    """``step 3 | actor/entropy 1.234 | ...``: keys sorted, 4 significant digits."""
    return " | ".join([f"step {step}"] + [f"{k} {v:.4g}" for k, v in sorted(metrics.items())])


def _clip(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return f"{text[: max_chars // 2]} [... {len(text) - max_chars} chars ...] {text[-max_chars // 2 :]}"


def format_generations(samples: list[dict], step: int, max_samples: int = 3, max_chars: int = 600) -> str:
    """A readable block: a header per sample (score and other short fields), then its prompt and response."""
    shown = samples[:max_samples]
    lines = [f"===== step {step}: {len(shown)} of {len(samples)} generations ====="]
    for i, sample in enumerate(shown):
        keys = [k for k in _FIRST_KEYS if k in sample]
        keys += sorted(k for k in sample if k not in keys and k not in ("prompt", "response"))
        fields = [
            f"{k}={sample[k]:.4g}" if isinstance(sample[k], float) else f"{k}={sample[k]!r}" for k in keys
        ]
        lines.append(f"----- [{i}] " + "  ".join(fields))
        lines.append("[prompt]")
        lines.append(_clip(str(sample.get("prompt", "")), max_chars))
        lines.append("[response]")
        lines.append(_clip(str(sample.get("response", "")), max_chars))
    return "\n".join(lines)


class ConsoleBackend:
    """Progress bar on a terminal (``tqdm``, hidden when ``stream`` is not a TTY) plus text lines."""

    def __init__(self, total_steps: int | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.bar = tqdm(
            total=total_steps, desc="train", unit="step", file=self.stream, disable=None, dynamic_ncols=True
        )
        self._last: tuple[int, float] | None = None

    def _seconds_per_step(self, metrics: dict[str, float], step: int) -> float | None:
        now = time.perf_counter()
        last, self._last = self._last, (step, now)
        if TIMING_STEP in metrics:
            return metrics[TIMING_STEP]
        if last is None or step <= last[0]:
            return None
        return (now - last[1]) / (step - last[0])

    def log(self, metrics: dict[str, float], step: int) -> None:
        s_per_step = self._seconds_per_step(metrics, step)
        postfix = {"step": step}
        if SCORE_MEAN in metrics:
            postfix["score"] = f"{metrics[SCORE_MEAN]:.3f}"
        kl = metrics.get(ACTOR_PPO_KL, metrics.get(ACTOR_KL_LOSS))
        if kl is not None:
            postfix["kl"] = f"{kl:.2e}"
        if s_per_step is not None:
            postfix["s/step"] = f"{s_per_step:.2f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(max(0, step - self.bar.n))
        self.bar.write(format_metrics(metrics, step), file=self.stream)

    def log_generations(self, samples: list[dict], step: int, max_samples: int = 3) -> None:
        self.bar.write(format_generations(samples, step, max_samples), file=self.stream)

    def close(self) -> None:
        self.bar.close()
