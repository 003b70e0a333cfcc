"""The pure HF <-> megatron weight mapping: layouts of qkv/fc1/vocab shards and exact round trips."""

import pytest
import torch

from megatron_rl.models import ModelArgs
from megatron_rl.models.hf_mapping import canonical_names, hf_from_megatron_shards, megatron_shard_from_hf

BASE = dict(
    hidden_size=8,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=12,
    vocab_size=250,
    head_dim=2,
)


def fake_hf(args: ModelArgs, tied: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d = args.hidden_size, args.head_dim
    shapes = {"model.embed_tokens.weight": (args.vocab_size, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (args.vocab_size, h)
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                f"{p}input_layernorm.weight": (h,),
                f"{p}post_attention_layernorm.weight": (h,),
                f"{p}self_attn.q_proj.weight": (args.num_attention_heads * d, h),
                f"{p}self_attn.k_proj.weight": (args.num_query_groups * d, h),
                f"{p}self_attn.v_proj.weight": (args.num_query_groups * d, h),
                f"{p}self_attn.o_proj.weight": (h, args.num_attention_heads * d),
                f"{p}mlp.gate_proj.weight": (args.ffn_hidden_size, h),
                f"{p}mlp.up_proj.weight": (args.ffn_hidden_size, h),
                f"{p}mlp.down_proj.weight": (h, args.ffn_hidden_size),
            }
        )
        if args.qkv_bias:
            for n, rows in (
                ("q", args.num_attention_heads * d),
                ("k", args.num_query_groups * d),
                ("v", args.num_query_groups * d),
            ):
                shapes[f"{p}self_attn.{n}_proj.bias"] = (rows,)
        if args.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = (d,)
            shapes[f"{p}self_attn.k_norm.weight"] = (d,)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def dict_reader(state):
    def read(name, rows=None, cols=None):
        t = state[name]
        t = t[rows] if rows is not None else t
        return t[:, cols] if cols is not None else t.clone()

    return read


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_round_trip_is_exact(model_type, tied, tp, pp):
    args = ModelArgs.from_hf_config({**BASE, "model_type": model_type, "tie_word_embeddings": tied}, tp=tp)
    hf = fake_hf(args, tied)
    shards = {
        (t, p): megatron_shard_from_hf(dict_reader(hf), args, tp=tp, tp_rank=t, pp=pp, pp_rank=p)
        for t in range(tp)
        for p in range(pp)
    }
    back = hf_from_megatron_shards(shards, args)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_qkv_is_interleaved_per_group_and_fc1_is_gate_then_up_per_rank():
    args = ModelArgs.from_hf_config({**BASE, "model_type": "llama"}, tp=2)
    hf = fake_hf(args, tied=False)
    s1 = megatron_shard_from_hf(dict_reader(hf), args, tp=2, tp_rank=1, pp=1, pp_rank=0)
    qkv = s1["decoder.layers.0.self_attention.linear_qkv.weight"]  # rank 1 holds query group 1
    p = "model.layers.0.self_attn."
    expected = torch.cat(
        [hf[p + "q_proj.weight"][4:8], hf[p + "k_proj.weight"][2:4], hf[p + "v_proj.weight"][2:4]]
    )
    assert torch.equal(qkv, expected)
    fc1 = s1["decoder.layers.0.mlp.linear_fc1.weight"]
    m = "model.layers.0.mlp."
    assert torch.equal(fc1, torch.cat([hf[m + "gate_proj.weight"][6:], hf[m + "up_proj.weight"][6:]]))
    emb = s1["embedding.word_embeddings.weight"]  # rows 128..255, real up to 249, zero padding after
    assert emb.shape == (128, 8) and torch.equal(emb[:122], hf["model.embed_tokens.weight"][128:])
    assert not emb[122:].any()


def test_tied_last_stage_gets_the_embedding_rows():
    args = ModelArgs.from_hf_config({**BASE, "model_type": "qwen2", "tie_word_embeddings": True}, tp=1)
    hf = fake_hf(args, tied=True)
    last = megatron_shard_from_hf(dict_reader(hf), args, tp=1, tp_rank=0, pp=2, pp_rank=1)
    assert torch.equal(last["output_layer.weight"][:250], hf["model.embed_tokens.weight"])
    single = megatron_shard_from_hf(dict_reader(hf), args, tp=1, tp_rank=0, pp=1, pp_rank=0)
    assert "output_layer.weight" not in single


def test_te_fused_norm_names_map_to_local_names():
    te = {
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": 1,
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": 2,
        "decoder.final_layernorm.weight": 3,
    }
    assert canonical_names(te) == {
        "decoder.layers.3.input_layernorm.weight": 1,
        "decoder.layers.3.pre_mlp_layernorm.weight": 2,
        "decoder.final_layernorm.weight": 3,
    }


def test_tp_that_does_not_divide_the_kv_heads_is_refused():
    args = ModelArgs.from_hf_config({**BASE, "model_type": "llama"}, tp=4)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        megatron_shard_from_hf(dict_reader(fake_hf(args, False)), args, tp=4, tp_rank=0, pp=1, pp_rank=0)
