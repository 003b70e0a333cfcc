"""The job configuration: one dataclass per component, defined once.

Hydra composes YAML groups from ``configs/`` over these dataclasses (registered in ``store.py``); the
entry point converts the result to ``JobConfig`` and library code receives only dataclasses.
Key names follow verl where a verl user would look for them (``data.train_batch_size``,
``actor.ppo_mini_batch_size``, ``rollout.n``, ``algorithm.kl_ctrl.kl_coef``...), and megatron-core's for
parallel sizes. Every field carries its documentation in the ``doc`` metadata; the README's config
reference is generated from it (``python -m megatron_rl.config.reference``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


def doc(default: Any, text: str, **kw) -> Any:
    """A dataclass field with a default and its documentation."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": text}, **kw)
    return field(default=default, metadata={"doc": text}, **kw)


@dataclass
class ModelConfig:
    """The policy model. With ``path`` unset, the built-in tiny model (defined in code) is used."""

    name: str = doc("tiny", "Label of the model preset (set by the YAML group, e.g. model=qwen2_5_0_5b).")
    path: Optional[str] = doc(None, "HF model directory or one of our checkpoints; None = built-in tiny.")
    critic_path: Optional[str] = doc(
        None, "HF sequence-classification checkpoint for the critic; None = initialise from the actor."
    )
    dtype: str = doc("float32", "Parameter/compute dtype: float32 | bfloat16.")
    num_layers: int = doc(2, "Built-in tiny model only: transformer layers.")
    hidden_size: int = doc(64, "Built-in tiny model only: hidden size.")
    num_attention_heads: int = doc(4, "Built-in tiny model only: attention heads.")
    num_key_value_heads: int = doc(2, "Built-in tiny model only: KV heads (GQA groups).")
    ffn_hidden_size: int = doc(128, "Built-in tiny model only: MLP hidden size.")


@dataclass
class ParallelConfig:
    """Parallel layout (megatron-core names). DP is what the world size leaves: world / (TP x PP)."""

    tensor_model_parallel_size: int = doc(1, "Tensor-parallel size (TP).")
    pipeline_model_parallel_size: int = doc(1, "Pipeline-parallel size (PP); must divide the layer count.")
    sequence_parallel: bool = doc(False, "megatron-core sequence parallelism (GPU only, needs TP > 1).")


@dataclass
class MultiTurnConfig:
    """Multi-turn, tool-using rollouts (see the README's "Tools and multi-turn rollouts")."""

    enable: bool = doc(
        False, "Continue each response over turns: tool calls run, their answers are appended."
    )
    tool_path: Optional[str] = doc(
        None,
        "A .py file defining get_tools() (and optionally get_interaction()), or a built-in tool set: calculator.",
    )
    parser: str = doc(
        "hermes", "Tool-call format of the model's template: hermes (Qwen2.5/Qwen3 <tool_call>{json})."
    )
    max_turns: int = doc(4, "Assistant turns per episode at most (tool answers and user turns come between).")
    tool_timeout_s: float = doc(10.0, "Seconds a tool call may run; past it the model reads a timeout error.")
    max_parallel_calls: int = doc(8, "Threads running tool calls concurrently (per generating rank).")
    max_tool_response_chars: int = doc(1000, "Tool answers are cut to this many characters.")

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"rollout.multi_turn.max_turns={self.max_turns}; set it to 1 or more")
        if self.tool_timeout_s <= 0 or self.max_parallel_calls < 1:
            raise ValueError(
                "rollout.multi_turn.tool_timeout_s must be > 0 and rollout.multi_turn.max_parallel_calls >= 1 "
                f"(got {self.tool_timeout_s}, {self.max_parallel_calls})"
            )


