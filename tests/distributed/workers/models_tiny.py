"""Tiny random HF models for the model tests (``megatron_rl.models.shapes.TINY``: hidden 64, 4 layers,
4 heads / 2 KV heads, ffn 128)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.models.shapes import TINY as COMMON  # noqa: E402  (the one tiny test shape)

KINDS = ("llama", "qwen2", "qwen3")


def make_tiny_hf(kind: str, out_dir: str | Path, seed: int = 0, seq_cls: bool = False) -> Path:
    """Save a random tiny ``kind`` model (fp32 safetensors) to ``out_dir``; returns the path.

    llama: GQA, untied head, vocab 320, rope theta 500000. qwen2: qkv bias, tied, vocab 250 (not a multiple
    of 128). qwen3: qk-norm, head_dim 32 != hidden/heads, untied, vocab 256. ``seq_cls``: a
    SequenceClassification model with num_labels=1 (a critic / reward checkpoint).
    """
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "llama":
        cfg = tf.LlamaConfig(**COMMON, vocab_size=320, rope_theta=500000.0, tie_word_embeddings=False)
        cls = tf.LlamaForSequenceClassification if seq_cls else tf.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**COMMON, vocab_size=250, rope_theta=1000000.0, tie_word_embeddings=True)
        cls = tf.Qwen2ForSequenceClassification if seq_cls else tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**COMMON, vocab_size=256, head_dim=32, tie_word_embeddings=False)
        cls = tf.Qwen3ForSequenceClassification if seq_cls else tf.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    if seq_cls:
        cfg.num_labels = 1
        cfg.pad_token_id = 0
    model = cls(cfg).float()
    with torch.no_grad():  # random norms so that a wrong norm mapping shows up in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def hf_logits(hf_dir: str | Path, input_ids: torch.Tensor, seq_cls: bool = False) -> torch.Tensor:
    """Reference output of transformers: logits [B, T, V] or per-token scores [B, T]."""
    import transformers as tf

    if seq_cls:
        model = tf.AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            hidden = model.model(input_ids).last_hidden_state  # [B, T, h]
            return model.score(hidden).squeeze(-1)  # [B, T]
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits
