"""Actor, reference and critic on their TP/PP shards: forward passes for log-probs/values, PPO updates.

Every method is called on every rank (SPMD) with this DP rank's batch; results come back on every rank
of the pipeline. Updates: ppo_epochs x mini-batches x micro-batches through megatron-core's schedule,
with loss denominators counted over all micro-batches and DP ranks of each optimizer step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict
from functools import partial

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_rl.algos import (
    all_reduce_metrics,
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
    global_loss_denominators,
    vocab_parallel_log_probs_and_entropy,
)
from megatron_rl.algos.rollout_correction import rollout_gap_metrics
from megatron_rl.config.schema import ActorConfig, CriticConfig
from megatron_rl.kernels.batch_invariant_tp import vocab_parallel_token_logprobs
from megatron_rl.logging.metric_names import (
    PERF_CRITIC_UPDATE_PAD_FRAC,
    PERF_CRITIC_UPDATE_SHARED_FRAC,
    PERF_UPDATE_PAD_FRAC,
    PERF_UPDATE_SHARED_FRAC,
)
from megatron_rl.logging.timer import annotate
from megatron_rl.models.lora import adapters_disabled
from megatron_rl.models.pipeline import (
    ResponseLogits,
    broadcast_from_last_stage,
    gather_positions,
    run_micro_batches,
)
from megatron_rl.optim import build_optimizer
from megatron_rl.rollout.batch import (
    RolloutBatch,
    pad_response,
    resolved,
    split_by_tokens,
    split_micro_batches,
    trim,
)
from megatron_rl.rollout.packing import pack, split_packed, token_counts
from megatron_rl.rollout.sampling import truncated_token_logprobs
from megatron_rl.rollout.shared_prompts import share, split_shared


def response_log_probs(
    logits: ResponseLogits, mb: RolloutBatch, temperature: float, vocab_size: int, with_entropy: bool,
    exact: bool = False,
):  # fmt: skip
    """Logits at the response tokens (``run_micro_batches(..., response_logits=True)``) -> log-probs [B, R]
    of the response tokens (and entropy [B, R] if asked), 0 on the frame's padding cells.

    Vocab rows past the true vocabulary (padding to a multiple of 128*TP) are excluded, as the engine
    excludes them when sampling; the fused kernel works in fp32 chunks and keeps no fp32 [N, V/tp]
    tensor for backward. ``exact`` (``rollout.exact_logprobs``): the values are the engine's
    batch-invariant log-softmax (``kernels.batch_invariant_tp.vocab_parallel_token_logprobs``: at TP>1 the
    shards' pieces combined in rank order), the gradient the fused kernel's."""
    targets = logits.pick(mb.responses)  # [N]
    lp, ent = vocab_parallel_log_probs_and_entropy(
        logits.values[None], targets[None], tp_group=ps.get_tensor_model_parallel_group(),
        temperature=temperature, vocab_size=vocab_size,
    )  # fmt: skip
    lp, ent = lp[0], ent[0]  # [N]
    if exact:
        with torch.no_grad():
            flat = vocab_parallel_token_logprobs(
                logits.values, targets, temperature, vocab_size, ps.get_tensor_model_parallel_group()
            )
        lp = _ValueOf.apply(lp, flat.to(lp.dtype))
    return logits.frame(lp), (logits.frame(ent) if with_entropy else None)


class _ValueOf(torch.autograd.Function):
    """Forward: ``value``; backward: the gradient flows to ``differentiable`` (same quantity, other
    rounding)."""

    @staticmethod
    def forward(ctx, differentiable, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _reduce_update_metrics(per_micro: list[dict], num_optimizer_steps: int) -> dict[str, float]:
    """Last-stage micro-batch metrics -> DP-reduced means (losses summed per step, then averaged)."""
    if not per_micro:
        return {}
    keys = [k for k in per_micro[0] if k != "_tokens"]
    tokens = torch.stack([m["_tokens"] for m in per_micro]).double()
    merged = {}
    for k in keys:
        vals = torch.stack([m[k].double().reshape(()) for m in per_micro])
        if k.endswith("loss"):
            merged[k] = vals.sum() / num_optimizer_steps
        else:
            merged[k] = (vals * tokens).sum() / tokens.sum().clamp(min=1)
    ops = {k: "sum" for k in keys if k.endswith("loss")}
    reduced = all_reduce_metrics(merged, ps.get_data_parallel_group(), weight=tokens.sum(), reduce_ops=ops)
    return {k: float(v) for k, v in reduced.items()}


def _token_fractions(counts: list[int], device) -> tuple[float, float]:
    """(padded / all tokens the update ran over, prompt tokens shared / all tokens row by row) from
    ``rollout.packing.token_counts`` sums, summed over this DP group's ranks."""
    t = torch.tensor(counts, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
    real, run, rows = t.tolist()
    return (1 - real / run if run > 0 else 0.0), (1 - real / rows if rows > 0 else 0.0)


PAD_FRAC = {"actor": PERF_UPDATE_PAD_FRAC, "critic": PERF_CRITIC_UPDATE_PAD_FRAC}
SHARED_FRAC = {"actor": PERF_UPDATE_SHARED_FRAC, "critic": PERF_CRITIC_UPDATE_SHARED_FRAC}


class NonFiniteUpdate(RuntimeError):
    """A loss or gradient norm was NaN/Inf; the message names the phase (and, via ``at_step``, the step)."""


@contextlib.contextmanager
def at_step(step: int):
    """Add the training step to a ``NonFiniteUpdate`` raised inside."""
    try:
        yield
    except NonFiniteUpdate as err:
        raise NonFiniteUpdate(f"step {step}: {err}") from None


def check_finite(
    step_info: list[dict], metrics: dict[str, float], prefix: str, skip: bool
) -> dict[str, float]:
    """Raise on a non-finite grad norm or loss of an update, or with ``skip`` count the optimizer steps
    whose update was skipped (both optimizer backends skip the parameter update when the grad norm is
    not finite). Every rank sees the same norms (all-reduced) and losses (broadcast), so all agree."""
    norms = [float(s["grad_norm"]) for s in step_info]
    bad = sum(not math.isfinite(n) for n in norms)
    losses = {k: v for k, v in metrics.items() if k.endswith("loss") and not math.isfinite(v)}
    if (bad or losses) and not skip:
        raise NonFiniteUpdate(
            f"update_{prefix}: non-finite values in the update ({bad} of {len(norms)} optimizer steps had a NaN/Inf "
            f"gradient norm{'; losses ' + str(losses) if losses else ''}); the weights were not updated by them. "
            "Lower the learning rate or check the data and rewards; trainer.skip_nonfinite_steps=true skips such "
            "updates and counts them instead"
        )
    return {f"{prefix}/nonfinite_skipped": float(bad)}


class _TrainedModel:
    """A model with its optimizer and the mini/micro-batch loop shared by actor and critic."""

    skip_nonfinite = False  # trainer.skip_nonfinite_steps

    def __init__(self, model, cfg, total_steps: int, response_len: int):
        self.model = model
        self.cfg = cfg
        self.response_len = response_len
        self.opt = build_optimizer(model, cfg.optim, total_steps)

    response_logits = False  # policies: the loss gets logits at the response-scoring positions only
    max_scored: int | None = None  # with use_dynamic_bsz: LM-head rows per micro-batch (the memory plan's)
    max_tokens: int | None = None  # shared prompts: tokens per micro-batch (the plan's, <= the budget)

    def _split(self, batch: RolloutBatch) -> tuple[list[RolloutBatch], list[int] | None]:
        """Micro-batches: ``ppo_micro_batch_size_per_gpu`` sequences each, or with ``use_dynamic_bsz``
        up to ``ppo_max_token_len_per_gpu`` padded tokens of similar-length sequences (then also the row
        order they hold). ``pack_sequences``: each micro-batch runs packed (``rollout.packing``), and the
        token budget counts real tokens; ``share_prompts``: packed with each prompt once
        (``rollout.shared_prompts``), whole groups together."""
        cfg = self.cfg
        shared = cfg.share_prompts is True  # auto is resolved by the memory plan (off where it did not run)
        if cfg.use_dynamic_bsz:
            split = split_shared if shared else split_packed if cfg.pack_sequences else split_by_tokens
            return split(batch, self.max_tokens or cfg.ppo_max_token_len_per_gpu, self.max_scored)
        mbs = split_micro_batches(batch, cfg.ppo_micro_batch_size_per_gpu)
        if shared:
            return [share(trim(mb)) for mb in mbs], None
        return ([pack(trim(mb)) for mb in mbs] if cfg.pack_sequences else mbs), None

    def _forward_only(self, batch: RolloutBatch, loss_fn, key: str) -> torch.Tensor:
        """``loss_fn``'s per-row output ``key`` [B, R] for the whole batch, in batch order, on every rank."""
        mbs, order = self._split(batch)
        with torch.no_grad():
            outs = run_micro_batches(self.model, mbs, loss_fn, True, self.response_logits)
        r = batch.responses.shape[1]  # micro-batches are trimmed to their longest response
        out = torch.cat([pad_response(o[key], r) for o in outs]).float().cpu() if outs else None
        out = broadcast_from_last_stage(out)
        if order is not None:
            out = out[torch.argsort(torch.tensor(order))]
        return out.to(batch.response_mask.device)

    def _update(self, batch: RolloutBatch, loss_fn, mini_seqs: int, prefix: str) -> dict[str, float]:
        self.model.train()
        per_micro, steps, step_info, counts = [], 0, [], [0, 0, 0]
        for _ in range(self.cfg.ppo_epochs):
            for start in range(0, len(batch), mini_seqs):
                with annotate("update.split"):
                    mbs, _ = self._split(batch.select(range(start, start + mini_seqs)))
                    denom = global_loss_denominators(
                        [m.response_mask for m in mbs], ps.get_data_parallel_group()
                    )
                loss = partial(loss_fn, denom)
                with annotate("update.micro_batches"):
                    per_micro += run_micro_batches(self.model, mbs, loss, False, self.response_logits)
                counts = [a + b for a, b in zip(counts, token_counts(mbs))]  # as run (SP padding included)
                with annotate("update.optimizer_step"):
                    step_info.append(self.opt.step())
                steps += 1
        self.opt.step_lr()  # once per training step: the schedule counts training steps, not mini-batches
        with annotate("update.metrics"):
            metrics = broadcast_from_last_stage(_reduce_update_metrics(per_micro, steps))
        out = {f"{prefix}/{k}": v for k, v in metrics.items()}
        out[PAD_FRAC[prefix]], out[SHARED_FRAC[prefix]] = _token_fractions(counts, batch.response_mask.device)
        out |= check_finite(step_info, metrics, prefix, self.skip_nonfinite)
        out[f"{prefix}/grad_norm"] = float(sum(float(s["grad_norm"]) for s in step_info) / steps)
        out[f"{prefix}/lr"] = float(step_info[-1]["lr"])
        return out


class PolicyWorker(_TrainedModel):
    """Actor (trainable) or reference (frozen, ``cfg`` only for micro-batch sizes)."""

    response_logits = True

    def __init__(
        self,
        model,
        cfg: ActorConfig,
        temperature: float,
        vocab_size: int,
        total_steps: int,
        response_len: int,
        trainable: bool = True,
        offload_to_cpu: bool = False,
        adapters_off: bool = False,
        exact: bool = False,
        truncation: tuple[int, float] = (-1, 1.0),
    ):
        self.temperature = temperature
        self.adapters_off = adapters_off  # the reference of a LoRA actor: the actor's model, adapters off
        self.exact = exact  # rollout.exact_logprobs
        self.truncation = truncation  # rollout.top_k, rollout.top_p
        self.vocab_size = vocab_size
        self.offload = offload_to_cpu and torch.cuda.is_available()
        if trainable:
            super().__init__(model, cfg, total_steps, response_len)
        else:
            self.model, self.cfg, self.response_len = model, cfg, response_len
        if self.offload:
            self.model.to("cpu")

    def log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        """Log-probs [B, R] of the batch's responses under this model (temperature applied)."""
        self.model.eval()

        def loss_fn(mb, logits):
            lp, _ = response_log_probs(logits, mb, self.temperature, self.vocab_size, False, self.exact)
            return lp.new_zeros(()), {"lp": lp}

        if self.offload:  # the frozen reference lives on CPU between uses (ref.offload_to_cpu)
            self.model.to(batch.input_ids.device)
        with adapters_disabled(self.model) if self.adapters_off else contextlib.nullcontext():
            lp = self._forward_only(batch, loss_fn, "lp")
        if self.offload:
            self.model.to("cpu")
        return lp

    def _loss(self, denom, mb: RolloutBatch, logits: torch.Tensor):
        cfg, (n_tok, n_seq) = self.cfg, denom
        agg = dict(
            loss_agg_mode=cfg.loss_agg_mode,
            global_num_tokens=n_tok,
            global_num_seqs=n_seq,
            seq_len_norm=self.response_len,
        )
        lp, ent = response_log_probs(logits, mb, self.temperature, self.vocab_size, True, self.exact)
        # On-policy (one epoch, one mini-batch, no KL in reward): the trainer skips the old-log-prob pass;
        # the ratio is 1 by definition, so the current log-probs, detached, are the old ones.
        old = mb.old_log_probs if mb.old_log_probs is not None else lp.detach()
        loss, metrics = compute_policy_loss(
            cfg.policy_loss,
            old_log_prob=old,
            log_prob=lp,
            advantages=resolved(mb.advantages),  # reward.overlap: scored now, this forward queued
            response_mask=mb.response_mask,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            rollout_log_prob=mb.rollout_log_probs,
            tis_mode=cfg.tis_mode,
            tis_cap=cfg.tis_cap,
            tis_low=cfg.tis_low,
            is_weights=mb.rollout_is_weights,
            **asdict(cfg.policy_loss_params),
            **agg,
        )
        ent_loss, ent_metrics = compute_entropy_loss(entropy=ent, response_mask=mb.response_mask, **agg)
        metrics.update(ent_metrics)
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * ent_loss
        if cfg.use_kl_loss:
            kl_loss, kl_metrics = compute_kl_loss(
                logprob=lp,
                ref_logprob=mb.ref_log_probs,
                response_mask=mb.response_mask,
                kind=cfg.kl_loss_type,
                **agg,
            )
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        metrics = {k: v.detach() for k, v in metrics.items()}
        metrics |= rollout_gap_metrics(mb.rollout_log_probs, old, mb.response_mask)
        if mb.rollout_truncated_log_probs is not None and mb.old_log_probs is None:
            metrics |= self.truncated_gap(logits, mb)
        metrics["_tokens"] = mb.response_mask.sum()
        return loss, metrics

    def update(self, batch: RolloutBatch, mini_seqs: int) -> dict[str, float]:
        return self._update(batch, self._loss, mini_seqs, "actor")

    def truncated_gap(self, logits: ResponseLogits, mb: RolloutBatch) -> dict:
        """The rollout gap of the sampled tokens' log-probs under the top-k/top-p renormalised distribution,
        recomputed from the response tokens' logits by the engine's own function on the whole row (the TP
        shards all-gathered, as the engine gathers them). Only on the on-policy update's forward, whose
        weights are the rollout's."""
        with torch.no_grad():
            values = logits.values  # [N, V/tp]
            if ps.get_tensor_model_parallel_world_size() > 1:
                values = gather_from_tensor_model_parallel_region(values)  # [N, Vp]
            lp = truncated_token_logprobs(values[:, : self.vocab_size], logits.pick(mb.responses), self.temperature,
                                          *self.truncation, exact=self.exact)  # fmt: skip
        gap = rollout_gap_metrics(mb.rollout_truncated_log_probs, logits.frame(lp), mb.response_mask)
        return {k.replace("rollout_", "rollout_truncated_", 1): v for k, v in gap.items()}


class CriticWorker(_TrainedModel):
    """Scalar-head critic: values [B, R] and the clipped value-loss update."""

    def __init__(self, model, cfg: CriticConfig, total_steps: int, response_len: int):
        super().__init__(model, cfg, total_steps, response_len)

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        self.model.eval()

        def loss_fn(mb, values):
            return values.new_zeros(()), {"v": gather_positions(values, mb.score_pos) * mb.response_mask}

        return self._forward_only(batch, loss_fn, "v")

    def _loss(self, denom, mb: RolloutBatch, values: torch.Tensor):
        n_tok, n_seq = denom
        vpreds = gather_positions(values, mb.score_pos).float()  # [B, R]
        loss, metrics = compute_value_loss(
            vpreds=vpreds,
            values=mb.values,
            returns=resolved(mb.returns),
            response_mask=mb.response_mask,
            cliprange_value=self.cfg.cliprange_value,
            loss_agg_mode=self.cfg.loss_agg_mode,
            global_num_tokens=n_tok,
            global_num_seqs=n_seq,
            seq_len_norm=self.response_len,
        )
        metrics = {k: v.detach() for k, v in metrics.items()}
        metrics["_tokens"] = mb.response_mask.sum()
        return loss, metrics

    def update(self, batch: RolloutBatch, mini_seqs: int) -> dict[str, float]:
        return self._update(batch, self._loss, mini_seqs, "critic")
