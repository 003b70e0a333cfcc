"""Reward model scoring (``reward.reward_fn=model``): a scalar-head megatron-core model on the same TP/PP
layout as the actor, loaded from an HF sequence-classification checkpoint (``score.weight``).

The score of a sequence is the head's output at its last token (prompt + response), as HF's
``*ForSequenceClassification`` computes it. The reward model must share the actor's tokenizer.
"""

from __future__ import annotations

import torch

from megatron_rl.models import ModelArgs, build_model, load_hf_weights
from megatron_rl.models.pipeline import broadcast_from_last_stage, run_micro_batches
from megatron_rl.rollout.batch import RolloutBatch, split_micro_batches


class RewardModelScorer:
    def __init__(self, path: str, tp: int, dtype: torch.dtype, micro_batch_size: int, actor_vocab_size: int):
        args = ModelArgs.from_hf_config(path, tp=tp)
        if args.vocab_size != actor_vocab_size:
            raise ValueError(
                f"reward.reward_model_path={path} has a vocabulary of {args.vocab_size} tokens but the actor has "
                f"{actor_vocab_size}; the reward model must share the actor's tokenizer."
            )
        model = build_model(args, "reward", dtype)
        missing = load_hf_weights(model, path, args, role="reward")
        if missing:
            raise KeyError(
                f"reward.reward_model_path={path} has no score head ({missing}); give an HF "
                f"*ForSequenceClassification checkpoint with num_labels=1."
            )
        self.model = model.to(dtype).eval()
        self.model.requires_grad_(False)
        self.micro = micro_batch_size

    def __call__(self, batch: RolloutBatch) -> torch.Tensor:
        """Scores [B] of the batch's sequences (every rank of the pipeline gets them)."""

        def loss_fn(mb, values):
            last = (mb.prompt_lens + mb.response_lens - 1)[:, None]  # [b, 1] the last real token
            return values.new_zeros(()), {"score": values.float().gather(1, last)[:, 0]}

        with torch.no_grad():
            outs = run_micro_batches(self.model, split_micro_batches(batch, self.micro), loss_fn, True)
        scores = torch.cat([o["score"] for o in outs]).cpu() if outs else None
        return broadcast_from_last_stage(scores).to(batch.response_mask.device)
