"""Score a batch of responses with a verl-signature reward function, checking every return value."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from megatron_rl.rewards.custom import describe_fn
from megatron_rl.rewards.registry import RewardFn

_EXPECTED = "a finite number, or a dict with a finite number under 'score' (other keys: finite numbers)"


def _as_float(value: Any, what: str, index: int, data_source: str, fn_desc: str) -> float:
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()  # 0-d numpy / torch values
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise ValueError(
        f"reward function {fn_desc} returned {what}={value!r} ({type(value).__name__}) for sample {index} "
        f"(data_source={data_source!r}); expected {_EXPECTED}"
    )


def score_batch(
    fn: RewardFn,
    data_sources: Sequence[str],
    solutions: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """Call ``fn(data_source=, solution_str=, ground_truth=, extra_info=)`` on every sample.

    Returns ``(scores, extra_metrics)``: one float per sample, and for each extra key of dict returns a
    list with one float per sample (every sample must return the same extra keys).
    """
    n = len(solutions)
    extra_infos = [None] * n if extra_infos is None else extra_infos
    lengths = {len(data_sources), len(ground_truths), len(extra_infos)}
    if lengths != {n}:
        raise ValueError(
            f"score_batch: {len(data_sources)} data_sources, {n} solutions, {len(ground_truths)} ground_truths "
            f"and {len(extra_infos)} extra_infos; they must have one entry per sample"
        )
    fn_desc = describe_fn(fn)
    scores: list[float] = []
    extras: dict[str, list[float]] = {}
    for i in range(n):
        src = data_sources[i]
        try:
            out = fn(
                data_source=src,
                solution_str=solutions[i],
                ground_truth=ground_truths[i],
                extra_info=extra_infos[i],
            )
        except Exception as err:
            raise RuntimeError(
                f"reward function {fn_desc} raised on sample {i} (data_source={src!r}): {type(err).__name__}: {err}"
            ) from err
        if not isinstance(out, dict):
            out = {"score": out}
        if "score" not in out:
            raise ValueError(
                f"reward function {fn_desc} returned a dict without 'score' (keys {sorted(out)}) for sample {i} "
                f"(data_source={src!r}); expected {_EXPECTED}"
            )
        scores.append(_as_float(out["score"], "score", i, src, fn_desc))
        keys = sorted(k for k in out if k != "score")
        if i > 0 and keys != sorted(extras):
            raise ValueError(
                f"reward function {fn_desc} returned extra keys {keys} for sample {i} (data_source={src!r}) but "
                f"{sorted(extras)} for earlier samples; return the same keys for every sample"
            )
        for key in keys:
            extras.setdefault(key, []).append(_as_float(out[key], repr(key), i, src, fn_desc))
    return scores, extras
