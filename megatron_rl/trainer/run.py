"""The training loop, identical on every rank: generate -> score -> advantages -> update -> metrics."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
from megatron.core import parallel_state as ps

from megatron_rl.algos import get_estimator_traits
from megatron_rl.checkpoint.run_lock import lock_output_dir
from megatron_rl.config.schema import JobConfig
from megatron_rl.data import dp_share
from megatron_rl.distributed import ParallelDims, destroy_distributed, device, init_distributed
from megatron_rl.distributed.phase_watchdog import phase, set_error_dir
from megatron_rl.distributed.shutdown import EXIT_SIGNALLED, agreed_stop
from megatron_rl.distributed.transfer import host_values
from megatron_rl.logging import Timer
from megatron_rl.logging.metric_names import TIMING_GC
from megatron_rl.logging.perf import step_perf
from megatron_rl.logging.timer import PHASE_WORK, PhaseTimer, annotate
from megatron_rl.rollout.batch import Pending, RolloutBatch, build_batch
from megatron_rl.rollout.multi_turn import episode_state
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.trainer.advantage import (
    HostResponses,
    apply_overlong_penalty,
    batch_metrics,
    compute_advantages,
    needs_old_log_probs,
    reward_extra_metrics,
    rollout_correction,
    score_responses,
)
from megatron_rl.trainer.build import Components, build_components
from megatron_rl.trainer.collector import Collector
from megatron_rl.trainer.dynamic_sampling import (
    ROUND_KEY_STRIDE,
    extra_prompt_indices,
    fill_with_informative_groups,
)
from megatron_rl.trainer.workers import at_step


def _sampling(c: Components, temperature: float, n: int, seed: int) -> SamplingParams:
    return SamplingParams.from_config(
        c.cfg.rollout, temperature=temperature, n=n, seed=seed, eos_token_id=c.tokenizer.eos_token_id
    )


@contextlib.contextmanager
def _optimizer_state_on_host(c: Components, timer: Timer):
    """``{actor,critic}.optim.{param,optimizer,grad}_offload``: that optimizer state sits in host memory while
    the engine generates (``timing_s/offload``, ``timing_s/reload``: the transfer time per step)."""
    opts = [w.opt for w in (c.actor, c.critic) if w is not None and w.opt.offload_enabled]
    if not opts:
        yield
        return
    with timer("offload"):
        for opt in opts:
            opt.offload()
    try:
        yield
    finally:
        with timer("reload"):
            for opt in opts:
                opt.reload()


def rollout(c: Components, rows, group_offset: int, params: SamplingParams, timer: Timer) -> RolloutBatch:
    """This DP rank's prompts -> completions (engine, in place) -> batch tensors; scores attached."""
    with _optimizer_state_on_host(c, timer), timer("gen"):
        keys = [group_offset + i for i in range(len(rows))]  # global prompt ids: layout-invariant noise
        session = c.multi_turn.session([episode_state(r) for r in rows]) if c.multi_turn else None
        completions = c.engine.generate([r.prompt_ids for r in rows], params, keys, session)
    batch = build_batch(
        completions, rows, group_offset, params.max_new_tokens, c.tokenizer.pad_token_id or 0, device()
    )
    return batch


def _dp_rows(c: Components, rows):
    return dp_share(rows, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())


def validate(c: Components, step: int, timer: PhaseTimer) -> dict[str, float]:
    """Greedy (rollout.val_temperature) generation on the validation prompts, ``data.val_batch_size``
    prompts (global) at a time; the mean score over all of them."""
    if c.val_dataset is None:
        return {}
    with timer.bounded("val"):
        return _validate(c, timer)


def _validate(c: Components, timer: PhaseTimer) -> dict[str, float]:
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    params = _sampling(c, c.cfg.rollout.val_temperature, 1, c.cfg.trainer.seed)
    total = torch.zeros(2, dtype=torch.float64, device=device())
    n, chunk = len(c.val_dataset), max(c.cfg.data.val_batch_size, dp)
    for start in range(0, n, chunk):
        mine = [c.val_dataset[i] for i in range(start + rank, min(start + chunk, n), dp)]
        if not mine:  # every rank still joins the engine's collectives with an empty share
            mine = [c.val_dataset[start]]
            weight = 0.0
        else:
            weight = 1.0
        batch = rollout(c, mine, 0, params, timer)
        with timer("reward"):
            scores = (
                score_responses(batch, c.reward_fn, c.tokenizer, c.reward_model)["score"].double() * weight
            )
        total += torch.stack([scores.sum(), torch.tensor(weight * len(scores), dtype=torch.float64)])
    torch.distributed.all_reduce(total, group=ps.get_data_parallel_group())
    return {"val/score/mean": float(total[0] / total[1].clamp(min=1))}


