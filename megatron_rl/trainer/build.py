"""Build everything a run needs on this rank: models (actor, ref, critic), engine, data, rewards, logger."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from megatron_rl.checkpoint import Checkpointer, ModelSide, TrainedRole
from megatron_rl.checkpoint.checkpointer import hf_source_dir
from megatron_rl.config.schema import JobConfig, LoRAConfig
from megatron_rl.data import PromptDataLoader, PromptDataset
from megatron_rl.data.tokenizer_fit import check_tokenizer_fits
from megatron_rl.distributed import ParallelDims
from megatron_rl.logging import MetricsLogger
from megatron_rl.models import ModelArgs, build_model, load_hf_weights
from megatron_rl.rewards import build_reward_fn
from megatron_rl.rewards.reward_model import RewardModelScorer
from megatron_rl.rollout.engine import EngineConfig, RolloutEngine
from megatron_rl.rollout.multi_turn import MultiTurn, build_multi_turn
from megatron_rl.rollout.sampling import logprob_temperature
from megatron_rl.tasks import register_builtin_tasks, secret_digit
from megatron_rl.tasks.last_digit import prepare_builtin_task
from megatron_rl.trainer.advantage import build_kl_controller
from megatron_rl.trainer.memory_model import micro_shape, scored_rows
from megatron_rl.trainer.workers import CriticWorker, PolicyWorker

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Components:
    cfg: JobConfig
    dims: ParallelDims
    args: ModelArgs
    tokenizer: object
    actor: PolicyWorker
    ref: PolicyWorker | None
    critic: CriticWorker | None
    engine: RolloutEngine
    train_loader: PromptDataLoader
    val_dataset: PromptDataset | None
    reward_fn: object
    reward_model: RewardModelScorer | None
    kl_ctrl: object
    logger: MetricsLogger
    total_steps: int
    checkpointer: Checkpointer
    multi_turn: MultiTurn | None = None  # rollout.multi_turn.enable: tools, parser, the tool thread pool


def _resolve_paths(cfg: JobConfig) -> tuple[str, str | None, str | None, bool]:
    """Model dir and data files; the built-in task fills in whatever is unset."""
    data, model = cfg.data, cfg.model
    if model.path is not None and data.train_files is not None:
        return model.path, data.train_files, data.val_files, data.apply_chat_template
    workdir = Path(cfg.trainer.output_dir) / "builtin_task"
    builtin_data = data.train_files is None
    mt = cfg.rollout.multi_turn
    tool_task = mt.enable and mt.tool_path == secret_digit.TOOL_SET  # the tool-using built-in task
    if tool_task:
        model_dir, train, val = secret_digit.prepare_tool_task(model, workdir, cfg.trainer.seed)
    else:
        model_dir, train, val = prepare_builtin_task(model, workdir, cfg.trainer.seed, builtin_data)
    return (
        model.path or model_dir,
        train if builtin_data else data.train_files,
        val if builtin_data and data.val_files is None else data.val_files,
        # the built-in task's prompts are plain text; the tool task's are chat (tool answers need turns)
        data.apply_chat_template and (tool_task or not builtin_data),
    )


def _model(
    args: ModelArgs,
    role: str,
    dtype: torch.dtype,
    weights_dir: str,
    sp: bool,
    recompute: dict | None = None,
    lora: LoRAConfig | None = None,
    exact: bool = False,
) -> torch.nn.Module:
    """Build and load one role; the whole module is cast to ``dtype`` (megatron-core's norms are created
    in fp32 whatever ``params_dtype`` says; its Float16Module casts likewise)."""
    model = build_model(args, role, dtype, sequence_parallel=sp, recompute=recompute, lora=lora, exact=exact)
    load_hf_weights(model, weights_dir, args, role=role)
    return model.to(dtype)


def _build_models(cfg: JobConfig, args: ModelArgs, model_dir: str, total_steps: int):
    dtype, r, sp = DTYPES[cfg.model.dtype], cfg.rollout.max_new_tokens, cfg.parallel.sequence_parallel
    temperature = logprob_temperature(cfg.rollout.temperature)  # greedy rollouts score at T = 1
    lora = cfg.actor.lora
    exact = cfg.rollout.exact_logprobs  # actor and reference share the engine's batch-invariant kernels
    actor_model = _model(args, "actor", dtype, model_dir, sp, cfg.actor.recompute_kwargs(), lora, exact)
    cut = (cfg.rollout.top_k, cfg.rollout.top_p)
    actor = PolicyWorker(
        actor_model, cfg.actor, temperature, args.vocab_size, total_steps, r, exact=exact, truncation=cut
    )
    ref = None
    if (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and lora.enabled:
        # the reference policy is the base model: the actor with its adapters switched off
        ref = PolicyWorker(
            actor_model, cfg.actor, temperature, args.vocab_size, total_steps, r, trainable=False,
            adapters_off=True, exact=exact,
        )  # fmt: skip
    elif cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        ref_model = _model(args, "ref", dtype, model_dir, sp, exact=exact)
        ref = PolicyWorker(
            ref_model,
            cfg.actor,
            temperature,
            args.vocab_size,
            total_steps,
            r,
            trainable=False,
            offload_to_cpu=cfg.ref.offload_to_cpu,
            exact=exact,
        )
    critic = None
    if cfg.algorithm.adv_estimator == "gae":
        critic_dir = cfg.model.critic_path or model_dir
        critic_model = _model(
            args, "critic", dtype, critic_dir, sp, cfg.critic.recompute_kwargs(), cfg.critic.lora
        )
        critic = CriticWorker(critic_model, cfg.critic, total_steps, r)
    fused = {name: w.opt.fused for name, w in (("actor", actor), ("critic", critic)) if w is not None}
    if torch.distributed.get_rank() == 0:  # optim.gradient_accumulation_fusion as resolved (auto: CUDA only)
        print("gradient accumulation fusion: " + ", ".join(f"{k} {'on' if v else 'off'}" for k, v in fused.items()),
              flush=True)  # fmt: skip
    return actor, ref, critic


def fit_to_gpu(cfg: JobConfig, dims: ParallelDims, args: ModelArgs, prompt_len: int) -> None:
    """Resolve the ``auto`` budgets in ``cfg`` and refuse a job the memory model says cannot fit (the
    ``ConfigError`` names the key and a value that fits); rank 0 prints what auto chose."""
    from megatron_rl.trainer.memory_plan import apply_plan, gpu_memory_bytes, plan

    total = gpu_memory_bytes(cfg)[0]
    if total is not None and torch.distributed.get_world_size() > 1:  # every rank plans for the smallest GPU
        t = torch.tensor([total], dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        total = float(t)
    fitted = plan(cfg, dims, args, prompt_len, total)
    apply_plan(cfg, fitted["chosen"])
    if fitted["notes"] and torch.distributed.get_rank() == 0:
        print("memory plan: " + "; ".join(f"{k}: {v}" for k, v in fitted["notes"].items()), flush=True)


def _reward_fn(cfg: JobConfig):
    rw = cfg.reward
    if rw.reward_fn == "model":
        return None
    register_builtin_tasks()
    return build_reward_fn(
        rw.reward_fn,
        rw.custom_reward_function.path,
        rw.custom_reward_function.name,
        format_score=rw.format_score,
        gsm8k_method=rw.gsm8k_mode,
    )


def build_checkpointer(cfg: JobConfig, dims: ParallelDims, args: ModelArgs, tokenizer, actor, critic, loader,
                       kl_ctrl, total_steps: int) -> Checkpointer:  # fmt: skip
    """The checkpointer, handed the trained roles and every stateful part it saves."""
    roles = {"actor": TrainedRole(actor.model, actor.opt)}
    if critic is not None:
        roles["critic"] = TrainedRole(critic.model, critic.opt)
    side = ModelSide(args, tokenizer, hf_source_dir(tokenizer), dims.tp, dims.pp, dims.dp, dims.world_size)
    return Checkpointer(cfg.trainer, roles, data_loader=loader, kl_ctrl=kl_ctrl, side=side,
                        config=dataclasses.asdict(cfg), total_steps=total_steps)  # fmt: skip


def build_components(cfg: JobConfig, dims: ParallelDims) -> Components:
    reward_fn = _reward_fn(cfg)  # a bad custom function path fails before models are built
    model_dir, train_files, val_files, chat = _resolve_paths(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = ModelArgs.from_hf_config(model_dir, tp=dims.tp)
    check_tokenizer_fits(
        tokenizer, args.vocab_size, model_dir
    )  # before the data is tokenized or weights load
    multi_turn = build_multi_turn(cfg.rollout.multi_turn, tokenizer)  # a bad tool file fails here
    data = cfg.data
    dataset_kw = dict(
        tokenizer=tokenizer,
        prompt_key=data.prompt_key,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        apply_chat_template=chat,
        tools=multi_turn.tool_set.schemas if multi_turn else None,
    )
    train_ds = PromptDataset(train_files, files_key="data.train_files", **dataset_kw)
    loader = PromptDataLoader(
        train_ds, data.train_batch_size, data.shuffle, data.seed, cfg.trainer.total_epochs
    )
    val_ds = PromptDataset(val_files, files_key="data.val_files", **dataset_kw) if val_files else None
    total = min(cfg.trainer.total_training_steps, loader.steps_per_epoch * cfg.trainer.total_epochs)
    args = ModelArgs.from_hf_config(model_dir, tp=dims.tp)
    prompt_len = max(len(r.prompt_ids) for r in train_ds.rows)
    fit_to_gpu(cfg, dims, args, prompt_len)  # before any weights load
    actor, ref, critic = _build_models(cfg, args, model_dir, total)
    if cfg.actor.use_dynamic_bsz:  # the LM-head rows the plan sized the logits for bound every micro-batch
        for policy in (actor, ref):
            if policy is not None:
                policy.max_scored = scored_rows(cfg, "actor", prompt_len)
    for role, worker in (("actor", actor), ("actor", ref), ("critic", critic)):
        w = getattr(cfg, role)
        if worker is not None and w.use_dynamic_bsz and w.share_prompts is True:
            # shared micro-batches: the tokens the plan counts (whole groups within the budget), so that
            # short responses cannot fit more groups than it sized the activations for
            worker.max_tokens = micro_shape(cfg, role, prompt_len)[1]
    engine_cfg = EngineConfig.from_config(cfg.rollout)
    reward_model = None
    if cfg.reward.reward_fn == "model":
        reward_model = RewardModelScorer(
            cfg.reward.reward_model_path,
            dims.tp,
            DTYPES[cfg.model.dtype],
            cfg.actor.ppo_micro_batch_size_per_gpu,
            args.vocab_size,
        )
    engine = RolloutEngine(actor.model, args, engine_cfg)
    logger = MetricsLogger(
        cfg.trainer.logger,
        cfg.trainer.output_dir,
        cfg.trainer.project_name,
        cfg.trainer.experiment_name,
        config=dataclasses.asdict(cfg),
        rank=torch.distributed.get_rank(),
        total_steps=total,
        wandb_mode=cfg.logger.wandb_mode,
        mlflow_tracking_uri=cfg.logger.mlflow_tracking_uri,
    )
    kl_ctrl = build_kl_controller(cfg.algorithm)
    for worker in (actor, critic):
        if worker is not None:
            worker.skip_nonfinite = cfg.trainer.skip_nonfinite_steps
    checkpointer = build_checkpointer(cfg, dims, args, tokenizer, actor, critic, loader, kl_ctrl, total)
    return Components(
        cfg,
        dims,
        args,
        tokenizer,
        actor,
        ref,
        critic,
        engine,
        loader,
        val_ds,
        reward_fn,
        reward_model,
        kl_ctrl,
        logger,
        total,
        checkpointer,
        multi_turn,
    )
