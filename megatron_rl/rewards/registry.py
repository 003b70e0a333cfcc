"""Reward functions by name (``reward.reward_fn``) and rule dispatch by ``data_source`` (as verl does).

Every reward function has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info=None)``
and returns a float or a dict with ``score``. Names:

- ``default``: pick the rule from each sample's ``data_source`` (``DATA_SOURCE_RULES``).
- ``gsm8k`` / ``math``: that rule for every sample, whatever its ``data_source``.
- ``custom``: ``reward.custom_reward_function.path`` / ``.name``.
- ``model``: a reward *model* scores the batch; that scorer (``RewardModelScorer``) is built by the trainer
  from ``megatron_rl.models``, not here, so ``build_reward_fn("model")`` raises. It should expose the
  same batch contract as ``score_batch``: ``(scores: list[float], extra_metrics: dict[str, list[float]])``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rl.rewards import gsm8k, math_boxed
from megatron_rl.rewards.custom import load_custom_reward_fn

RewardFn = Callable[..., Any]


def gsm8k_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, **kwargs) -> float:
    """GSM8K rule; ``kwargs``: ``method`` (strict|flexible), ``format_score``, ``score``."""
    return gsm8k.compute_score(solution_str, ground_truth, **kwargs)


def math_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, **kwargs) -> float:
    """Boxed-answer rule; ``kwargs``: ``score``, ``format_score``."""
    return math_boxed.compute_score(solution_str, ground_truth, **kwargs)


RULES: dict[str, RewardFn] = {"gsm8k": gsm8k_reward, "math": math_reward}

DATA_SOURCE_RULES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
}


def register_rule(name: str, fn: RewardFn, data_sources: tuple[str, ...] = ()) -> None:
    """Add a rule usable as ``reward.reward_fn=<name>`` and, for ``data_sources``, by ``default``."""
    if name in ("default", "custom", "model"):
        raise ValueError(f"'{name}' is a reserved reward.reward_fn name; pick another rule name")
    RULES[name] = fn
    for source in data_sources:
        DATA_SOURCE_RULES[source] = name


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info=None) -> float:
    """Dispatch to the rule registered for ``data_source``."""
    rule = DATA_SOURCE_RULES.get(data_source)
    if rule is None:
        raise KeyError(
            f"no reward rule for data_source={data_source!r} (known: {sorted(DATA_SOURCE_RULES)}); set "
            f"reward.reward_fn to one of {sorted(RULES)} to use it for every sample, or reward.reward_fn=custom "
            "with reward.custom_reward_function.path"
        )
    return RULES[rule](data_source, solution_str, ground_truth, extra_info)


def reward_fn_names() -> list[str]:
    return ["default", *sorted(RULES), "custom", "model"]


def build_reward_fn(
    name: str,
    custom_path: str | None = None,
    custom_name: str = "compute_score",
    reward_kwargs: dict | None = None,
) -> RewardFn:
    """The function for ``reward.reward_fn=name``.

    ``reward_kwargs`` (``reward.reward_kwargs``) are bound to a single named rule (e.g. ``method`` and
    ``format_score`` for gsm8k) or to the custom function.
    """
    if name == "custom":
        return load_custom_reward_fn(custom_path, custom_name, reward_kwargs)
    if name == "model":
        raise ValueError(
            "reward.reward_fn=model is scored by a reward model (RewardModelScorer, built by the trainer from "
            "megatron_rl.models), not by a rule function; the trainer must build that scorer instead"
        )
    if name == "default":
        if reward_kwargs:
            raise ValueError(
                f"reward.reward_kwargs={reward_kwargs} cannot apply to reward.reward_fn=default, which mixes "
                f"rules; set reward.reward_fn to one rule ({sorted(RULES)}) or drop reward.reward_kwargs"
            )
        return default_compute_score
    if name not in RULES:
        raise ValueError(f"reward.reward_fn={name!r} is not one of {reward_fn_names()}")
    rule = RULES[name]
    if not reward_kwargs:
        return rule

    def bound(data_source, solution_str, ground_truth, extra_info=None):
        return rule(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)

    bound.__qualname__ = f"{name}_reward({reward_kwargs})"
    return bound
