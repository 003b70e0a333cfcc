"""Fit the job to the GPU before any weights load: resolve ``=auto`` budgets from the memory model and
refuse a configuration it says cannot fit, naming the key to change and a value that would fit.

Resolved here: ``actor.ppo_max_token_len_per_gpu`` and ``critic.ppo_max_token_len_per_gpu`` (with
use_dynamic_bsz; the largest whole number of sequences whose training peak fits) and
``rollout.max_num_seqs`` (the most KV-cache slots whose generation peak fits; the KV cache,
``rollout.kv_cache_tokens``, is then sized for exactly those slots), and ``actor.share_prompts`` /
``critic.share_prompts`` (``share_choice``; first, since a shared sequence runs fewer tokens), and
``rollout.keep_cache`` (``_resolve_keep_cache``; last, planning the rest with and without it). A phase fits when
resident state + 1.15 x what the phase adds on top <= GPU memory - 2 GiB: the memory model is held to
15% of the measured peak per phase, and the CUDA context, NCCL and allocator slack need the rest.
"""

from __future__ import annotations

import copy
import math

import torch

from megatron_rl.config.schema import JobConfig
from megatron_rl.config.validate import ConfigError
from megatron_rl.distributed.dims import ParallelDims
from megatron_rl.models.args import ModelArgs
from megatron_rl.trainer.memory_model import GIB, estimate, gen_slots, micro_shape, seq_tokens, trained_roles

AUTO = "auto"
HEADROOM = 1.15  # the memory model's tolerance, applied to everything above the resident state
RESERVE = 2 * GIB  # CUDA context, NCCL buffers, allocator slack


def gpu_memory_bytes(cfg: JobConfig) -> tuple[float | None, str]:
    """(bytes, where from): ``trainer.gpu_memory_gb`` when set, else the current CUDA device's total
    memory, else None (a CPU run: nothing to fit)."""
    if cfg.trainer.gpu_memory_gb:
        return cfg.trainer.gpu_memory_gb * GIB, f"trainer.gpu_memory_gb={cfg.trainer.gpu_memory_gb}"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return float(props.total_memory), f"{props.name}, {props.total_memory / GIB:.1f} GiB"
    return None, "no GPU and trainer.gpu_memory_gb unset"


def share_prompts_blocker(cfg: JobConfig, role: str) -> str | None:
    """Why ``{role}.share_prompts=auto`` stays off in this configuration (None: nothing in the config
    stops it). Sharing is on by auto only where the parity tests cover it (single-turn, no LoRA, no
    sequence parallelism) and where it is faster: on CUDA, through varlen flash attention."""
    if cfg.rollout.n < 2:
        return "rollout.n=1: no two responses share a prompt"
    if cfg.rollout.multi_turn.enable:
        return "multi-turn rollouts"
    if getattr(cfg, role).lora.enabled:
        return f"{role}.lora.rank={getattr(cfg, role).lora.rank}"
    if cfg.parallel.sequence_parallel:
        return "parallel.sequence_parallel=true"
    if cfg.model.dtype != "bfloat16":  # model.dtype is float32 or bfloat16 (validated)
        return f"model.dtype={cfg.model.dtype}: varlen flash attention runs in bf16/fp16 only"
    return None


def share_choice(cfg: JobConfig, role: str, for_absent_gpu: bool = False) -> tuple[bool, str]:
    """``{role}.share_prompts=auto`` resolved: (on, why). On where nothing in the config stops it and
    varlen flash attention passes its trial with shared key segments on every rank's GPU (agreed, so all
    ranks build the same micro-batches; the per-segment loop that would run otherwise is slower than unshared
    rows).
    ``for_absent_gpu``: a dry run planning for a GPU this machine lacks (``trainer.gpu_memory_gb``): the
    trial cannot run here, so the plan assumes it passes (it did at every size on an H200) and says so."""
    from megatron_rl.models.packed_attention import agree_on_varlen, varlen_kernel, varlen_notes

    blocker = share_prompts_blocker(cfg, role)
    if blocker is not None:
        return False, blocker
    if not torch.cuda.is_available() and for_absent_gpu:
        return True, ("assumed for the GPU: the varlen flash-attention trial runs there, and if it fails, auto "
                      "keeps sharing off and the budgets shrink to the unshared ones")  # fmt: skip
    if not torch.cuda.is_available():
        return False, "no CUDA device: varlen flash attention runs on CUDA only"
    dev, dtype = torch.device("cuda", torch.cuda.current_device()), getattr(torch, cfg.model.dtype)
    if not agree_on_varlen(dev, dtype, shared=True):
        return False, f"varlen flash attention failed its trial: {varlen_notes()[f'{dev} {dtype} shared']}"
    return True, f"each prompt once per group in the update; attention kernel: {varlen_kernel(dev)}"


