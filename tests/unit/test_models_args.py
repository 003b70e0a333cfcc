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


@pytest.mark.parametrize(
    "shape, hf_count",  # the published parameter counts of the public checkpoints of these shapes
    [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-7b", 7_615_616_512), ("llama-3.1-8b", 8_030_261_248)],
)
def test_num_params_matches_the_published_checkpoints(shape, hf_count):
    from megatron_rl.models.shapes import hf_config

    a = ModelArgs.from_hf_config(hf_config(shape))
    assert a.num_params() == hf_count
    # the 6N rule counts the LM head once and no embedding lookup: untied 7B/8B lose one vocab x hidden
    untied = 0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size
    assert 0 < hf_count - untied - a.matmul_params() < 0.001 * hf_count  # norms and biases only


def test_stage_params_split_over_tp_and_pp():
    from megatron_rl.models.shapes import hf_config

    a = ModelArgs.from_hf_config(hf_config("qwen2.5-0.5b"))
    full = a.stage_params(1, 1)["first"]
    assert full == a.num_params() + (a.padded_vocab_size - a.vocab_size) * a.hidden_size
    assert 0.5 * full < a.stage_params(2, 1)["first"] < 0.51 * full  # norms are replicated
    pp2 = a.stage_params(1, 2)  # tied at PP=2: the last stage holds a copy of the embedding as its head
    assert pp2["first"] == pytest.approx(pp2["last"], rel=1e-3)
    critic = a.stage_params(1, 1, head="value")["first"]
    assert critic == full + a.hidden_size  # tied: the value head [1, h] is an extra tensor
    assert a.kv_bytes_per_token() == 24 * 2 * 2 * 64 * 2


def test_tiny_fixture_and_config_lookup(tmp_path):
    from megatron_rl.models.args import find_hf_config
    from megatron_rl.models.shapes import tiny_hf_config

    (tmp_path / "hf_config").mkdir()
    (tmp_path / "hf_config" / "config.json").write_text(json.dumps(tiny_hf_config("qwen3", vocab_size=99)))
    assert find_hf_config(tmp_path) == tmp_path / "hf_config" / "config.json"
    a = ModelArgs.from_hf_config(tmp_path)  # a checkpoint directory: config under hf_config/
    assert (a.arch, a.vocab_size, a.num_layers, a.head_dim) == ("qwen3", 99, 4, 16)
    assert find_hf_config(tmp_path / "nowhere") is None
