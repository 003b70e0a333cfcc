"""Shared helpers of the rollout tests: tiny random HF models and an independent HF -> megatron shard map."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from megatron_rl.models.args import ModelArgs
from megatron_rl.models.shapes import TINY

VOCAB, EOS = 320, 319
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, False),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, True),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, False),
}


def tiny_hf(family: str, seed: int = 0, heads: int = 4, kv_heads: int = 2):
    """Random fp32 model: hidden 64, 4 layers, 4 heads / 2 KV heads (or ``heads`` / ``kv_heads``, head_dim
    64 / heads; 8 / 4 splits over TP=4); a wide init spreads the logits so greedy decoding has no
    near-ties. EOS is the last id (greedy practically never picks it)."""
    config_cls, model_cls, tied = FAMILIES[family]
    shape = dict(TINY, num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256)
    cfg = config_cls(
        **shape,
        vocab_size=VOCAB,
        head_dim=64 // heads,
        initializer_range=0.1,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=EOS,
        pad_token_id=0,
        tie_word_embeddings=tied,
        attention_bias=family == "qwen2",
    )
    cfg.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    return model_cls(cfg).eval()


def spec_of(hf, tp: int = 1) -> ModelArgs:
    return ModelArgs.from_hf_config(hf.config.to_dict(), tp=tp)


def hf_to_mcore(hf, spec: ModelArgs, tp: int, tp_rank: int, pp: int, pp_rank: int) -> dict:
    """One (tp_rank, pp_rank) shard of the HF weights under megatron-core local-spec names."""
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    G, D, rep = spec.num_query_groups, spec.head_dim, spec.num_attention_heads // spec.num_query_groups

    def rows(t, r):  # column-parallel chunk
        return t.chunk(tp, dim=0)[r].clone()

    def vocab(t):
        padded = torch.zeros(spec.padded_vocab_size, t.shape[1])
        padded[: t.shape[0]] = t
        return rows(padded, tp_rank)

    def qkv(kind):
        q = sd[f"{pre}self_attn.q_proj.{kind}"].reshape(G, rep * D, -1)  # [G, rep*D, (h)]
        k = sd[f"{pre}self_attn.k_proj.{kind}"].reshape(G, D, -1)
        v = sd[f"{pre}self_attn.v_proj.{kind}"].reshape(G, D, -1)
        full = torch.cat([q, k, v], dim=1).reshape(G * (rep + 2) * D, -1)  # [(nH+2G)*D, (h)]
        return rows(full, tp_rank).squeeze(-1) if kind == "bias" else rows(full, tp_rank)

    out = {}
    per = spec.num_layers // pp
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = vocab(sd["model.embed_tokens.weight"])
    for local in range(per):
        pre, name = f"model.layers.{pp_rank * per + local}.", f"decoder.layers.{local}."
        gate, up = sd[f"{pre}mlp.gate_proj.weight"], sd[f"{pre}mlp.up_proj.weight"]
        out |= {
            name + "input_layernorm.weight": sd[f"{pre}input_layernorm.weight"],
            name + "self_attention.linear_qkv.weight": qkv("weight"),
            name + "self_attention.linear_proj.weight": sd[f"{pre}self_attn.o_proj.weight"].chunk(tp, 1)[
                tp_rank
            ],
            name + "pre_mlp_layernorm.weight": sd[f"{pre}post_attention_layernorm.weight"],
            name + "mlp.linear_fc1.weight": torch.cat([rows(gate, tp_rank), rows(up, tp_rank)]),
            name + "mlp.linear_fc2.weight": sd[f"{pre}mlp.down_proj.weight"].chunk(tp, 1)[tp_rank],
        }
        if spec.qkv_bias:
            out[name + "self_attention.linear_qkv.bias"] = qkv("bias")
        if spec.qk_norm:
            out[name + "self_attention.q_layernorm.weight"] = sd[f"{pre}self_attn.q_norm.weight"]
            out[name + "self_attention.k_layernorm.weight"] = sd[f"{pre}self_attn.k_norm.weight"]
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
        if not spec.tie_word_embeddings:
            out["output_layer.weight"] = vocab(sd["lm_head.weight"])
    return {k: torch.nn.Parameter(v.contiguous().clone()) for k, v in out.items()}


def random_prompts(count: int, seed: int, max_len: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (count,), generator=g)
    return [torch.randint(1, EOS, (int(n),), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation of one prompt alone (no padding), EOS disabled."""
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logprobs(hf, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Log-probs [R] of the response tokens under softmax(logits / T) of one HF forward pass."""
    logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
    scaled = logits / (temperature or 1.0)
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