@dataclass
class RolloutConfig:
    """Generation with the in-place resharded engine."""

    n: int = doc(1, "Samples per prompt (GRPO group size).")
    temperature: float = doc(
        1.0,
        "Sampling temperature; training log-probs use it too. 0 = greedy rollouts, whose log-probs (rollout "
        "and training) are then scored at temperature 1.0.",
    )
    top_p: float = doc(1.0, "Nucleus sampling threshold (1.0 = off).")
    top_k: int = doc(-1, "Top-k sampling (-1 = off).")
    max_new_tokens: int = doc(16, "Response length limit (verl: data.max_response_length).")
    stop_token_ids: list = doc([], "Extra stop token ids besides the tokenizer's EOS.")
    tensor_model_parallel_size: Optional[int] = doc(
        None, "Generation TP size (TP_g); must divide parallel.tensor_model_parallel_size. None = same."
    )
    kv_cache_tokens: int = doc(0, "KV-cache size in tokens per rank; 0 = sized from the batch.")
    gpu_memory_utilization: float = doc(
        0.5, "With kv_cache_tokens=0 on GPU: cap as a fraction of free memory."
    )
    max_num_seqs: Any = doc(
        1024,
        "Sequences decoded together per rank (KV-cache slots); more wait and enter as others finish. auto = "
        "the most the memory model fits on the GPU.",
    )
    max_prefill_tokens: int = doc(16384, "Padded prompt tokens per prefill batch (bounds prefill memory).")
    cuda_graphs: bool = doc(True, "Capture the decode step in CUDA graphs (GPU only).")
    prompt_kv_sharing: bool = doc(
        True,
        "Decode attention reads the keys/values of a prompt's n samples (admitted together) from one slot's "
        "copy, the group's lead, while it lives: the GPU reads each prompt from HBM once per step and the "
        "others hit the L2 cache. Every slot keeps its own copy, so results are the same bits either way. "
        "The Triton decode kernels (the default one and rollout.exact_logprobs's); SDPA reads each slot's own copy.",
    )
    keep_cache: Any = doc(
        "auto",
        "Keep the KV cache and decode CUDA graphs between steps (no new allocation or capture: with responses "
        "of spread lengths each step captured its row buckets again, ~0.2 s at 0.5B), the memory staying taken "
        "through the update. auto = kept where the memory plan fits them beside the update at the same number "
        "of update micro-batches (GPU with the plan run; the plan prints the choice); true / false.",
    )
    val_temperature: float = doc(0.0, "Temperature for validation generation (0 = greedy).")
    layout_invariant_sampling: bool = doc(
        False,
        "Draw each sequence's sampling noise from (seed, prompt id, sample index, step): the same samples at "
        "any TP/PP/DP layout and batching (a counter hash instead of a generator; slower sampling).",
    )
    exact_logprobs: bool = doc(
        False,
        "Batch-invariant kernels (matmul, RMSNorm, attention, log-softmax) in the engine and in the actor/"
        "reference forward, so rollout log-probs equal the training recompute bit for bit "
        "(rollout/logprob_mismatch_frac = 0), also with packed or shared-prompt micro-batches. Any TP with "
        "the rollout TP equal to the training TP (TP partial sums and vocab shards added in rank order); "
        "builds the local layers (not TE); no sequence parallelism, LoRA, multi-turn or sliding window "
        "(refused at start-up).",
    )
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class KLCtrlConfig:
    type: str = doc("fixed", "KL-in-reward controller: fixed | adaptive.")
    kl_coef: float = doc(0.001, "Initial (fixed: constant) KL coefficient.")
    target_kl: float = doc(0.1, "Adaptive controller: target KL.")
    horizon: int = doc(10000, "Adaptive controller: horizon in samples.")


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop prompt groups whose rewards are all equal (no learning signal)."""

    enable: bool = doc(
        False, "Drop groups with equal rewards and generate more prompts until the batch is full."
    )
    max_num_gen_batches: int = doc(
        4, "Generation rounds per step at most (the first included); then train on what was kept."
    )


@dataclass
class AlgorithmConfig:
    """Advantage estimation and KL in the reward."""

    name: str = doc("grpo", "Label of the algorithm preset (algorithm=ppo|grpo|rloo|reinforce_plus_plus).")
    adv_estimator: str = doc(
        "grpo",
        "gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | opo | gpg | "
        "grpo_passk (gae needs a critic; remax generates one greedy baseline sample per prompt).",
    )
    gamma: float = doc(1.0, "Discount factor (gae, reinforce_plus_plus).")
    lam: float = doc(1.0, "GAE lambda.")
    norm_adv_by_std_in_grpo: bool = doc(True, "GRPO: divide by the group std; false = Dr.GRPO.")
    use_kl_in_reward: bool = doc(False, "Subtract kl_coef * KL(actor || ref) from token rewards.")
    kl_penalty: str = doc("k1", "KL estimator in the reward: k1 | k2 | k3 | abs.")
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_filter: bool = doc(
        False, "DAPO overlong filtering: responses cut at rollout.max_new_tokens get no gradient."
    )


@dataclass
class OptimConfig:
    lr: float = doc(1e-6, "Peak learning rate.")
    weight_decay: float = doc(0.01, "AdamW weight decay.")
    betas: list = doc([0.9, 0.999], "AdamW betas.")
    eps: float = doc(1e-8, "AdamW epsilon.")
    clip_grad: float = doc(1.0, "Global gradient-norm clip (over all TP/PP shards).")
    lr_warmup_steps: int = doc(
        0,
        "Linear warmup, in training steps (verl's convention: the schedule advances once per update, so "
        "all optimizer steps of a training step, its mini-batches times ppo_epochs, share one LR).",
    )
    lr_decay_style: str = doc(
        "constant",
        "constant | linear | cosine after warmup, reaching min_lr_ratio * lr at the end of the run (after "
        "trainer.total_training_steps training steps, or fewer by trainer.total_epochs).",
    )
    min_lr_ratio: float = doc(0.0, "Final LR as a fraction of lr for linear/cosine decay.")
    backend: str = doc(
        "local",
        "local: our AdamW on fp32 main params, grads summed over DP by all-reduce (any device). "
        "megatron: megatron-core DistributedDataParallel (fp32 grad buffers) + get_megatron_optimizer "
        "(TE/apex FusedAdam, else torch AdamW; fused on GPU); same loss, LR schedule and clipping.",
    )
    gradient_accumulation_fusion: Any = doc(
        "auto",
        "Linear layers' weight-gradient GEMMs accumulate straight into the fp32 main grad (megatron-core's "
        "gradient_accumulation_fusion, apex's kernel replaced by torch's addmm with an fp32 output): no bf16 "
        "weight gradient per micro-batch, no separate add. auto = on for bf16/fp16 weights on CUDA where "
        "that addmm passes its start-up trial; true = on (CPU: fp32 products, for tests); false = off.",
    )
    use_distributed_optimizer: bool = doc(
        False,
        "backend=megatron only: shard fp32 main params and Adam moments over DP (grads reduce-scattered, "
        "params all-gathered after each step).",
    )
    param_offload: bool = doc(
        False,
        "Move the fp32 main params to (pinned) host memory while generating and back for the update; the "
        "bf16 weights generation reads stay (with fp32 weights there are no separate main params).",
    )
    optimizer_offload: bool = doc(
        False, "Move the Adam moments (exp_avg, exp_avg_sq) to (pinned) host memory while generating."
    )
    grad_offload: bool = doc(
        False,
        "Free the gradient buffers while generating (they are zero between steps: re-zeroed, not copied). "
        "backend=megatron keeps fp32 grad buffers for the whole run; backend=local frees its grads after "
        "each step anyway, so there it has nothing to move.",
    )
    optimizer_cpu_offload: bool = doc(
        False,
        "backend=megatron with use_distributed_optimizer only: megatron-core's hybrid-device optimizer keeps "
        "optimizer_offload_fraction of the fp32 main params and Adam moments on the host and steps them "
        "there with torch's CPU AdamW (for models whose optimizer state does not fit on the GPU).",
    )
    optimizer_offload_fraction: float = doc(
        1.0,
        "With optimizer_cpu_offload: the fraction (0..1) of this rank's optimizer state kept on the host; a "
        "resume may change it (the checkpointed state is split anew).",
    )
    overlap_cpu_optimizer_d2h_h2d: bool = doc(
        False,
        "With optimizer_cpu_offload: one CPU optimizer per parameter, so grad copies down, CPU steps and "
        "param copies up overlap (CUDA streams).",
    )


@dataclass
class RecomputeKeys:
    """megatron-core's activation recomputation, for a trained model (actor, critic): trade compute for the
    activations one micro-batch keeps for backward."""

    recompute_granularity: Optional[str] = doc(
        None,
        "Activation recomputation: null (off) | selective (recompute_modules only) | full (whole layers).",
    )
    recompute_method: Optional[str] = doc(
        None,
        "With granularity full: uniform (every recompute_num_layers layers as one unit) | block "
        "(the first recompute_num_layers layers of each pipeline stage).",
    )
    recompute_num_layers: Optional[int] = doc(
        None, "With granularity full: layers per unit (uniform) or recomputed layers per stage (block)."
    )
    recompute_modules: list = doc(
        ["core_attn"], "With granularity selective: any of core_attn | mlp | layernorm (megatron-core names)."
    )

    def recompute_kwargs(self) -> dict:
        """The megatron-core ``TransformerConfig`` fields these keys set ({} when recomputation is off)."""
        if self.recompute_granularity is None:
            return {}
        return {
            "recompute_granularity": self.recompute_granularity,
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
            "recompute_modules": list(self.recompute_modules),
        }


@dataclass
class PolicyLossParams:
    """Hyper-parameters of individual policy losses (each loss reads the ones it names)."""

    tau_pos: float = doc(1.0, "sapo: gate temperature for positive advantages.")
    tau_neg: float = doc(1.05, "sapo: gate temperature for negative advantages.")
    clip_cov_ratio: float = doc(2e-4, "clip_cov: fraction of response tokens whose gradient is removed.")
    clip_cov_lb: float = doc(1.0, "clip_cov: lower bound of the covariance band tokens are drawn from.")
    clip_cov_ub: float = doc(5.0, "clip_cov: upper bound of that band.")
    kl_cov_ratio: float = doc(2e-4, "kl_cov: fraction of response tokens (largest covariance) KL-penalised.")
    ppo_kl_coef: float = doc(0.1, "kl_cov: coefficient of the |log ratio| penalty.")


@dataclass
class LoRAConfig:
    """Low-rank adapters on the linear layers of a trained model (actor or critic; PEFT's LoRA)."""

    rank: int = doc(
        0,
        "LoRA rank; 0 = off (full fine-tuning). With rank > 0 the base weights are frozen (no gradients, no "
        "optimizer state) and only the adapters train; the reference policy is the actor with its adapters "
        "switched off (no separate reference model).",
    )
    alpha: float = doc(16.0, "Adapter scale numerator: the adapter's output is multiplied by alpha / rank.")
    dropout: float = doc(0.0, "Dropout probability on the adapters' input (training only), 0 <= p < 1.")
    target_modules: list = doc(
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        "megatron-core linear layers that get adapters, any of linear_qkv (HF q/k/v_proj) | linear_proj "
        "(o_proj) | linear_fc1 (gate/up_proj) | linear_fc2 (down_proj).",
    )
    init: str = doc(
        "kaiming_uniform",
        "Initialisation of A (B starts at zero, so training starts from the base model): kaiming_uniform "
        "(PEFT's default) | gaussian (N(0, 1/rank), PEFT's init_lora_weights=gaussian).",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class ActorConfig(RecomputeKeys):
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    ppo_mini_batch_size: int = doc(8, "Prompts per optimizer step, global (times rollout.n sequences).")
    ppo_micro_batch_size_per_gpu: int = doc(4, "Sequences per forward/backward on each rank.")
    use_dynamic_bsz: bool = doc(
        False, "Micro-batches by token budget (similar lengths together) instead of a fixed sequence count."
    )
    ppo_max_token_len_per_gpu: Any = doc(
        16384,
        "With use_dynamic_bsz: padded tokens per micro-batch (>= max_prompt_length + max_new_tokens); auto = "
        "the largest the memory model fits on the GPU (see trainer.gpu_memory_gb).",
    )
    pack_sequences: bool = doc(
        False,
        "Run each micro-batch's sequences end to end in one row (THD, attention kept inside each sequence): "
        "no padded tokens; with use_dynamic_bsz the token budget then counts real tokens.",
    )
    share_prompts: Any = doc(
        "auto",
        "Packed micro-batches (as pack_sequences) that hold each prompt once for all its sampled responses "
        "(a GRPO group's n): every response attends to the one prompt copy, so a group runs P + nR tokens, not "
        "n(P + R); log-probs and gradients equal the unshared ones. auto = on where varlen flash attention (FA4 "
        "or torch's) passes its start-up trial on the GPU and the job is single-turn, without LoRA or sequence "
        "parallelism, with rollout.n > 1 (the memory plan prints the choice); true / false.",
    )
    ppo_epochs: int = doc(1, "Passes over each rollout batch.")
    policy_loss: str = doc(
        "vanilla",
        "vanilla (PPO clip, dual-clip) | gspo | cispo | sapo | geo_mean (GMPO) | clip_cov | kl_cov | dppo_tv | "
        "dppo_kl | gpg. dppo_* read clip_ratio_low/high as divergence thresholds, geo_mean in log space.",
    )
    policy_loss_params: PolicyLossParams = field(default_factory=PolicyLossParams)
    clip_ratio_low: float = doc(0.2, "PPO clip below 1 (ratio >= 1 - clip_ratio_low).")
    clip_ratio_high: float = doc(0.2, "PPO clip above 1 (clip-higher when > clip_ratio_low).")
    clip_ratio_c: float = doc(3.0, "Dual-clip bound for negative advantages (> 1).")
    loss_agg_mode: str = doc(
        "token-mean",
        "token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm | token-sum.",
    )
    entropy_coeff: float = doc(0.0, "Entropy bonus coefficient.")
    use_kl_loss: bool = doc(False, "Add kl_loss_coef * KL(actor || ref) to the loss (GRPO style).")
    kl_loss_coef: float = doc(0.001, "KL-loss coefficient.")
    kl_loss_type: str = doc("k3", "KL estimator for the loss: k1 | k2 | k3 | abs (k3 has a biased gradient).")
    tis_mode: Optional[str] = doc(
        None,
        "IS correction vs rollout log-probs: token | sequence (truncated at tis_cap) | icepop (0 outside "
        "[tis_low, tis_cap]).",
    )
    tis_cap: float = doc(2.0, "Cap of the truncated IS weight (icepop: upper bound).")
    tis_low: float = doc(0.5, "icepop: lower bound of the kept IS ratio.")
    tis_batch_normalize: bool = doc(
        False, "Divide the IS weights by their mean over the step's batch (all DP ranks), so they average 1."
    )
    rollout_rs: Optional[str] = doc(
        None,
        "Rejection sampling on log(pi_old / pi_rollout): token | seq_sum | seq_mean | seq_max (a sequence "
        "is dropped when the statistic leaves [rollout_rs_low, rollout_rs_high] in ratio space).",
    )
    rollout_rs_low: float = doc(0.5, "Rejection sampling: lower ratio bound (<= 1).")
    rollout_rs_high: float = doc(2.0, "Rejection sampling: upper ratio bound (>= 1).")


@dataclass
class CriticConfig(RecomputeKeys):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    ppo_mini_batch_size: int = doc(8, "Prompts per critic optimizer step, global.")
    ppo_micro_batch_size_per_gpu: int = doc(4, "Sequences per critic forward/backward on each rank.")
    use_dynamic_bsz: bool = doc(False, "Critic micro-batches by token budget (as actor.use_dynamic_bsz).")
    ppo_max_token_len_per_gpu: Any = doc(
        16384, "With use_dynamic_bsz: padded tokens per critic micro-batch; auto as for the actor."
    )
    pack_sequences: bool = doc(False, "Critic micro-batches packed (as actor.pack_sequences).")
    share_prompts: Any = doc("auto", "Critic micro-batches with shared prompts (as actor.share_prompts).")
    ppo_epochs: int = doc(1, "Critic passes over each rollout batch.")
    cliprange_value: float = doc(0.5, "Value clipping range around the old values.")
    loss_agg_mode: str = doc("token-mean", "Aggregation of the value loss (as actor.loss_agg_mode).")


@dataclass
class RefConfig:
    offload_to_cpu: bool = doc(False, "Park the frozen reference model on CPU between uses (GPU only).")


@dataclass
class CustomRewardConfig:
    path: Optional[str] = doc(
        None,
        "Python file with a verl-style compute_score function (returns a float, or a dict with 'score'; its "
        "other keys are logged as reward/<key>/mean).",
    )
    name: str = doc("compute_score", "Function name in that file.")


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment over the last ``len`` tokens before rollout.max_new_tokens."""

    len: int = doc(0, "Buffer length in tokens (0 = off); must be < rollout.max_new_tokens.")
    penalty_factor: float = doc(1.0, "Penalty at the cap; it grows linearly from 0 over the buffer.")


@dataclass
class RewardConfig:
    reward_fn: str = doc(
        "auto",
        "auto (by data_source; custom when custom_reward_function.path is set) | gsm8k | math | custom | "
        "builtin | model.",
    )
    reward_model_path: Optional[str] = doc(
        None,
        "reward_fn=model: HF *ForSequenceClassification checkpoint (num_labels=1, the actor's tokenizer).",
    )
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    format_score: float = doc(0.0, "Score for a well-formatted but wrong answer (rule rewards).")
    gsm8k_mode: str = doc("strict", "GSM8K answer extraction: strict (#### N) | flexible (last number).")
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    overlap: bool = doc(
        True,
        "Score the responses (and estimate the advantages) while the first update's first micro-batch runs its "
        "forward on the device, instead of before the update with the device idle (same results, unless the "
        "reward function draws from torch's default generator while dropout does too). The update's timing then "
        "includes what of the scoring did not overlap. Applies at pipeline size 1 where nothing before the "
        "update needs the scores: not with reward_fn=model, ReMax, algorithm.filter_groups, "
        "algorithm.overlong_filter or actor.rollout_rs. Set false for a custom reward function that runs its "
        "own GPU model (it would share the device with the update's first micro-batch).",
    )


@dataclass
class DataConfig:
    train_files: Optional[Any] = doc(None, "Parquet file(s) of prompts (verl format); None = built-in task.")
    val_files: Optional[Any] = doc(None, "Parquet file(s) for validation; None = built-in task's val split.")
    prompt_key: str = doc("prompt", "Column holding the prompt (string or chat messages).")
    max_prompt_length: int = doc(32, "Prompt token limit.")
    truncation: str = doc("error", "Overlong prompts: error | left | right | filter.")
    apply_chat_template: bool = doc(True, "Format prompts with the tokenizer's chat template if it has one.")
    train_batch_size: int = doc(16, "Prompts per training step, global.")
    val_batch_size: int = doc(64, "Prompts per validation batch, global (last batch may be smaller).")
    shuffle: bool = doc(True, "Shuffle prompts each epoch (seeded).")
    seed: int = doc(1, "Data shuffling seed.")


@dataclass
class TrainerConfig:
    total_training_steps: int = doc(20, "Training steps (rollout + update); stops earlier at total_epochs.")
    total_epochs: int = doc(1000, "Epoch limit over the training prompts.")
    critic_warmup: int = doc(0, "Steps at the start that update only the critic.")
    save_freq: int = doc(-1, "Checkpoint every N steps (-1 = only the final one, see save_final).")
    save_final: bool = doc(
        True,
        "Checkpoint after the last step whatever save_freq (false with save_freq=-1: keep no checkpoint).",
    )
    write_report: bool = doc(
        True, "At the end, write report.html + PNGs of the metrics (megatron-rl report)."
    )
    test_freq: int = doc(5, "Validate every N steps (-1 = never).")
    val_before_train: bool = doc(True, "Validate once before the first step.")
    logger: list = doc(
        ["console", "jsonl"], "Any of console, jsonl, tensorboard, wandb, mlflow (the mlflow extra)."
    )
    project_name: str = doc("megatron_rl", "Project name (wandb/tensorboard).")
    experiment_name: str = doc("default", "Run name (wandb/tensorboard).")
    output_dir: str = doc("outputs/default", "Where metrics, logs and checkpoints go.")
    seed: int = doc(1234, "Seed for model init, sampling and everything else.")
    resume_mode: str = doc("auto", "auto | disable | path.")
    resume_from_path: Optional[str] = doc(None, "Checkpoint dir for resume_mode=path.")
    max_ckpt_to_keep: int = doc(2, "Newest checkpoints kept.")
    save_hf: bool = doc(False, "Also write an HF export of the actor with each checkpoint.")
    dry_run: bool = doc(False, "Print layout and memory estimate, then exit.")
    gpu_memory_gb: Optional[float] = doc(
        None, "GPU memory (GiB) the memory model fits to; None = the device's own (set it to plan on a CPU)."
    )
    log_generations_freq: int = doc(5, "Print a few sample generations every N steps (-1 = never).")
    timeout_minutes: float = doc(
        30.0,
        "Limit of one phase (generation, reward, update, validation...) and of one collective, on every "
        "backend; a phase past it ends the run (exit code 3) with an error naming the phase and the rank.",
    )
    save_on_signal: bool = doc(
        True,
        "On SIGTERM/SIGINT every rank finishes the current step, writes a checkpoint (if true), flushes "
        "metrics and exits with code 75; the same command resumes.",
    )
    skip_nonfinite_steps: bool = doc(
        False,
        "Skip an update whose loss or gradient norm is NaN/Inf and count it (actor/nonfinite_skipped) instead "
        "of stopping with an error naming the step and phase.",
    )
    force_unlock: bool = doc(
        False, "Take over the output_dir lock of another run (only when that run is known to be gone)."
    )
    gc_freeze: bool = doc(
        True,
        "After setup (and resume), and again after the first step, collect Python's garbage and freeze what is "
        "left (gc.freeze): the collector's later full collections walk only what the steps create, not the ~550k "
        "startup objects nor the first step's compiled kernels and caches (the "
        "default config on a 2-core CPU: a full collection 390-410 ms before the freeze, 0.01 ms after), so none "
        "stalls a step (and, under SPMD, every rank at its next collective). timing_s/gc reports the collector's "
        "time a step.",
    )
    manual_gc_interval: int = doc(
        0,
        "> 0: automatic garbage collection off; a full collection at the end of every N steps, on every rank "
        "at once (Megatron-LM's --manual-gc). 0 = automatic.",
    )


@dataclass
class LoggerConfig:
    wandb_mode: str = doc(
        "offline",
        "wandb mode: offline (no key or network; `wandb sync` later) | online (needs `wandb login`) | disabled.",
    )
    mlflow_tracking_uri: Optional[str] = doc(
        None, "trainer.logger with mlflow: tracking URI (e.g. http://host:5000); None = <output_dir>/mlruns."
    )
    num_generations_to_log: int = doc(2, "Sample generations printed per log_generations_freq.")


@dataclass
class GenerateConfig:
    prompts: Optional[str] = doc(None, "megatron-rl generate: JSONL file with a 'prompt' field per line.")
    output: Optional[str] = doc(None, "megatron-rl generate: output JSONL path.")
    chat_template: bool = doc(False, "Apply the tokenizer's chat template to each prompt.")
    n: int = doc(
        1, "megatron-rl generate: completions per prompt (the training preset's rollout.n is not used)."
    )
    max_new_tokens: int = doc(128, "megatron-rl generate: response length limit.")
    temperature: float = doc(
        0.0, "megatron-rl generate: sampling temperature, 0 = greedy (rollout.top_p / top_k apply when > 0)."
    )


@dataclass
class ScoreConfig:
    input: Optional[str] = doc(
        None, "megatron-rl score: JSONL/parquet rows with prompt, response, data_source, ground_truth."
    )
    output: Optional[str] = doc(None, "megatron-rl score: output JSONL; None = <input stem>.scores.jsonl.")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
