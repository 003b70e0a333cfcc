"""Rewards -> (KL in reward, DAPO overlong shaping) -> advantages -> rollout corrections, computed
collectively across DP ranks."""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from megatron.core import parallel_state as ps

from megatron_rl.algos import (
    AdaptiveKLController,
    FixedKLController,
    all_reduce_metrics,
    apply_kl_in_reward,
    compute_advantages_dp,
    is_weight_moments,
    kl_penalty,
    masked_mean,
    normalize_is_weights,
    off_policy_metrics,
    off_policy_moments,
    rejection_mask,
    truncated_is_weights,
)
from megatron_rl.algos.collective import all_reduce_sum
from megatron_rl.algos.dapo import overlong_filter, overlong_penalty
from megatron_rl.algos.rollout_correction import rollout_gap_metrics
from megatron_rl.config.schema import ActorConfig, AlgorithmConfig, JobConfig, OverlongBufferConfig
from megatron_rl.distributed.transfer import to_device_async, to_host_async
from megatron_rl.kernels.compile import env_switch
from megatron_rl.rewards import score_batch
from megatron_rl.rollout.batch import RolloutBatch
from megatron_rl.trainer.detokenize_process import DecodeProcess


def build_kl_controller(cfg: AlgorithmConfig):
    k = cfg.kl_ctrl
    if k.type == "adaptive":
        return AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
    return FixedKLController(k.kl_coef)


_DECODE_CHUNK = 64  # sequences per thread of the parallel decode
_DECODE_CHECK = 32  # sequences, spread over the first batch with any tokens, of the agreement check
_DECODE_POOL: ThreadPoolExecutor | None = None
# id(Rust tokenizer) -> (that tokenizer, whether its decode_batch gave batch_decode's strings): the entry holds
# the tokenizer, so its id cannot pass to another object (tokenizers < 0.23 cannot be weakly referenced)
_FAST_DECODE: dict[int, tuple[object, bool]] = {}


