"""Start-up validation of a ``JobConfig`` against the world size, before any process group or GPU work.

Every error names the config key(s) at fault and a value that would work.
"""

from __future__ import annotations

import warnings

from megatron_rl import algos
from megatron_rl.config.rollout_rules import check_engine, check_sampling
from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.dims import LayoutError, ParallelDims, divisors

OPTIM_BACKENDS = ("local", "megatron")


def choices() -> dict[str, tuple]:
    """Allowed values per key. Algorithm choices are read from the registries in megatron_rl.algos at
    check time (one list per concept), so a newly registered estimator, loss or mode is accepted."""
    agg, kl = algos.LOSS_AGG_MODES, algos.kl_kind_names()
    return {
        "algorithm.adv_estimator": algos.advantage_estimator_names(),
        "algorithm.kl_penalty": kl,
        "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
        "actor.loss_agg_mode": agg,
        "actor.policy_loss": algos.policy_loss_names(),
        "actor.kl_loss_type": kl,
        "actor.tis_mode": (None, *algos.IS_MODES.names()),
        "actor.rollout_rs": (None, *algos.REJECTION_MODES.names()),
        "critic.loss_agg_mode": agg,
        "data.truncation": ("error", "left", "right", "filter"),
        "model.dtype": ("float32", "bfloat16"),
        "trainer.resume_mode": ("auto", "disable", "path"),
        "reward.reward_fn": ("auto", "gsm8k", "math", "custom", "builtin", "model"),
        "reward.gsm8k_mode": ("strict", "flexible"),
        "actor.optim.lr_decay_style": ("constant", "linear", "cosine"),
        "critic.optim.lr_decay_style": ("constant", "linear", "cosine"),
        "actor.optim.backend": OPTIM_BACKENDS,
        "critic.optim.backend": OPTIM_BACKENDS,
        "logger.wandb_mode": ("offline", "online", "disabled"),
    }


LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


class ConfigError(LayoutError):
    """A configuration value that cannot work; the message names the key and a fix."""


