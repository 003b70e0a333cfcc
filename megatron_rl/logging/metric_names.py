"""Standard metric names (verl's, so dashboards carry over). Each value of ``STANDARD_METRICS`` says
what the metric means; ``/mean`` metrics are averaged over the global batch (all DP ranks).
"""

from __future__ import annotations

ACTOR_PG_LOSS = "actor/pg_loss"
ACTOR_PG_CLIPFRAC = "actor/pg_clipfrac"
ACTOR_PPO_KL = "actor/ppo_kl"
ACTOR_ENTROPY = "actor/entropy"
ACTOR_KL_LOSS = "actor/kl_loss"
ACTOR_GRAD_NORM = "actor/grad_norm"
ACTOR_LR = "actor/lr"
CRITIC_VF_LOSS = "critic/vf_loss"
CRITIC_VF_CLIPFRAC = "critic/vf_clipfrac"
SCORE_MEAN = "critic/score/mean"
REWARDS_MEAN = "critic/rewards/mean"
ADVANTAGES_MEAN = "critic/advantages/mean"
VALUES_MEAN = "critic/values/mean"
RESPONSE_LENGTH_MEAN = "response_length/mean"
RESPONSE_LENGTH_CLIP_RATIO = "response_length/clip_ratio"
ROLLOUT_LOGPROB_ABS_DIFF = "rollout/logprob_abs_diff"
ROLLOUT_LOGPROB_MISMATCH_FRAC = "rollout/logprob_mismatch_frac"
ROLLOUT_TRUNCATED_MISMATCH_FRAC = "rollout/truncated_logprob_mismatch_frac"
PERF_THROUGHPUT = "perf/throughput"
PERF_MFU = "perf/mfu"
PERF_MAX_MEMORY_ALLOCATED_GB = "perf/max_memory_allocated_gb"
PERF_UPDATE_PAD_FRAC = "perf/update_pad_frac"
PERF_CRITIC_UPDATE_PAD_FRAC = "perf/critic_update_pad_frac"
PERF_UPDATE_SHARED_FRAC = "perf/update_shared_frac"
PERF_CRITIC_UPDATE_SHARED_FRAC = "perf/critic_update_shared_frac"
VAL_SCORE_MEAN = "val/score/mean"

TIMING_PREFIX = "timing_s/"
TIMING_PHASES = (
    "gen", "reshard", "old_log_prob", "ref", "values", "reward", "adv", "update_critic", "update_actor", "step",
)  # fmt: skip


def timing_key(phase: str) -> str:
    """``timing_s/<phase>``: wall-clock seconds spent in ``phase`` during one step."""
    return f"{TIMING_PREFIX}{phase}"


TIMING_STEP = timing_key("step")
TIMING_GC = timing_key("gc")  # not a phase: the collector runs inside and between them (trainer.collector)

STANDARD_METRICS: dict[str, str] = {
    ACTOR_PG_LOSS: "policy-gradient loss (clipped surrogate), mean over the step's mini-batches",
    ACTOR_PG_CLIPFRAC: "fraction of response tokens whose probability ratio was clipped",
    ACTOR_PPO_KL: "approximate KL between the current and the rollout (old) policy, on response tokens",
    ACTOR_ENTROPY: "mean per-token entropy of the current policy on response tokens",
    ACTOR_KL_LOSS: "KL-to-reference loss term (when KL is used as a loss, e.g. GRPO)",
    ACTOR_GRAD_NORM: "global gradient norm of the actor before clipping",
    ACTOR_LR: "actor learning rate at this step",
    CRITIC_VF_LOSS: "value-function loss (PPO)",
    CRITIC_VF_CLIPFRAC: "fraction of value predictions that were clipped (PPO)",
    SCORE_MEAN: "mean sequence score from the reward function / model, before any KL penalty",
    REWARDS_MEAN: "mean sequence reward after the KL-in-reward penalty (equals the score without it)",
    ADVANTAGES_MEAN: "mean advantage over response tokens (about 0 after whitening)",
    VALUES_MEAN: "mean critic value over response tokens (PPO)",
    RESPONSE_LENGTH_MEAN: "mean response length in tokens",
    RESPONSE_LENGTH_CLIP_RATIO: "fraction of responses that hit the maximum response length",
    ROLLOUT_LOGPROB_ABS_DIFF: "mean |rollout log-prob - training recompute| on response tokens (engine drift)",
    ROLLOUT_LOGPROB_MISMATCH_FRAC: "fraction of response tokens whose rollout and training log-probs differ at all",
    ROLLOUT_TRUNCATED_MISMATCH_FRAC: "the same for the sampled token's log-prob under top-k/top-p, renormalised",
    PERF_THROUGHPUT: "tokens (prompt + response) processed per second per GPU over the step",
    PERF_MFU: "model FLOPs utilisation of the update phase",
    PERF_MAX_MEMORY_ALLOCATED_GB: "peak allocated accelerator memory during the step, GiB",
    PERF_UPDATE_PAD_FRAC: "padded tokens / all tokens the actor update ran over (0 with packed sequences)",
    PERF_CRITIC_UPDATE_PAD_FRAC: "the same for the critic update",
    PERF_UPDATE_SHARED_FRAC: "prompt tokens the actor update did not run again (share_prompts) / all tokens row by row",
    PERF_CRITIC_UPDATE_SHARED_FRAC: "the same for the critic update",
    VAL_SCORE_MEAN: "mean score on the validation set",
    **{timing_key(p): f"seconds spent in phase '{p}' this step" for p in TIMING_PHASES},
    TIMING_GC: "seconds Python's garbage collector ran on rank 0 since the last step's log (this step, its validation, the last checkpoint save; trainer.gc_freeze)",
}