def on_policy(cfg: JobConfig) -> bool:
    """One epoch over one mini-batch and no KL in the reward: the old log-probs would equal the update's
    own (detached) log-probs, so that forward pass is skipped."""
    return (
        cfg.actor.ppo_epochs == 1
        and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
        and not cfg.algorithm.use_kl_in_reward
        and not needs_old_log_probs(cfg)
    )


def scored_rollout(
    c: Components, rows, offset: int, seed: int, timer: Timer, score: bool = True
) -> tuple[RolloutBatch, dict]:
    """Generate, score (and, for ReMax, score a greedy sample per prompt as the baseline). ``score=False``:
    the batch unscored (``reward.overlap``: ``_score`` runs later)."""
    cfg = c.cfg
    batch = rollout(c, rows, offset, _sampling(c, cfg.rollout.temperature, cfg.rollout.n, seed), timer)
    if get_estimator_traits(cfg.algorithm.adv_estimator).greedy_baseline:
        greedy = rollout(c, rows, offset, _sampling(c, 0.0, 1, seed), timer)
        with timer("reward"):
            greedy_scores = score_responses(greedy, c.reward_fn, c.tokenizer, c.reward_model)["score"]
        by_prompt = torch.zeros(len(rows), dtype=greedy_scores.dtype, device=greedy_scores.device)
        by_prompt[greedy.group_index - offset] = greedy_scores  # [prompts]
        batch.reward_baselines = by_prompt[batch.group_index - offset]  # [B]
    if not score:
        return batch, {}
    with timer("reward"):
        metrics = _score(c, batch)
    return batch, metrics


def _score(c: Components, batch: RolloutBatch, host: HostResponses | None = None) -> dict[str, float]:
    """The responses' scores on the batch (``token_level_scores``), the overlong penalty; their metrics.
    ``host``: the responses already copied to the host (``score_responses``)."""
    scored = score_responses(batch, c.reward_fn, c.tokenizer, c.reward_model, host)
    metrics = apply_overlong_penalty(batch, c.cfg.reward.overlong_buffer, c.cfg.rollout.max_new_tokens)
    return metrics | reward_extra_metrics(scored)  # extra keys of a custom reward's dict: reward/<key>/mean


def overlap_reward(c: Components) -> bool:
    """``reward.overlap`` applies: nothing between generation and the update reads the scores or changes the
    response mask after the advantages (see the key's doc)."""
    cfg = c.cfg
    # pipeline size 1: a last stage scoring inside its loss would stall the other stages
    return (
        cfg.reward.overlap
        and ps.get_pipeline_model_parallel_world_size() == 1
        and c.reward_model is None
        and not get_estimator_traits(cfg.algorithm.adv_estimator).greedy_baseline
        and not cfg.algorithm.filter_groups.enable
        and not cfg.algorithm.overlong_filter
        and cfg.actor.rollout_rs is None
    )


def _defer_advantages(c: Components, batch: RolloutBatch, timer: Timer, into: dict) -> Pending:
    """``batch.advantages`` / ``returns`` computed on first use (the first update loss reads them after its
    forward is queued): the reward function then runs on the host while the device runs that forward. The
    responses go to the host now, before that forward is queued, since reading the device tensors then would
    wait for it; with ``MEGATRON_RL_DETOKENIZE_PROCESS=1``, on CUDA, a child process decodes their texts from
    now on (``HostResponses``). The advantage estimate may sync, e.g. DP's gather of row counts. Their metrics
    land in ``into``, their host seconds in the timer's reward / adv phases (not synced: a sync
    would wait for the forward), each bounded by ``trainer.timeout_minutes`` as before; no autograd graph."""
    host = HostResponses(batch, c.tokenizer)  # opt-in: a child process decodes the texts from here (CUDA)
    minutes = c.cfg.trainer.timeout_minutes

    def finish() -> None:
        parts = (("reward", lambda: _score(c, batch, host)),
                 ("adv", lambda: compute_advantages(batch, c.cfg.algorithm, c.kl_ctrl)))  # fmt: skip
        with torch.no_grad():
            for name, work in parts:
                t0 = time.perf_counter()
                with annotate(f"update.overlapped_{name}"), phase(name, minutes, PHASE_WORK[name]):
                    into.update(work())
                timer.add(name, time.perf_counter() - t0)

    return Pending(batch, finish, ("advantages", "returns"))


