"""Reward functions by name (``reward.reward_fn``) and rule dispatch by ``data_source`` (as verl does).

Every reward function has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info=None)``
and returns a float or a dict with ``score``. Names:

- ``auto``: pick the rule from each sample's ``data_source`` (``DATA_SOURCE_RULES``).
- ``gsm8k`` / ``math`` (or any name added with ``register_rule``): that rule for every sample.
- ``custom``: ``reward.custom_reward_function.path`` / ``.name``; ``auto`` with a path set means ``custom``.
- ``model``: a reward *model* scores the batch; that scorer (``RewardModelScorer``) is built by the trainer
  from ``megatron_rl.models``, not here, so ``build_reward_fn("model")`` raises. It should keep the batch
  contract of ``score_batch``: ``(scores: list[float], extra_metrics: dict[str, list[float]])``.

Rule options: ``reward.format_score`` goes to the built-in gsm8k and math rules, ``reward.gsm8k_mode`` to
gsm8k; rules added with ``register_rule`` receive no options.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron_rl.rewards import gsm8k, math_boxed
from megatron_rl.rewards.custom import describe_fn, load_custom_reward_fn

RewardFn = Callable[..., Any]


def gsm8k_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, **options) -> float:
    """GSM8K rule; ``options``: ``method`` (strict|flexible), ``format_score``, ``score``."""
    return gsm8k.compute_score(solution_str, ground_truth, **options)


def math_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, **options) -> float:
    """Boxed-answer rule; ``options``: ``format_score``, ``score``."""
    return math_boxed.compute_score(solution_str, ground_truth, **options)


RULES: dict[str, RewardFn] = {"gsm8k": gsm8k_reward, "math": math_reward}

DATA_SOURCE_RULES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
}

_RESERVED = ("auto", "custom", "model")


def register_rule(name: str, fn: RewardFn, data_sources: tuple[str, ...] = ()) -> None:
    """Add a rule usable as ``reward.reward_fn=<name>`` and, for ``data_sources``, by ``auto``.

    A name (or data source) already taken by another function (rule) is an error, as in verl's
    registries; registering the same function again is a no-op.
    """
    if name in _RESERVED:
        raise ValueError(f"'{name}' is a reserved reward.reward_fn name; pick another rule name")
    if RULES.get(name, fn) is not fn:
        raise ValueError(
            f"reward rule '{name}' is already registered ({describe_fn(RULES[name])}); pick another name "
            f"for {describe_fn(fn)}"
        )
    taken = {s: DATA_SOURCE_RULES[s] for s in data_sources if DATA_SOURCE_RULES.get(s, name) != name}
    if taken:
        raise ValueError(
            f"data_source(s) {taken} already map to other reward rules; register '{name}' for other "
            "data sources, or set reward.reward_fn to a rule name to score every sample with it"
        )
    RULES[name] = fn
    for source in data_sources:
        DATA_SOURCE_RULES[source] = name


def rule_options(rule: str, format_score: float = 0.0, gsm8k_method: str = "strict") -> dict:
    """The keyword options rule ``rule`` takes (see the module docstring)."""
    if rule == "gsm8k":
        return {"method": gsm8k_method, "format_score": format_score}
    if rule == "math":
        return {"format_score": format_score}
    return {}


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info=None,
    format_score: float = 0.0,
    gsm8k_method: str = "strict",
) -> float:
    """Dispatch to the rule registered for ``data_source``."""
    rule = DATA_SOURCE_RULES.get(data_source)
    if rule is None:
        raise KeyError(
            f"no reward rule for data_source={data_source!r} (known: {sorted(DATA_SOURCE_RULES)}); set "
            f"reward.reward_fn to one of {sorted(RULES)} to use it for every sample, or reward.reward_fn=custom "
            "with reward.custom_reward_function.path"
        )
    options = rule_options(rule, format_score, gsm8k_method)
    return RULES[rule](data_source, solution_str, ground_truth, extra_info, **options)


def reward_fn_names() -> list[str]:
    return ["auto", *sorted(RULES), "custom", "model"]


def build_reward_fn(
    name: str,
    custom_path: str | None = None,
    custom_name: str = "compute_score",
    format_score: float = 0.0,
    gsm8k_method: str = "strict",
    reward_kwargs: dict | None = None,
) -> RewardFn:
    """The function for ``reward.reward_fn=name``, with verl's signature.

    ``format_score`` / ``gsm8k_method`` (``reward.format_score`` / ``reward.gsm8k_mode``) configure the
    built-in rules; ``reward_kwargs`` are bound to a custom function (verl's ``reward_kwargs``).
    """
    if name == "auto" and custom_path:
        name = "custom"  # a given reward.custom_reward_function.path is used, as in verl
    if gsm8k_method not in gsm8k.METHODS:
        raise ValueError(f"reward.gsm8k_mode={gsm8k_method!r} is not one of {list(gsm8k.METHODS)}")
    if name == "custom":
        return load_custom_reward_fn(custom_path, custom_name, reward_kwargs)
    if name == "model":
        raise ValueError(
            "reward.reward_fn=model is scored by a reward model (RewardModelScorer, built by the trainer from "
            "megatron_rl.models), not by a rule function; the trainer must build that scorer instead"
        )
    if name == "auto":
        return functools.partial(default_compute_score, format_score=format_score, gsm8k_method=gsm8k_method)
    if name not in RULES:
        raise ValueError(f"reward.reward_fn={name!r} is not one of {reward_fn_names()}")
    options = rule_options(name, format_score, gsm8k_method)
    return functools.partial(RULES[name], **options) if options else RULES[name]