def _rust_tokenizer(tokenizer):
    """The fast tokenizer's Rust ``tokenizers.Tokenizer`` where its decode adds nothing after the Rust one
    (no clean-up of tokenization spaces), else None."""
    rust = getattr(tokenizer, "_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or not hasattr(rust, "decode_batch"):
        return None
    return None if getattr(tokenizer, "clean_up_tokenization_spaces", True) else rust


def batch_decode(tokenizer, seqs: list[list[int]]) -> list[str]:
    """``tokenizer.batch_decode(seqs, skip_special_tokens=True)``, in threads where it can be: the Rust
    ``decode_batch`` releases the GIL, transformers' per-sequence decode does not (512 x 512 tokens: 0.20 s
    in one thread, 0.05 s in four on two cores). The first call per tokenizer checks that the two agree on
    up to 32 non-empty sequences spread over the batch; where they do not, transformers' decode serves from
    then on. A batch of only empty responses is decoded by transformers and settles nothing."""
    global _DECODE_POOL
    rust = _rust_tokenizer(tokenizer)
    if rust is not None and id(rust) not in _FAST_DECODE:
        filled = [s for s in seqs if len(s)]
        sample = filled[:: max(1, len(filled) // _DECODE_CHECK)][:_DECODE_CHECK]
        if not sample:  # nothing to compare yet: this batch is decoded by transformers, the check waits
            return tokenizer.batch_decode(seqs, skip_special_tokens=True)
        want = tokenizer.batch_decode(sample, skip_special_tokens=True)
        _FAST_DECODE[id(rust)] = (rust, rust.decode_batch(sample, skip_special_tokens=True) == want)
    if rust is None or not _FAST_DECODE[id(rust)][1]:
        return tokenizer.batch_decode(seqs, skip_special_tokens=True)
    if len(seqs) <= _DECODE_CHUNK:
        return rust.decode_batch(seqs, skip_special_tokens=True)
    if _DECODE_POOL is None:
        _DECODE_POOL = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="detokenize")
    chunks = [seqs[i : i + _DECODE_CHUNK] for i in range(0, len(seqs), _DECODE_CHUNK)]
    parts = _DECODE_POOL.map(lambda c: rust.decode_batch(c, skip_special_tokens=True), chunks)
    return [text for part in parts for text in part]


def decode_responses(batch: RolloutBatch, tokenizer, host: HostResponses | None = None) -> list[str]:
    """The responses' text; from ``host`` (``HostResponses(batch)``) without reading the device."""
    if host is not None:
        return host.texts(tokenizer)
    return _decode_rows(tokenizer, batch.response_lens, batch.responses)


def _decode_rows(tokenizer, lens: torch.Tensor, ids: torch.Tensor) -> list[str]:
    """``batch_decode`` of each row of ids [B, R] up to its length in lens [B]."""
    lens, ids = lens.tolist(), ids.tolist()
    return batch_decode(tokenizer, [row[:n] for row, n in zip(ids, lens)])


# ``HostResponses(batch, tokenizer)`` decodes in a child process (``trainer.detokenize_process``) where
# MEGATRON_RL_DETOKENIZE_PROCESS=1 (or true/on/yes), the batch is on CUDA (or CPU with ``PROCESS_ON_CPU``, for
# tests) and the tokenizer's Rust decode passed ``batch_decode``'s check. Off by default until measured on a GPU
# (session 32's call for it timed out on a fresh machine's compiles; ``benchmarks/results/2026-12-06-session32``).
PROCESS = env_switch("MEGATRON_RL_DETOKENIZE_PROCESS", False)
PROCESS_ON_CPU = False
_PROCESSES: dict[int, tuple[object, DecodeProcess]] = {}  # id(Rust tokenizer) -> (it, its child)


def _process_for(tokenizer) -> DecodeProcess | None:
    """The tokenizer's decoding child, or None where it has none (yet) or it died."""
    rust = _rust_tokenizer(tokenizer)
    proc = _PROCESSES.get(id(rust), (None, None))[1] if rust is not None else None
    return proc if proc is not None and proc.dead is None else None


def _start_process(tokenizer, lens: torch.Tensor, ids: torch.Tensor, texts: list[str]) -> None:
    """Starts the tokenizer's decoding child once its Rust decode passed ``batch_decode``'s check, and keeps it
    only if its answer for this batch equals ``texts`` (decoded here). A tokenizer that cannot go to a child, or
    a child that disagrees or fails, warns once and the decode stays in-process."""
    rust = _rust_tokenizer(tokenizer)
    if rust is None or id(rust) in _PROCESSES or not _FAST_DECODE.get(id(rust), (None, False))[1]:
        return
    proc, why = None, None
    try:
        proc = DecodeProcess(rust)
        got = proc.texts(proc.submit(lens.numpy(), ids.numpy()))
        if got is None:
            why = proc.dead or "no answer"
        elif got != texts:
            why = "its texts differ from the in-process decode's"
    except Exception as err:  # noqa: BLE001 - e.g. a tokenizer with Python parts has no JSON form
        why = f"{type(err).__name__}: {err}"
    if why is not None:
        if proc is not None:
            proc.dead = why
            proc.close()
        warnings.warn(
            f"The detokenising process is not used ({why}); the texts are decoded in-process.", stacklevel=3
        )
    _PROCESSES[id(rust)] = (rust, proc if why is None else None)


class HostResponses:
    """The batch's response lengths and ids copied to host memory behind the work queued so far, without a host
    sync (``distributed.transfer.to_host_async``): a scoring that runs later (``reward.overlap``, inside the
    update's first loss) reads them without waiting for the device work queued after the copy (a ``.tolist()``
    of the device tensors would).

    With ``tokenizer`` (and ``PROCESS``, opt-in, on CUDA) the ids go to a child process that decodes them while the
    update starts: ``texts`` reads its answer. This waits for the copy here, so it is made where the device has
    nothing else queued (``reward.overlap``: after the passes that read their results back to the host). The
    first batch a tokenizer decodes runs in-process (``batch_decode``'s check of the Rust decode) and starts the
    child for the next ones."""

    def __init__(self, batch: RolloutBatch, tokenizer=None):
        self._host, self._event = to_host_async([batch.response_lens, batch.responses])
        self._proc, self._job = None, None
        self._wants_process = (
            tokenizer is not None and PROCESS and (batch.responses.device.type == "cuda" or PROCESS_ON_CPU)
        )
        proc = _process_for(tokenizer) if self._wants_process else None
        if proc is not None:
            lens, ids = self.tensors()
            self._job = proc.submit(lens.numpy(), ids.numpy())
            self._proc = proc if self._job is not None else None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()  # the copies only, not the work queued after them
        return self._host[0], self._host[1]

    def texts(self, tokenizer) -> list[str]:
        """The responses' texts: the child's, else decoded here (then the child is started for later batches)."""
        proc, self._proc = self._proc, None
        texts = proc.texts(self._job) if proc is not None else None
        if texts is not None:
            return texts
        lens, ids = self.tensors()
        texts = _decode_rows(tokenizer, lens, ids)
        if self._wants_process:
            _start_process(tokenizer, lens, ids, texts)
        return texts


def score_responses(
    batch: RolloutBatch, reward_fn, tokenizer, reward_model=None, host: HostResponses | None = None
) -> dict[str, torch.Tensor]:
    """Rule/custom (or reward-model) scores, placed on the last response token of each sequence
    (``token_level_scores``). ``host``: the responses as copied to the host earlier (no device read here)."""
    batch.response_texts = decode_responses(batch, tokenizer, host)
    rows, dev, extra = batch.rows, batch.response_mask.device, {}
    if reward_model is not None:
        score_t = reward_model(batch).float()  # [B]
    else:
        scores, extra = score_batch(
            reward_fn,
            [r.data_source for r in rows],
            batch.response_texts,
            [r.ground_truth for r in rows],
            [r.extra_info for r in rows],
        )
        score_t = to_device_async(torch.tensor(scores, dtype=torch.float32), dev)  # [B]
    if batch.tool_reward is not None:  # multi-turn: the tools' / interaction's reward deltas
        score_t = score_t + batch.tool_reward.to(score_t)
    last = (batch.response_lens - 1).clamp(min=0)
    has_tokens = batch.response_lens > 0
    # each row's score on its last response token (an empty row keeps zeros): no boolean indexing, no host sync
    tls = torch.zeros_like(batch.response_mask)
    tls.scatter_(1, last[:, None], torch.where(has_tokens, score_t, 0.0).to(tls.dtype)[:, None])
    batch.token_level_scores = tls
    out = {"score": score_t}
    out.update(
        {
            reward_extra_key(k): to_device_async(torch.tensor(v, dtype=torch.float32), dev)
            for k, v in extra.items()
        }
    )
    return out


def reward_extra_key(name: str) -> str:
    """``reward/<name>/mean``: the metric for an extra key a reward function returns in its dict (verl's)."""
    return f"reward/{name}/mean"


def reward_extra_metrics(scored: dict[str, torch.Tensor]) -> dict[str, float]:
    """The extra keys of ``score_responses``' result ([B] each), averaged over the global batch."""
    extra = {k: v.double().mean() for k, v in scored.items() if k.startswith("reward/")}
    if not extra:
        return {}
    weight = float(len(scored["score"]))
    reduced = all_reduce_metrics(extra, ps.get_data_parallel_group(), weight=weight)
    return {k: float(v) for k, v in reduced.items()}


def apply_overlong_penalty(batch: RolloutBatch, cfg: OverlongBufferConfig, max_new_tokens: int) -> dict:
    """DAPO soft overlong punishment: add ``overlong_penalty`` to each sequence's score (on its last
    response token). Returns the DP-mean penalty as ``reward_extra/overlong_penalty``."""
    if cfg.len <= 0:
        return {}
    penalty = overlong_penalty(
        batch.response_lens,
        max_response_length=max_new_tokens,
        buffer_len=cfg.len,
        penalty_factor=cfg.penalty_factor,
    ).to(batch.token_level_scores.dtype)  # [B]
    rows = torch.nonzero(batch.response_lens > 0).squeeze(-1)
    batch.token_level_scores[rows, batch.response_lens[rows] - 1] += penalty[rows]
    reduced = all_reduce_metrics(
        {"reward_extra/overlong_penalty": penalty.mean()},
        ps.get_data_parallel_group(),
        weight=float(len(batch)),
    )
    return {k: float(v) for k, v in reduced.items()}


def needs_old_log_probs(cfg: JobConfig) -> bool:
    """Corrections that need pi_old of the whole batch before the update (so the old-log-prob pass runs
    even on-policy): rejection sampling and batch-normalised IS weights."""
    return cfg.actor.rollout_rs is not None or (
        cfg.actor.tis_mode is not None and cfg.actor.tis_batch_normalize
    )


def rollout_correction(batch: RolloutBatch, cfg: ActorConfig) -> dict[str, float]:
    """With pi_old known (``batch.old_log_probs``): off-policy diagnostics, rejection sampling (zeroes
    rejected tokens of ``batch.response_mask``) and batch-normalised IS weights
    (``batch.rollout_is_weights``), all over the global batch. Returns DP-reduced metrics."""
    if batch.old_log_probs is None:
        return {}
    dp_group, mask = ps.get_data_parallel_group(), batch.response_mask
    logps = dict(old_log_prob=batch.old_log_probs, rollout_log_prob=batch.rollout_log_probs)
    moments = all_reduce_sum(off_policy_moments(response_mask=mask, **logps), dp_group)
    out = off_policy_metrics(moments)
    if cfg.rollout_rs is not None:
        batch.response_mask, rs = rejection_mask(
            response_mask=mask, mode=cfg.rollout_rs, low=cfg.rollout_rs_low, high=cfg.rollout_rs_high, **logps
        )
        tokens, seqs = float(mask.bool().sum()), float(mask.bool().any(-1).sum())
        out |= all_reduce_metrics(
            {"rollout_rs/token_frac": rs["rollout_rs/token_frac"]}, dp_group, weight=tokens
        )
        out |= all_reduce_metrics({"rollout_rs/seq_frac": rs["rollout_rs/seq_frac"]}, dp_group, weight=seqs)
    if cfg.tis_mode is not None and cfg.tis_batch_normalize:
        weights, _ = truncated_is_weights(
            response_mask=batch.response_mask,
            tis_mode=cfg.tis_mode,
            tis_cap=cfg.tis_cap,
            tis_low=cfg.tis_low,
            **logps,
        )
        w_moments = all_reduce_sum(is_weight_moments(weights, batch.response_mask, cfg.tis_mode), dp_group)
        batch.rollout_is_weights, norm = normalize_is_weights(weights, w_moments)
        out |= norm
    return {k: float(v) for k, v in out.items()}


def filter_overlong(batch: RolloutBatch) -> None:
    """DAPO overlong filtering: responses cut at the length cap keep their place in the group statistics
    (advantages are computed first) but get no gradient."""
    truncated = torch.tensor([r == "length" for r in batch.finish_reasons], device=batch.response_mask.device)
    batch.response_mask = overlong_filter(batch.response_mask, truncated)


def compute_advantages(batch: RolloutBatch, cfg: AlgorithmConfig, kl_ctrl) -> dict[str, float]:
    """Fill ``token_level_rewards``, ``advantages`` and ``returns``; returns DP-reduced metrics."""
    dp_group = ps.get_data_parallel_group()
    metrics: dict[str, torch.Tensor] = {}
    if cfg.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_in_reward(
            token_level_scores=batch.token_level_scores,
            logprob=batch.old_log_probs,
            ref_logprob=batch.ref_log_probs,
            response_mask=batch.response_mask,
            kl_coef=kl_ctrl.value,
            kind=cfg.kl_penalty,
        )
        reduced = all_reduce_metrics(kl_metrics, dp_group, weight=float(len(batch)))
        kl_ctrl.update(
            float(reduced["kl_in_reward/kl"]), n_steps=len(batch) * ps.get_data_parallel_world_size()
        )
        metrics.update(reduced)
        batch.token_level_rewards = rewards
    else:
        batch.token_level_rewards = batch.token_level_scores
    batch.advantages, batch.returns = compute_advantages_dp(
        cfg.adv_estimator,
        dp_group=dp_group,
        token_level_rewards=batch.token_level_rewards,
        response_mask=batch.response_mask,
        index=batch.group_index,
        values=batch.values,
        gamma=cfg.gamma,
        lam=cfg.lam,
        norm_adv_by_std=cfg.norm_adv_by_std_in_grpo,
        reward_baselines=batch.reward_baselines,
    )
    if cfg.overlong_filter:
        filter_overlong(batch)
    return {k: float(v) for k, v in metrics.items()}


def batch_metrics(batch: RolloutBatch, max_new_tokens: int) -> dict[str, float]:
    """critic/*, response_length/*, actor-vs-ref KL and rollout-vs-recompute log-prob gap, reduced over DP."""
    mask = batch.response_mask
    seq_score = batch.token_level_scores.sum(-1)
    seq_reward = batch.token_level_rewards.sum(-1)
    lens = batch.response_lens.float()
    m = {
        "critic/score/mean": seq_score.mean(),
        "critic/rewards/mean": seq_reward.mean(),
        "critic/advantages/mean": masked_mean(batch.advantages, mask),
        "critic/returns/mean": masked_mean(batch.returns, mask),
        "response_length/mean": lens.mean(),
        "response_length/clip_ratio": (lens >= max_new_tokens).float().mean(),
    }
    if batch.old_log_probs is not None:
        gap = rollout_gap_metrics(batch.rollout_log_probs, batch.old_log_probs, mask)
        m |= {f"rollout/{k.removeprefix('rollout_')}": v for k, v in gap.items()}
    if batch.values is not None:
        m["critic/values/mean"] = masked_mean(batch.values, mask)
    if batch.ref_log_probs is not None and batch.old_log_probs is not None:
        kl = kl_penalty(logprob=batch.old_log_probs, ref_logprob=batch.ref_log_probs, kind="k1")
        m["actor/reference_kl"] = masked_mean(kl, mask)
    ops = {"response_length/max": "max"}
    m["response_length/max"] = lens.max()
    if batch.turns is not None:  # multi-turn: tool counts summed over the global batch
        m["multi_turn/turns/mean"] = batch.turns.double().mean()
        for k, name in enumerate(("tool/calls", "tool/errors", "tool/timeouts")):
            m[name] = batch.tool_counts[:, k].double().sum()
            ops[name] = "sum"
    reduced = all_reduce_metrics(m, ps.get_data_parallel_group(), weight=float(len(batch)), reduce_ops=ops)
    return {k: float(v) for k, v in reduced.items()}
