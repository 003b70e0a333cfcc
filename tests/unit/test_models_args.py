"""ModelArgs parsing from HF configs and the errors for unsupported models."""

import json

import pytest

from megatron_rl.models import ModelArgs, UnsupportedModelError, padded_vocab

BASE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=250,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
)


def test_llama_transformers5_rope_parameters():
    cfg = {
        **BASE,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    }
    a = ModelArgs.from_hf_config(cfg, tp=2)
    assert (a.arch, a.head_dim, a.num_query_groups, a.rope_theta) == ("llama", 16, 2, 500000.0)
    assert a.padded_vocab_size == 256 and not a.qkv_bias and not a.qk_norm and not a.tie_word_embeddings


def test_qwen2_has_qkv_bias_and_reads_top_level_rope_theta():
    cfg = {**BASE, "model_type": "qwen2", "rope_theta": 1e6, "tie_word_embeddings": True}
    a = ModelArgs.from_hf_config(cfg)
    assert a.qkv_bias and a.tie_word_embeddings and a.rope_theta == 1e6 and a.padded_vocab_size == 256


def test_qwen3_head_dim_and_qk_norm_from_a_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "qwen3", "head_dim": 32}))
    a = ModelArgs.from_hf_config(tmp_path)
    assert a.qk_norm and a.head_dim == 32 and not a.qkv_bias
    assert ModelArgs.from_dict(a.to_dict()) == a


def test_llama3_rope_scaling_is_accepted_and_others_refused():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    a = ModelArgs.from_hf_config({**BASE, "model_type": "llama", "rope_scaling": scaling})
    assert a.rope_scaling_factor == 8.0
    with pytest.raises(UnsupportedModelError, match="rope scaling"):
        ModelArgs.from_hf_config({**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn"}})


def test_padded_vocab_is_a_multiple_of_128_tp():
    assert [padded_vocab(250, tp) for tp in (1, 2, 4)] == [256, 256, 512]
    a = ModelArgs.from_hf_config({**BASE, "model_type": "llama", "vocab_size": 320}, tp=1)
    assert a.padded_vocab_size == 384 and a.with_tp(2).padded_vocab_size == 384
    assert a.with_tp(256).padded_vocab_size == padded_vocab(320, 256)


def test_unsupported_architecture_names_the_file_and_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**BASE, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(UnsupportedModelError) as err:
        ModelArgs.from_hf_config(tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "config.json") in msg and "GPT2LMHeadModel" in msg and "Qwen2ForCausalLM" in msg


def test_unsupported_options_and_missing_config(tmp_path):
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelArgs.from_hf_config({**BASE, "model_type": "llama", "hidden_act": "gelu"})
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelArgs.from_hf_config(tmp_path / "nowhere")