def _get(cfg: JobConfig, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _check_choices(cfg: JobConfig) -> None:
    for key, allowed in choices().items():
        value = _get(cfg, key)
        if value not in allowed:
            shown = " | ".join("null" if a is None else str(a) for a in allowed)
            raise ConfigError(f"{key}={value!r} is not one of: {shown}. Set {key} to one of those.")
    bad = [b for b in cfg.trainer.logger if b not in LOGGERS]
    if bad:
        raise ConfigError(
            f"trainer.logger has unknown backend(s) {bad}; valid: {', '.join(LOGGERS)}. "
            f"Example: trainer.logger=[console,jsonl]."
        )


def _check_positive(cfg: JobConfig, keys: tuple[str, ...]) -> None:
    for key in keys:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 1.")


def _slots(value) -> int:
    """rollout.max_num_seqs as the engine's checks see it: auto is resolved later by the memory plan."""
    return 1 if value == "auto" else value


def _check_rollout(cfg: JobConfig, training: bool) -> None:
    """The engine's and the sampler's own rules (``rollout_rules``) on the configured values, for the
    training and the validation temperature; a note when greedy rollouts are trained on."""
    r = cfg.rollout
    try:
        check_engine(gpu_memory_utilization=r.gpu_memory_utilization, max_num_seqs=_slots(r.max_num_seqs),
                     max_prefill_tokens=r.max_prefill_tokens, kv_cache_tokens=r.kv_cache_tokens)  # fmt: skip
        for key in ("rollout.temperature", "rollout.val_temperature"):
            check_sampling(temperature=_get(cfg, key), top_p=r.top_p, top_k=r.top_k, n=r.n,
                           max_new_tokens=r.max_new_tokens, key=key)  # fmt: skip
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if r.keep_cache != "auto" and not isinstance(r.keep_cache, bool):
        raise ConfigError(f"rollout.keep_cache={r.keep_cache}: use true, false or auto.")
    if training and r.temperature == 0:
        warnings.warn(
            "rollout.temperature=0: greedy rollouts. Rollout and training log-probs are scored at temperature "
            "1.0 (a greedy choice has no temperature to divide by); with rollout.n > 1 every sample of a "
            "prompt is the same, so group-relative advantages are 0. Set rollout.temperature > 0 to explore.",
            stacklevel=2,
        )


def _check_exact_logprobs(cfg: JobConfig) -> None:
    """rollout.exact_logprobs: its kernels run the engine's TP shards as the trainer's (same TP size), without
    sequence parallelism, on plain causal attention."""
    if not cfg.rollout.exact_logprobs:
        return
    from megatron_rl.kernels.batch_invariant import exact_batched_choice, exact_gemm_choice

    try:
        exact_gemm_choice()
        exact_batched_choice()
    except ValueError as err:
        raise ConfigError(f"rollout.exact_logprobs=true: {err}.") from None
    par, tp_g = cfg.parallel, cfg.rollout.tensor_model_parallel_size
    tp = par.tensor_model_parallel_size
    clashes = [
        (
            tp_g not in (None, tp),
            f"rollout.tensor_model_parallel_size={tp_g} != parallel.tensor_model_parallel_size={tp}",
        ),
        (par.sequence_parallel, "parallel.sequence_parallel=true"),
        (cfg.actor.lora.enabled, f"actor.lora.rank={cfg.actor.lora.rank}"),
        (cfg.rollout.multi_turn.enable, "rollout.multi_turn.enable=true"),
    ]
    bad = [name for clash, name in clashes if clash]
    if bad:
        raise ConfigError(
            f"rollout.exact_logprobs=true is incompatible with {', '.join(bad)}: the engine must hold the "
            "trainer's TP shards (the partial sums and vocab shards are combined in rank order on both "
            "sides), sequence parallelism's reduce-scatter and LoRA side paths have no batch-invariant form, "
            "and a later turn's prefill onto a cached slot is not batch-invariant. Leave "
            "rollout.tensor_model_parallel_size unset (or equal to the training TP) with "
            "parallel.sequence_parallel=false, no LoRA and single-turn rollouts, or set "
            "rollout.exact_logprobs=false."
        )


def _check_update_batches(cfg: JobConfig, role: str, dp: int) -> int:
    """Mini/micro-batch divisibility for the actor or critic; returns micro-batches per mini-batch."""
    n, global_bs = cfg.rollout.n, cfg.data.train_batch_size
    mini = _get(cfg, f"{role}.ppo_mini_batch_size")
    micro = _get(cfg, f"{role}.ppo_micro_batch_size_per_gpu")
    if mini > global_bs or global_bs % mini != 0:
        ok = [d for d in divisors(global_bs)]
        raise ConfigError(
            f"{role}.ppo_mini_batch_size={mini} must divide data.train_batch_size={global_bs} "
            f"(both count prompts). Valid values: {ok}."
        )
    seqs_per_rank, rem = divmod(mini * n, dp)
    if rem or seqs_per_rank == 0:
        raise ConfigError(
            f"A mini-batch of {role}.ppo_mini_batch_size={mini} prompts x rollout.n={n} = {mini * n} "
            f"sequences does not split evenly over the data-parallel size {dp} (world / (TP x PP)). "
            f"Make {role}.ppo_mini_batch_size * rollout.n a multiple of {dp}."
        )
    share = _get(cfg, f"{role}.share_prompts")
    if share != "auto" and not isinstance(share, bool):  # 1 == True: an int would pass an `in` test
        raise ConfigError(f"{role}.share_prompts={share!r}: use true, false or auto.")
    budget = _get(cfg, f"{role}.ppo_max_token_len_per_gpu")
    if budget != "auto" and not (isinstance(budget, int) and budget > 0):
        raise ConfigError(f"{role}.ppo_max_token_len_per_gpu={budget!r}: use a positive token count or auto.")
    if _get(cfg, f"{role}.use_dynamic_bsz"):
        longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
        if budget == "auto":  # resolved from the memory model before the models are built
            return max(1, seqs_per_rank // 2)
        if budget < longest:
            raise ConfigError(
                f"{role}.ppo_max_token_len_per_gpu={budget} cannot hold one sequence of data.max_prompt_length + "
                f"rollout.max_new_tokens = {longest} tokens. Set it to at least {longest} (a few times that "
                f"for efficient micro-batches), or {role}.use_dynamic_bsz=false."
            )  # fmt: skip
        return max(1, seqs_per_rank * longest // budget)
    if seqs_per_rank % micro != 0:
        ok = divisors(seqs_per_rank)
        raise ConfigError(
            f"{role}.ppo_micro_batch_size_per_gpu={micro} must divide the {seqs_per_rank} sequences each "
            f"rank holds per mini-batch ({role}.ppo_mini_batch_size={mini} x rollout.n={n} / DP={dp}). "
            f"Valid values: {ok}."
        )
    return seqs_per_rank // micro


# (test, the range in words, a value that works) per optimizer key; lr=0 freezes the weights (allowed),
# clip_grad=0 turns clipping off
OPTIM_RANGES = {
    "lr": (lambda v: v >= 0, ">= 0", "1e-6"),
    "weight_decay": (lambda v: v >= 0, ">= 0", "0.01"),
    "eps": (lambda v: v > 0, "> 0", "1e-8"),
    "clip_grad": (lambda v: v >= 0, ">= 0 (0 = no clipping)", "1.0"),
    "lr_warmup_steps": (lambda v: v >= 0, ">= 0", "0"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]", "0.0"),
}


def _check_optim_values(optim, role: str) -> None:
    for name, (ok, allowed, example) in OPTIM_RANGES.items():
        value = getattr(optim, name)
        if not ok(value):
            raise ConfigError(
                f"{role}.optim.{name}={value} must be {allowed}; e.g. {role}.optim.{name}={example}."
            )
    betas = list(optim.betas)
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError(
            f"{role}.optim.betas={betas} must be two values in [0, 1) (Adam's beta1, beta2); "
            f"e.g. {role}.optim.betas=[0.9,0.999]."
        )


def _check_optim(cfg: JobConfig, role: str) -> None:
    optim = _get(cfg, f"{role}.optim")
    _check_optim_values(optim, role)
    fusion = optim.gradient_accumulation_fusion
    if fusion != "auto" and not isinstance(fusion, bool):
        raise ConfigError(f"{role}.optim.gradient_accumulation_fusion={fusion!r}: use true, false or auto.")
    if optim.use_distributed_optimizer and optim.backend != "megatron":
        raise ConfigError(
            f"{role}.optim.use_distributed_optimizer=true needs {role}.optim.backend=megatron (the local "
            f"backend keeps full optimizer state on every rank). Set {role}.optim.backend=megatron, or "
            f"{role}.optim.use_distributed_optimizer=false."
        )
    if optim.optimizer_cpu_offload:
        _check_hybrid_optim(cfg, optim, role)


def _check_hybrid_optim(cfg: JobConfig, optim, role: str) -> None:
    """megatron-core's hybrid-device optimizer: inside its distributed optimizer, on bf16 weights (0.16.1
    hands it non-leaf views of fp32 weights, which torch optimizers refuse)."""
    k = f"{role}.optim"
    if optim.backend != "megatron" or not optim.use_distributed_optimizer:
        raise ConfigError(
            f"{k}.optimizer_cpu_offload=true is megatron-core's hybrid-device optimizer, which runs inside its "
            f"distributed optimizer: set {k}.backend=megatron {k}.use_distributed_optimizer=true, or "
            f"{k}.optimizer_cpu_offload=false."
        )
    if not 0.0 <= optim.optimizer_offload_fraction <= 1.0:
        raise ConfigError(
            f"{k}.optimizer_offload_fraction={optim.optimizer_offload_fraction} must lie in [0, 1]: the fraction "
            f"of the optimizer state that {k}.optimizer_cpu_offload=true keeps on the host."
        )
    on = [f"{k}.{n}=true" for n in ("param_offload", "optimizer_offload") if getattr(optim, n)]
    if on:
        raise ConfigError(
            f"{' '.join(on)} with {k}.optimizer_cpu_offload=true: the hybrid optimizer already keeps the "
            f"offloaded fraction on the host and holds its main params itself; use one or the other (raise "
            f"{k}.optimizer_offload_fraction instead)."
        )
    if cfg.model.dtype != "bfloat16":
        raise ConfigError(
            f"{k}.optimizer_cpu_offload=true needs model.dtype=bfloat16 (megatron-core's hybrid optimizer keeps "
            f"its own fp32 main params of bf16 weights; it cannot step fp32 weights), got "
            f"model.dtype={cfg.model.dtype}. Set model.dtype=bfloat16 or {k}.optimizer_cpu_offload=false."
        )


RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")


def _check_recompute(cfg: JobConfig, role: str, layers_per_stage: int | None) -> None:
    """megatron-core's own rules for the recompute fields, checked here so the message names our keys."""
    w = _get(cfg, role)
    gran, method, n = w.recompute_granularity, w.recompute_method, w.recompute_num_layers
    if gran not in (None, "selective", "full"):
        raise ConfigError(f"{role}.recompute_granularity={gran!r}: use null, selective or full.")
    if gran == "full":
        if method not in ("uniform", "block"):
            raise ConfigError(f"{role}.recompute_granularity=full needs {role}.recompute_method=uniform|block "
                              f"(got {method!r}).")  # fmt: skip
        top = layers_per_stage or n or 1
        if not isinstance(n, int) or not 1 <= n <= top:
            raise ConfigError(f"{role}.recompute_num_layers={n!r} with recompute_granularity=full: set it to "
                              f"1..{top} (layers per pipeline stage); 1 with uniform recomputes every layer.")  # fmt: skip
    elif method is not None or n is not None:
        raise ConfigError(f"{role}.recompute_method / recompute_num_layers apply to recompute_granularity=full "
                          f"only (granularity is {gran!r}); set them to null.")  # fmt: skip
    bad = set(w.recompute_modules) - set(RECOMPUTE_MODULES)
    if gran == "selective" and (bad or not w.recompute_modules):
        raise ConfigError(f"{role}.recompute_modules={list(w.recompute_modules)}: choose from "
                          f"{list(RECOMPUTE_MODULES)} (at least one) with recompute_granularity=selective.")  # fmt: skip


def _check_lora(cfg: JobConfig, role: str) -> None:
    """``<role>.lora``: rank >= 0 (0 = off), alpha > 0, 0 <= dropout < 1, known targets and init."""
    lora, key = getattr(cfg, role).lora, f"{role}.lora"
    if not isinstance(lora.rank, int) or lora.rank < 0:
        raise ConfigError(f"{key}.rank={lora.rank!r} must be an integer >= 0 (0 = off, e.g. {key}.rank=16).")
    if not lora.enabled:
        return
    # imported only with LoRA on: megatron_rl.models imports megatron-core (~5 s on a CPU), which a job with a
    # configuration error further on in validate_job should not wait for
    from megatron_rl.models.lora import LORA_INITS, TARGETS

    if not lora.alpha > 0:
        raise ConfigError(f"{key}.alpha={lora.alpha} must be > 0 (the scale is alpha / rank; e.g. 2 x rank).")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"{key}.dropout={lora.dropout} must be in [0, 1) (e.g. 0.05, or 0 for none).")
    bad = [t for t in lora.target_modules if t not in TARGETS]
    if bad or not lora.target_modules or len(set(lora.target_modules)) != len(lora.target_modules):
        raise ConfigError(
            f"{key}.target_modules={list(lora.target_modules)}: use a non-empty list without repeats of "
            f"{' | '.join(TARGETS)}, e.g. {key}.target_modules=[{','.join(TARGETS)}]."
        )
    if lora.init not in LORA_INITS:
        raise ConfigError(f"{key}.init={lora.init!r} is not one of: {' | '.join(LORA_INITS)}.")


def _check_algorithm_settings(cfg: JobConfig) -> None:
    """Bounds of the DAPO / estimator / rollout-correction settings that only fail deep inside a step."""
    n, max_new = cfg.rollout.n, cfg.rollout.max_new_tokens
    buffer = cfg.reward.overlong_buffer.len
    if not 0 <= buffer < max_new:
        raise ConfigError(
            f"reward.overlong_buffer.len={buffer} must be in [0, rollout.max_new_tokens={max_new}); "
            f"set it to e.g. {max(1, max_new // 4)} (or 0 to turn the overlong penalty off)."
        )
    needs_groups = {
        "algorithm.filter_groups.enable=true": cfg.algorithm.filter_groups.enable,
        "algorithm.adv_estimator=grpo_passk": cfg.algorithm.adv_estimator == "grpo_passk",
    }
    for what, on in needs_groups.items():
        if on and n < 2:
            raise ConfigError(f"{what} compares the samples of a prompt: set rollout.n >= 2 (it is {n}).")
    if cfg.algorithm.filter_groups.max_num_gen_batches < 1:
        raise ConfigError("algorithm.filter_groups.max_num_gen_batches must be >= 1 (1 = no extra rounds).")
    a = cfg.actor
    bounds = {"actor.tis_low / actor.tis_cap": (a.tis_mode, a.tis_low, a.tis_cap)}
    bounds["actor.rollout_rs_low / actor.rollout_rs_high"] = (
        a.rollout_rs,
        a.rollout_rs_low,
        a.rollout_rs_high,
    )
    for keys, (mode, low, high) in bounds.items():
        if mode is not None and not 0 < low <= 1 <= high:
            raise ConfigError(f"{keys} = {low} / {high} must satisfy 0 < low <= 1 <= high (ratio bounds).")


def validate_job(
    cfg: JobConfig, world_size: int, num_layers: int | None = None, training: bool = True
) -> ParallelDims:
    """Check the job against ``world_size``; return the layout. Raises ``LayoutError``/``ConfigError``.

    ``training=False`` (``megatron-rl generate``) skips the update batch-size checks."""
    par = cfg.parallel
    dims = ParallelDims.build(
        world_size, par.tensor_model_parallel_size, par.pipeline_model_parallel_size, num_layers=num_layers
    )
    _check_choices(cfg)
    _check_positive(
        cfg,
        (
            "data.train_batch_size",
            "data.max_prompt_length",
            "actor.ppo_epochs",
            "critic.ppo_epochs",
            "trainer.total_training_steps",
        ),
    )
    slots = cfg.rollout.max_num_seqs
    if slots != "auto" and not (isinstance(slots, int) and slots > 0):
        raise ConfigError(f"rollout.max_num_seqs={slots!r}: use a positive number of sequences or auto.")
    if not cfg.trainer.timeout_minutes > 0:
        raise ConfigError(
            f"trainer.timeout_minutes={cfg.trainer.timeout_minutes} must be > 0 (minutes, fractions allowed); "
            "e.g. trainer.timeout_minutes=30."
        )
    if not cfg.trainer.manual_gc_interval >= 0:
        raise ConfigError(
            f"trainer.manual_gc_interval={cfg.trainer.manual_gc_interval} must be >= 0 (0 = Python's automatic "
            "garbage collection; N > 0 = a collection every N steps), e.g. trainer.manual_gc_interval=0."
        )
    _check_rollout(cfg, training)
    _check_exact_logprobs(cfg)
    if par.sequence_parallel and par.tensor_model_parallel_size == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1.")
    tp_g = cfg.rollout.tensor_model_parallel_size
    if tp_g is not None and (tp_g < 1 or par.tensor_model_parallel_size % tp_g != 0):
        raise ConfigError(
            f"rollout.tensor_model_parallel_size={tp_g} must divide parallel.tensor_model_parallel_size="
            f"{par.tensor_model_parallel_size}. Valid: {divisors(par.tensor_model_parallel_size)}."
        )
    if not training:
        return dims
    per_stage = num_layers // dims.pp if num_layers else None
    _check_algorithm_settings(cfg)
    _check_lora(cfg, "actor")
    _check_lora(cfg, "critic")
    _check_update_batches(cfg, "actor", dims.dp)
    _check_optim(cfg, "actor")
    _check_recompute(cfg, "actor", per_stage)
    if cfg.algorithm.adv_estimator == "gae":
        _check_update_batches(cfg, "critic", dims.dp)
        _check_optim(cfg, "critic")
        _check_recompute(cfg, "critic", per_stage)
    if cfg.reward.reward_fn == "model" and not cfg.reward.reward_model_path:
        raise ConfigError(
            "reward.reward_fn=model needs reward.reward_model_path=<HF sequence-classification dir>."
        )
    if cfg.trainer.resume_mode == "path" and not cfg.trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=path needs trainer.resume_from_path=<checkpoint dir>.")
    return dims