def _fits(est: dict, phase: str, total: float) -> bool:
    peak = est["peaks"][phase]
    return est["resident"] + HEADROOM * (peak - est["resident"]) <= total - RESERVE


def _largest(candidates: list[int], ok) -> int | None:
    """The largest candidate (ascending list) for which ``ok`` holds, assuming ``ok`` is monotone."""
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(candidates[mid]):
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    return best


def _token_candidates(cfg: JobConfig, dims: ParallelDims, role: str, seq_len: int, p: int) -> list[int]:
    """Whole sequences per micro-batch, 1 .. a mini-batch's sequences per rank, as token budgets. With
    shared prompts: a group's rows with their prompt (1 .. n-1 rows: a group split), then whole groups
    (what ``memory_model.micro_shape`` counts and the split packs)."""
    seqs = max(1, getattr(cfg, role).ppo_mini_batch_size * cfg.rollout.n // dims.dp)
    if seq_len == p + cfg.rollout.max_new_tokens:
        return [k * seq_len for k in range(1, seqs + 1)]
    n, r = cfg.rollout.n, cfg.rollout.max_new_tokens
    return [p + k * r for k in range(1, n)] + [k * (p + n * r) for k in range(1, max(1, seqs // n) + 1)]


def _offload_hint(cfg: JobConfig, dims: ParallelDims, a: ModelArgs, p: int, total: float, role: str) -> str:
    """What to set when even one sequence per micro-batch cannot train: the hybrid-device optimizer with
    the smallest host fraction that fits (if any does)."""
    trial = copy.deepcopy(cfg)
    o = getattr(trial, role).optim
    keys = (f"{role}.optim.backend=megatron {role}.optim.use_distributed_optimizer=true "
            f"{role}.optim.optimizer_cpu_offload=true")  # fmt: skip
    if not hasattr(o, "optimizer_cpu_offload"):
        return "the model's optimizer state does not fit on this GPU: shard it over more GPUs (TP/PP/DP)"
    o.backend, o.use_distributed_optimizer, o.optimizer_cpu_offload = "megatron", True, True
    for tenths in range(1, 11):
        o.optimizer_offload_fraction = tenths / 10
        est = estimate(trial, dims, a, p, {role: p + cfg.rollout.max_new_tokens})
        if _fits(est, f"{role}_update", total):
            host = est["bytes"]["optimizer_on_host"] / GIB
            return (f"keep optimizer state on the host: {keys} {role}.optim.optimizer_offload_fraction="
                    f"{tenths / 10} ({host:.0f} GiB of host memory per GPU), or shard over more GPUs")  # fmt: skip
    return f"even with {keys} {role}.optim.optimizer_offload_fraction=1.0 it does not fit: use more GPUs"


def _resolve_budget(cfg, dims, a, p, total, role, chosen, notes) -> None:
    w = getattr(cfg, role)
    key = f"{role}.ppo_max_token_len_per_gpu"
    s = seq_tokens(cfg, role, p)
    cands = _token_candidates(cfg, dims, role, s, p)
    best = _largest(
        cands, lambda b: _fits(estimate(cfg, dims, a, p, {**chosen, role: b}), f"{role}_update", total)
    )
    if not w.use_dynamic_bsz:
        if w.ppo_max_token_len_per_gpu == AUTO:
            raise ConfigError(
                f"{key}=auto needs {role}.use_dynamic_bsz=true (the budget sizes dynamic micro-batches)."
            )
        est = estimate(cfg, dims, a, p, chosen)
        if not _fits(est, f"{role}_update", total):
            fit = (
                _offload_hint(cfg, dims, a, p, total, role)
                if best is None
                else (f"{role}.use_dynamic_bsz=true {key}={best}")
            )
            raise ConfigError(_refusal(est, f"{role}_update", total, f"{role}.ppo_micro_batch_size_per_gpu="
                                       f"{w.ppo_micro_batch_size_per_gpu}", fit or ""))  # fmt: skip
        return
    if best is None:
        est = estimate(cfg, dims, a, p, {**chosen, role: s})
        raise ConfigError(_refusal(est, f"{role}_update", total, f"{key}={w.ppo_max_token_len_per_gpu}",
                                   _offload_hint(cfg, dims, a, p, total, role)))  # fmt: skip
    if w.ppo_max_token_len_per_gpu == AUTO:
        chosen[role] = best
        if s == p + cfg.rollout.max_new_tokens:
            notes[key] = f"auto -> {best} ({best // s} sequences of {s} tokens; the largest that fits)"
        else:
            seqs = micro_shape(cfg, role, p, best)[0]
            notes[key] = (f"auto -> {best} ({seqs} sequences per micro-batch: whole GRPO groups of "
                          f"{cfg.rollout.n} with their shared prompts; the largest that fits)")  # fmt: skip
    elif min(int(w.ppo_max_token_len_per_gpu), cands[-1]) > best:
        est = estimate(cfg, dims, a, p, chosen)
        raise ConfigError(_refusal(est, f"{role}_update", total, f"{key}={w.ppo_max_token_len_per_gpu}",
                                   f"{key}={best} (or {key}=auto)"))  # fmt: skip


def _resolve_slots(cfg, dims, a, p, total, chosen, notes) -> None:
    key, value = "rollout.max_num_seqs", cfg.rollout.max_num_seqs
    seqs, _ = gen_slots(cfg, dims, 1)
    best = _largest(list(range(1, seqs + 1)),
                    lambda n: _fits(estimate(cfg, dims, a, p, {**chosen, "max_num_seqs": n}), "generation", total))  # fmt: skip
    if best is None:
        est = estimate(cfg, dims, a, p, {**chosen, "max_num_seqs": 1})
        hint = "actor.optim.param_offload=true actor.optim.optimizer_offload=true (host while generating)"
        raise ConfigError(_refusal(est, "generation", total, f"{key}={value}", hint))
    if value == AUTO:
        chosen["max_num_seqs"] = best
        notes[key] = f"auto -> {best} KV-cache slots ({seqs} sequences per rank to generate)"
        if not cfg.rollout.kv_cache_tokens:  # size the cache for those slots, not from free memory, which the
            # allocator's cached blocks shrink after an update (measured: 512 planned, 208-467 decoded)
            chosen["kv_cache_tokens"] = best * (p + cfg.rollout.max_new_tokens)
            notes["rollout.kv_cache_tokens"] = (
                f"{chosen['kv_cache_tokens']} (the auto slots x {p} + max_new_tokens)"
            )
    elif min(int(value), seqs) > best:
        est = estimate(cfg, dims, a, p, chosen)
        raise ConfigError(
            _refusal(est, "generation", total, f"{key}={value}", f"{key}={best} (or {key}=auto)")
        )


def _refusal(est: dict, phase: str, total: float, key_value: str, fix: str) -> str:
    return (f"The memory model puts the {phase.replace('_', ' ')} peak at {est['peaks'][phase] / GIB:.1f} GiB per "
            f"GPU ({est['resident'] / GIB:.1f} GiB resident) with {key_value}; with its 15% headroom and "
            f"{RESERVE / GIB:.0f} GiB reserve that does not fit the {total / GIB:.1f} GiB GPU. Fix: {fix}. "
            f"(trainer.dry_run=true prints the whole estimate.)")  # fmt: skip


def plan(
    cfg: JobConfig, dims: ParallelDims, a: ModelArgs, p: int, total: float | None, dry_run: bool = False
) -> dict:
    """Resolve the ``auto`` keys of ``cfg`` (returned as {"actor": .., "critic": .., "max_num_seqs": ..},
    only those that were auto) and refuse what cannot fit. ``p``: the prompt length assumed; ``total``:
    the GPU's bytes (None: no GPU to fit, auto keys get the configured defaults' fallbacks). ``dry_run``:
    planning only (``trainer.dry_run``), so a machine without the GPU plans as the GPU run would."""
    chosen, notes = {}, {}
    roles = [r for r in trained_roles(cfg) if r != "ref"]
    absent = dry_run and total is not None and not torch.cuda.is_available()
    shares = {r: share_choice(cfg, r, absent) for r in roles if getattr(cfg, r).share_prompts == AUTO}
    if shares:
        cfg = copy.deepcopy(cfg)  # the estimates below see the choice; apply_plan writes it
        for r, (on, why) in shares.items():
            getattr(cfg, r).share_prompts = chosen[f"{r}_share_prompts"] = on
            if torch.cuda.is_available() or absent:  # on a CPU run it is always off: the note would be noise
                notes[f"{r}.share_prompts"] = f"auto -> {str(on).lower()} ({why})"
    if total is None:
        autos = [
            f"{r}.ppo_max_token_len_per_gpu"
            for r in roles
            if getattr(cfg, r).ppo_max_token_len_per_gpu == AUTO
        ]
        autos += ["rollout.max_num_seqs"] if cfg.rollout.max_num_seqs == AUTO else []
        if autos:
            raise ConfigError(f"{', '.join(autos)}=auto needs the GPU's memory: run on the GPU, or set "
                              f"trainer.gpu_memory_gb (e.g. 139.8 for an H200) to plan without one.")  # fmt: skip
        if cfg.rollout.keep_cache == AUTO:  # no GPU to plan for: no graphs to keep, the cache is freed
            chosen["keep_cache"] = False
        return {"chosen": chosen, "notes": notes}
    if cfg.rollout.keep_cache != AUTO:
        _resolve_all(cfg, dims, a, p, total, roles, chosen, notes)
        return {"chosen": chosen, "notes": notes}
    return _resolve_keep_cache(cfg, dims, a, p, total, roles, chosen, notes)


def _resolve_all(cfg, dims, a, p, total, roles, chosen, notes) -> None:
    for role in roles:
        _resolve_budget(cfg, dims, a, p, total, role, chosen, notes)
    _resolve_slots(cfg, dims, a, p, total, chosen, notes)


def _micro_batches(cfg: JobConfig, dims: ParallelDims, role: str, p: int, budget) -> int:
    """Update micro-batches of one mini-batch per rank at token budget ``budget`` (None: the configured)."""
    seqs = max(1, getattr(cfg, role).ppo_mini_batch_size * cfg.rollout.n // dims.dp)
    return math.ceil(seqs / micro_shape(cfg, role, p, budget)[0])


def _resolve_keep_cache(cfg, dims, a, p, total, roles, chosen, notes) -> dict:
    """``rollout.keep_cache=auto``: plan without the kept cache, then with it; keep it where the plan with it
    fits and gives every trained role the same number of update micro-batches (the kept cache then costs
    the update no step of its own), else plan without it."""
    off, on = copy.deepcopy(cfg), copy.deepcopy(cfg)
    off.rollout.keep_cache, on.rollout.keep_cache = False, True
    c_off, n_off = dict(chosen), dict(notes)
    _resolve_all(off, dims, a, p, total, roles, c_off, n_off)  # a refusal here is the job's own
    c_on, n_on = dict(chosen), dict(notes)
    try:
        _resolve_all(on, dims, a, p, total, roles, c_on, n_on)
    except ConfigError:
        c_on = None
    counts = {r: (_micro_batches(off, dims, r, p, c_off.get(r)), None if c_on is None else
                  _micro_batches(on, dims, r, p, c_on.get(r))) for r in roles}  # fmt: skip
    keep = c_on is not None and all(k == u for k, u in counts.values())
    chosen, notes = (c_on, n_on) if keep else (c_off, n_off)
    chosen["keep_cache"] = keep
    kept_gib = estimate(on, dims, a, p, c_on or c_off)["bytes"]["kept_generation"] / GIB
    per_role = ", ".join(
        f"{r} {k}" + ("" if u is None or u == k else f" -> {u}") for r, (k, u) in counts.items()
    )
    if keep:
        why = f"the KV cache and decode graphs ({kept_gib:.1f} GiB) fit beside the update: micro-batches {per_role}"
    elif c_on is None:
        why = f"the KV cache and decode graphs ({kept_gib:.1f} GiB) do not fit beside the update"
    else:
        why = f"kept ({kept_gib:.1f} GiB), they would cost the update micro-batches: {per_role}"
    notes["rollout.keep_cache"] = f"auto -> {str(keep).lower()} ({why})"
    return {"chosen": chosen, "notes": notes}


def apply_plan(cfg: JobConfig, chosen: dict) -> None:
    """Write the resolved values into ``cfg`` (in place), so everything built after sees numbers."""
    for role in ("actor", "critic"):
        if role in chosen:
            getattr(cfg, role).ppo_max_token_len_per_gpu = chosen[role]
        if f"{role}_share_prompts" in chosen:
            getattr(cfg, role).share_prompts = chosen[f"{role}_share_prompts"]
    if "max_num_seqs" in chosen:
        cfg.rollout.max_num_seqs = chosen["max_num_seqs"]
    if "kv_cache_tokens" in chosen:
        cfg.rollout.kv_cache_tokens = chosen["kv_cache_tokens"]
    if "keep_cache" in chosen:
        cfg.rollout.keep_cache = chosen["keep_cache"]
