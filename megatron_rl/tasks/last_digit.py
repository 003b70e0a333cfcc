"""The built-in task that `megatron-rl train` runs with no arguments: learnable on CPU in minutes.

Task ("last digit"): the prompt is a few random digits followed by "="; the answer is the prompt's last
digit. A random model emits it with probability ~1/40; a policy that learned to copy scores 1.0.
Everything is made in code (no download): a char-level tokenizer, a tiny Qwen2-style model saved in HF
format (so it loads through the same path as real checkpoints), and verl-format parquet files. The tiny
model also serves user data (``data.train_files`` without ``model.path``, e.g. GSM8K on CPU): its
tokenizer then covers printable ASCII and carries a chat template, so chat-format prompts render.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from megatron_rl.config.schema import ModelConfig
from megatron_rl.data import build_char_tokenizer
from megatron_rl.data.tiny_tokenizer import DEFAULT_ALPHABET

REWARD_NAME = "builtin"  # reward.reward_fn=builtin
DATA_SOURCE = "megatron_rl/last_digit"
ALPHABET = "0123456789="


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_) -> float:
    """1.0 when the response starts with the expected digit."""
    return 1.0 if solution_str.strip().startswith(str(ground_truth)) else 0.0


def builtin_tokenizer(builtin_data: bool):
    """The tiny model's tokenizer: the task's few characters for the built-in data (a small vocabulary
    keeps the task learnable in minutes), printable ASCII for user data; both with the chat template."""
    return build_char_tokenizer(ALPHABET if builtin_data else DEFAULT_ALPHABET)


def _write_split(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    prompts, truths = [], []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 4)))
        prompts.append(digits + "=")
        truths.append(digits[-1])
    table = pa.table(
        {
            "prompt": prompts,
            "data_source": [DATA_SOURCE] * n,
            "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
            "extra_info": [{"index": i} for i in range(n)],
        }
    )
    pq.write_table(table, path)


def save_tiny_model(model_cfg: ModelConfig, out: Path, vocab_size: int, seed: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_key_value_heads,
        max_position_embeddings=2048,  # room for chat-format prompts (GSM8K)
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(out)


def prepare_task_files(model_cfg: ModelConfig, workdir: Path, seed: int, tokenizer, write_split) -> tuple[str, str, str]:  # fmt: skip
    """Create (on rank 0, once) a built-in task's tiny model + ``tokenizer`` and its train/val parquet files
    (``write_split(path, n, seed)``) under ``workdir``. Returns ``(model_dir, train_file, val_file)``;
    every rank waits until they exist."""
    model_dir, train, val = workdir / "model", workdir / "train.parquet", workdir / "val.parquet"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not (model_dir / "config.json").is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        save_tiny_model(model_cfg, model_dir, len(tokenizer), seed)
        tokenizer.save_pretrained(model_dir)
        write_split(train, 2048, seed)
        write_split(val, 64, seed + 1)
    if dist.is_initialized():
        dist.barrier()
    return str(model_dir), str(train), str(val)


def prepare_builtin_task(
    model_cfg: ModelConfig, workdir: Path, seed: int, builtin_data: bool = True
) -> tuple[str, str, str]:
    """This task's model, tokenizer and files (``prepare_task_files``). ``builtin_data=False``: the model is
    for the user's data files (see ``builtin_tokenizer``)."""
    return prepare_task_files(model_cfg, workdir, seed, builtin_tokenizer(builtin_data), _write_split)
