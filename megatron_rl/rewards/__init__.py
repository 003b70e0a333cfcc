"""Rule rewards (GSM8K, MATH boxed answers), custom reward functions from files, and batch scoring."""

from megatron_rl.rewards.custom import load_custom_reward_fn
from megatron_rl.rewards.registry import (
    DATA_SOURCE_RULES,
    RULES,
    RewardFn,
    build_reward_fn,
    default_compute_score,
    register_rule,
    reward_fn_names,
)
from megatron_rl.rewards.scoring import score_batch

__all__ = [
    "DATA_SOURCE_RULES",
    "RULES",
    "RewardFn",
    "build_reward_fn",
    "default_compute_score",
    "load_custom_reward_fn",
    "register_rule",
    "reward_fn_names",
    "score_batch",
]
