"""RL algorithms: pure functions (advantages, KL, policy/value/entropy losses, aggregation, rollout/training
mismatch corrections, DAPO's group filter and overlong shaping) behind registries that refuse duplicate
names, the vocab-parallel log-prob/entropy kernels, and the thin collective layer that calls them across DP."""

from megatron_rl.algos import policy_loss_variants  # noqa: F401  (registers cispo, sapo, ...)
from megatron_rl.algos.advantages import (
    EstimatorTraits,
    advantage_estimator_names,
    get_advantage_estimator,
    get_estimator_traits,
    register_advantage_estimator,
)
from megatron_rl.algos.aggregation import LOSS_AGG_MODES, agg_loss
from megatron_rl.algos.collective import (
    all_reduce_metrics,
    compute_advantages_dp,
    global_loss_denominators,
    global_masked_whiten,
)
from megatron_rl.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    compute_kl_loss,
    kl_kind_names,
    kl_penalty,
)
from megatron_rl.algos.masked import masked_mean, masked_sum, masked_whiten
from megatron_rl.algos.policy_loss import (
    compute_entropy_loss,
    compute_policy_loss,
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from megatron_rl.algos.rollout_correction import (
    IS_MODES,
    REJECTION_MODES,
    is_weight_moments,
    normalize_is_weights,
    off_policy_metrics,
    off_policy_moments,
    rejection_mask,
    truncated_is_weights,
)
from megatron_rl.algos.value_loss import compute_value_loss
from megatron_rl.algos.vocab_parallel import (
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)

__all__ = [
    "IS_MODES",
    "LOSS_AGG_MODES",
    "REJECTION_MODES",
    "AdaptiveKLController",
    "EstimatorTraits",
    "FixedKLController",
    "advantage_estimator_names",
    "agg_loss",
    "all_reduce_metrics",
    "apply_kl_in_reward",
    "compute_advantages_dp",
    "compute_entropy_loss",
    "compute_kl_loss",
    "compute_policy_loss",
    "compute_value_loss",
    "get_advantage_estimator",
    "get_estimator_traits",
    "get_policy_loss",
    "global_loss_denominators",
    "global_masked_whiten",
    "is_weight_moments",
    "kl_kind_names",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "normalize_is_weights",
    "off_policy_metrics",
    "off_policy_moments",
    "policy_loss_names",
    "register_advantage_estimator",
    "register_policy_loss",
    "rejection_mask",
    "truncated_is_weights",
    "vocab_parallel_entropy",
    "vocab_parallel_log_probs",
    "vocab_parallel_log_probs_and_entropy",
]
