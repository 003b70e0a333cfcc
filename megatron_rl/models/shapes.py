"""Named model shapes as HF ``config.json`` dicts: the public checkpoints the benchmarks and the memory
model are measured at (random weights of the same shape), and the tiny model every CPU test builds.

One definition each, so a test, a benchmark and the dry run that say "the 3B shape" mean the same
numbers. ``hf_config(name, **overrides)`` returns a fresh dict; ``ModelArgs.from_hf_config`` reads it.
"""

from __future__ import annotations

_QWEN2 = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    vocab_size=151936,
)
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(_QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-3b": dict(_QWEN2, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN2, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                       vocab_size=152064),
    "llama-3.1-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                         hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=False, vocab_size=128256, rms_norm_eps=1e-5,
                         rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}  # fmt: skip

# The tiny model of the CPU tests: 4 layers of hidden 64, 4 heads over 2 KV groups (head_dim 16, so
# TP=2 splits whole groups), SwiGLU 128 wide. Tests override what they exercise (vocab, layers, seeds).
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


def hf_config(name: str, **overrides) -> dict:
    """A fresh HF config dict of the named shape (``SHAPES``), with ``overrides`` applied."""
    if name not in SHAPES:
        raise KeyError(f"model shape {name!r} is not known; use one of {sorted(SHAPES)}")
    return {**SHAPES[name], **overrides}


def tiny_hf_config(model_type: str = "qwen2", **overrides) -> dict:
    """The tiny test model's HF config dict for ``model_type`` (llama | qwen2 | qwen3), ``overrides``
    applied (vocab_size has no default: each test picks its own)."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    if model_type not in arch:
        raise KeyError(f"tiny model_type {model_type!r}; use one of {sorted(arch)}")
    return {"model_type": model_type, "architectures": [arch[model_type]], **TINY, **overrides}
