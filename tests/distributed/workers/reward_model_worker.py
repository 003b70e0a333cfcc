"""World 2: the reward-model scorer equals transformers' Qwen2ForSequenceClassification at TP=2 and PP=2."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.distributed import init_distributed
from megatron_rl.rewards.reward_model import RewardModelScorer
from megatron_rl.rollout.batch import build_batch
from megatron_rl.rollout.engine import Completion


def make_rm(path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    Qwen2ForSequenceClassification(cfg).save_pretrained(path)


def hf_scores(path: Path, seqs: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.stack([hf(torch.tensor([s])).logits[0, 0] for s in seqs])


if __name__ == "__main__":
    path = Path(sys.argv[1])
    init_distributed(1, 1)
    if dist.get_rank() == 0:
        make_rm(path)
    dist.barrier()
    g = torch.Generator().manual_seed(3)
    comps = [
        Completion(
            i,
            0,
            torch.randint(1, 50, (3 + i,), generator=g).tolist(),
            torch.randint(1, 50, (1 + 2 * i,), generator=g).tolist(),
        )
        for i in range(4)
    ]
    batch = build_batch(comps, [None] * 4, 0, max_new_tokens=8, pad_id=0, device=torch.device("cpu"))
    expected = hf_scores(path, [c.prompt_ids + c.response_ids for c in comps])
    for tp, pp in ((2, 1), (1, 2)):
        init_distributed(tp, pp)
        scores = RewardModelScorer(str(path), tp, torch.float32, micro_batch_size=2, actor_vocab_size=50)(
            batch
        )
        assert torch.allclose(scores, expected, atol=1e-5), (tp, pp, scores, expected)
    try:  # a tokenizer mismatch is refused, naming the key the user set
        RewardModelScorer(str(path), 1, torch.float32, micro_batch_size=2, actor_vocab_size=51)
    except ValueError as err:
        assert "reward.reward_model_path=" in str(err) and "51" in str(err), err
    else:
        raise AssertionError("a reward model with another vocabulary was accepted")
    if dist.get_rank() == 0:
        print("reward model checks passed")