def _extra_round(c: Components, step: int, round_: int, timer: Timer) -> RolloutBatch:
    """Dynamic sampling: a further scored round of fresh prompts (group ids unique within the step)."""
    ds, n = c.train_loader.dataset, c.cfg.data.train_batch_size
    global_rows = [ds[i] for i in extra_prompt_indices(len(ds), n, c.cfg.data.seed, step, round_)]
    rows = _dp_rows(c, global_rows)
    offset = round_ * ROUND_KEY_STRIDE + step * n + ps.get_data_parallel_rank() * len(rows)
    return scored_rollout(c, rows, offset, c.cfg.trainer.seed + step + 7919 * round_, timer)[0]


def train_step(c: Components, step: int, timer: Timer) -> tuple[dict[str, float], RolloutBatch]:
    cfg = c.cfg
    global_rows = c.train_loader.global_batch(step)
    rows = _dp_rows(c, global_rows)
    offset = step * len(global_rows) + ps.get_data_parallel_rank() * len(rows)
    overlap = overlap_reward(c)
    batch, metrics = scored_rollout(c, rows, offset, cfg.trainer.seed + step, timer, score=not overlap)
    if cfg.algorithm.filter_groups.enable:
        batch, ds_metrics = fill_with_informative_groups(
            batch, lambda r: _extra_round(c, step, r, timer), cfg.algorithm.filter_groups.max_num_gen_batches,
            c.tokenizer.pad_token_id or 0, ps.get_data_parallel_group(),
        )  # fmt: skip
        metrics |= ds_metrics
    if not on_policy(cfg):
        with timer("old_log_prob"):
            batch.old_log_probs = c.actor.log_probs(batch)
    if c.ref is not None:
        with timer("ref"):
            batch.ref_log_probs = c.ref.log_probs(batch)
    if c.critic is not None:
        with timer("values"):
            batch.values = c.critic.values(batch)
    pending = _defer_advantages(c, batch, timer, metrics) if overlap else None
    with timer("adv"):
        if pending is None:
            metrics |= compute_advantages(batch, cfg.algorithm, c.kl_ctrl)
        metrics |= rollout_correction(batch, cfg.actor)
    if c.critic is not None:
        with timer("update_critic"):
            metrics |= c.critic.update(batch, cfg.critic.ppo_mini_batch_size * cfg.rollout.n // c.dims.dp)
    if step >= cfg.trainer.critic_warmup:
        with timer("update_actor"):
            metrics |= c.actor.update(batch, cfg.actor.ppo_mini_batch_size * cfg.rollout.n // c.dims.dp)
    if pending is not None:  # a step whose updates read neither (critic warmup, no critic) resolves here
        pending.resolve()
    for name in ("logprob_abs_diff", "logprob_mismatch_frac", "truncated_logprob_abs_diff",
                 "truncated_logprob_mismatch_frac"):  # fmt: skip
        diff = metrics.pop(f"actor/rollout_{name}", None)
        if batch.old_log_probs is None and diff is not None:  # measured inside the (only) update pass
            metrics[f"rollout/{name}"] = diff
    metrics |= batch_metrics(batch, cfg.rollout.max_new_tokens)
    return metrics, batch


def _perf(c: Components, batch: RolloutBatch, seconds: float, update_s: float) -> dict[str, float]:
    tokens = torch.tensor(float((host_values(batch.prompt_lens) + host_values(batch.response_lens)).sum()),
                          device=device())  # fmt: skip
    torch.distributed.all_reduce(tokens, group=ps.get_data_parallel_group())
    return step_perf(tokens, seconds, update_s, world_size=c.dims.world_size, num_params=c.args.matmul_params(),
                     epochs=c.cfg.actor.ppo_epochs)  # fmt: skip


def _samples(c: Components, batch: RolloutBatch, k: int) -> list[dict]:
    scores = batch.token_level_scores.sum(-1).tolist()
    # data_source and ground_truth make generations.jsonl a valid `megatron-rl score` input
    return [
        {"prompt": batch.rows[i].prompt_text, "response": batch.response_texts[i], "score": scores[i],
         "data_source": batch.rows[i].data_source, "ground_truth": batch.rows[i].ground_truth}
        for i in range(min(k, len(batch)))
    ]  # fmt: skip


def _finish_step(c: Components, done: int, metrics: dict, batch: RolloutBatch, timer: PhaseTimer, t0: float,
                 collector: Collector):  # fmt: skip
    """Validation (every trainer.test_freq), timing/perf metrics, logging, sample prints, checkpoint.
    Returns whether it wrote a checkpoint."""
    tr = c.cfg.trainer
    if tr.test_freq > 0 and (done % tr.test_freq == 0 or done == c.total_steps):
        metrics |= validate(c, done, timer)
    # the collector's time since the last step's log: this step, its validation, the last save
    metrics[TIMING_GC] = collector.take_pause_s()
    seconds = time.perf_counter() - t0
    metrics |= timer.metrics() | {"timing_s/step": seconds}
    metrics |= _perf(c, batch, seconds, metrics.get("timing_s/update_actor", 0.0))
    metrics["timing_s/reshard"] = c.engine.last_stats.reshard_s + c.engine.last_stats.gather_back_s
    c.logger.log(metrics, step=done)
    if tr.log_generations_freq > 0 and done % tr.log_generations_freq == 0:
        c.logger.log_generations(_samples(c, batch, c.cfg.logger.num_generations_to_log), step=done)
    with phase("save_checkpoint", tr.timeout_minutes):
        return c.checkpointer.maybe_save(done, last=done == c.total_steps) is not None


def _stop_on_signal(c: Components, name: str, done: int, saved_at: int) -> str:
    """Every rank agreed to stop after step ``done``: save unless that step is saved already (or
    trainer.save_on_signal=false); returns the one-line message."""
    tr, ckpt = c.cfg.trainer, ""
    if tr.save_on_signal and done > saved_at:
        with phase("save_checkpoint", tr.timeout_minutes, "a checkpoint write"):
            ckpt = f"checkpoint {c.checkpointer.save(done)} written"
    elif done == saved_at and done > 0:
        ckpt = f"checkpoint of step {done} already written"
    else:
        why = "no step trained yet" if done == 0 else "trainer.save_on_signal=false"
        ckpt = f"no checkpoint written ({why})"
    return (f"megatron-rl: stopped by {name} after step {done} of {c.total_steps}: {ckpt}; the same command "
            f"resumes (exit code {EXIT_SIGNALLED})")  # fmt: skip


def run_training(cfg: JobConfig, dims: ParallelDims) -> None:
    """Entry from ``megatron_rl.train`` after validation: init distributed, build, resume, loop, close."""
    tr = cfg.trainer
    if tr.dry_run:
        from megatron_rl.trainer.dry_run import dry_run

        dry_run(cfg, dims)
        return
    os.makedirs(tr.output_dir, exist_ok=True)
    set_error_dir(tr.output_dir)  # where a stuck phase (NCCL) reports before ending the process
    init_distributed(dims.tp, dims.pp, seed=tr.seed, sequence_parallel=cfg.parallel.sequence_parallel,
                     timeout_minutes=tr.timeout_minutes)  # fmt: skip
    lock_output_dir(tr.output_dir, tr.force_unlock)  # before any work: one run per output directory
    c = build_components(cfg, dims)
    start = c.checkpointer.resume()
    saved_at, stopped = start, None  # the newest checkpointed step; the one-line message after a signal
    with Collector(tr.gc_freeze, tr.manual_gc_interval) as collector, c.logger:
        collector.settle()  # what setup, resume and the logger built leaves the collector's walks
        if tr.val_before_train and start == 0:
            c.logger.log(validate(c, 0, PhaseTimer(tr.timeout_minutes)), step=0)
        for step in range(start, c.total_steps):
            if signal_name := agreed_stop(device()):  # collective: every rank stops at the same step
                stopped = _stop_on_signal(c, signal_name, step, saved_at)
                break
            timer, t0 = PhaseTimer(tr.timeout_minutes), time.perf_counter()
            with at_step(step + 1):
                metrics, batch = train_step(c, step, timer)
            collector.after_step(step + 1)  # inside the step's time (and its timing_s/gc)
            if _finish_step(c, step + 1, metrics, batch, timer, t0, collector):
                saved_at = step + 1
            # after the first step, outside its time: its batch gone first (not frozen with the rest)
            if step == start:
                del metrics, batch
                collector.after_first_step()
    # every rank finished: tear the process groups down before the interpreter exits (letting gloo's
    # threads die during interpreter teardown aborted a rank now and then: "terminate called without an
    # active exception" after the last step)
    torch.distributed.barrier()
    rank = torch.distributed.get_rank()
    destroy_distributed()
    if tr.write_report and rank == 0 and "jsonl" in tr.logger:
        _write_report(tr.output_dir)
    if stopped is not None:
        if rank == 0:
            print(stopped, flush=True)
        sys.exit(EXIT_SIGNALLED)


def _write_report(output_dir: str) -> None:
    """Plots at the end of a run; a plotting failure is reported, never fails the finished training."""
    from megatron_rl.logging.report import write_report

    try:
        report = write_report(output_dir)
    except Exception as err:  # noqa: BLE001 - any plotting problem: warn, the run itself succeeded
        print(f"megatron-rl: could not write the report ({type(err).__name__}: {err})", flush=True)
        return
    print(f"megatron-rl: report in {report.html} (charts in {report.html.parent}/report)", flush=True)
