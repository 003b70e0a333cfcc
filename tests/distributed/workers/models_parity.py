"""World 4: logits parity with transformers at (TP, PP) in (1,1), (2,1), (1,2), (2,2) for tiny Llama, Qwen2
and Qwen3; HF export round trip bit-exact; critic values [B, T] and TP=2 gradients equal TP=1's; ref frozen.

argv: a shared tmp dir. Layouts are given as argv[2] (e.g. "1x1,2x1"); all four by default.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

sys.path.insert(0, str(Path(__file__).parent))
from models_tiny import KINDS, hf_logits, make_tiny_hf  # noqa: E402

from megatron_rl.distributed import destroy_distributed, init_distributed  # noqa: E402
from megatron_rl.models import (  # noqa: E402
    ModelArgs,
    build_model,
    export_hf_state_dict,
    load_hf_weights,
)
from megatron_rl.models.hf_mapping import hf_from_megatron_shards  # noqa: E402
from megatron_rl.models.weights import tensor_state  # noqa: E402
from tests.reference_forward import forward_logits, forward_pipeline  # noqa: E402

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """[B, T, V/tp] -> [B, T, V] over the TP group."""
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def check_logits(root: Path, tp: int, pp: int, ids: torch.Tensor, refs: dict) -> None:
    for kind in KINDS:
        hf_dir = root / kind
        args = ModelArgs.from_hf_config(hf_dir, tp=tp)
        model = build_model(args, "actor")
        load_hf_weights(model, hf_dir, args)
        model.eval()
        logits = gather_vocab(forward_pipeline(model, ids))[..., : args.vocab_size]  # [B, T, V]
        err = rel_err(logits, refs[kind])
        assert err < TOL, f"{kind} TP={tp} PP={pp}: relative error {err:.3e} >= {TOL}"
        if dist.get_rank() == 0:
            print(f"parity {kind} tp={tp} pp={pp} rel_err={err:.2e}", flush=True)
        if tp == 2 and pp == 2:
            check_export(model, args, hf_dir, kind)


def check_export(model, args, hf_dir: Path, kind: str) -> None:
    from safetensors.torch import load_file

    exported = export_hf_state_dict(model, args)
    if dist.get_rank() != 0:
        assert exported is None
        return
    original = load_file(hf_dir / "model.safetensors")
    assert set(exported) == set(original), f"{kind}: key sets differ: {set(exported) ^ set(original)}"
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), f"{kind}: {k} not bit-exact"
    print(f"export {kind} tp=2 pp=2: {len(original)} tensors bit-exact", flush=True)


def hf_grads(model, args) -> dict[str, torch.Tensor]:
    """This PP=1 model's gradients gathered over TP, in HF names."""
    grads = {k: p.grad for k, p in model.named_parameters()}
    local = {k: grads[k] for k in tensor_state(model) if k in grads}
    group = ps.get_tensor_model_parallel_group()
    shards = [None] * dist.get_world_size(group)
    dist.all_gather_object(shards, local, group=group)
    return hf_from_megatron_shards({(t, 0): s for t, s in enumerate(shards)}, args, role="critic")


def critic_run(hf_dir: Path, tp: int, ids: torch.Tensor, ref_values: torch.Tensor) -> dict:
    init_distributed(tp, 1, seed=7)
    args = ModelArgs.from_hf_config(hf_dir, tp=tp)
    critic = build_model(args, "critic")
    missing = load_hf_weights(critic, hf_dir, args)
    assert missing == [], f"critic from a SequenceClassification checkpoint left {missing} unloaded"
    values = forward_logits(critic, ids)
    assert values.shape == ids.shape, f"critic values shape {tuple(values.shape)} != {tuple(ids.shape)}"
    err = rel_err(values.detach(), ref_values)
    assert err < TOL, f"critic TP={tp}: values relative error {err:.3e} vs transformers score head"
    (values.float() ** 2).mean().backward()
    return hf_grads(critic, args)


def check_critic(root: Path, ids: torch.Tensor) -> None:
    hf_dir = root / "qwen2_cls"
    ref = hf_logits(hf_dir, ids, seq_cls=True)
    g1 = critic_run(hf_dir, 1, ids, ref)
    g2 = critic_run(hf_dir, 2, ids, ref)
    assert set(g1) == set(g2)
    assert g1["score.weight"].abs().sum() > 0 and g1["model.embed_tokens.weight"].abs().sum() > 0
    worst = max(rel_err(g2[k], g1[k]) for k in g1 if g1[k].norm() > 0)
    assert worst < 1e-5, f"critic TP=2 gradients differ from TP=1: worst relative error {worst:.3e}"
    # an actor checkpoint initialises the critic's trunk; the value head keeps its (replicated) init
    args = ModelArgs.from_hf_config(root / "qwen3", tp=2)
    critic = build_model(args, "critic")
    assert load_hf_weights(critic, root / "qwen3", args) == ["output_layer.weight"]
    ref_model = build_model(args, "ref")
    load_hf_weights(ref_model, root / "qwen3", args)
    assert not any(p.requires_grad for p in ref_model.parameters()) and not ref_model.training
    if dist.get_rank() == 0:
        print(f"critic values [B, T] ok; TP=2 vs TP=1 grads worst rel err {worst:.2e}", flush=True)


def check_fusions(root: Path, ids: torch.Tensor) -> None:
    """At the current layout: the fused RoPE (megatron-core's fused-RoPE slot) and SwiGLU (our MLP
    activation module), what a GPU build turns on, give the unfused model's logits and gradients."""
    import os

    from megatron.core.models.common.embeddings import rope_utils

    hf_dir = root / "qwen2"
    args = ModelArgs.from_hf_config(hf_dir, tp=ps.get_tensor_model_parallel_world_size())
    runs, calls = [], []
    for flag in ("0", "1"):
        os.environ["MEGATRON_RL_COMPILE"] = flag
        model = build_model(args, "actor")
        load_hf_weights(model, hf_dir, args)
        fused = model.config.apply_rope_fusion and model.config.use_te_activation_func
        assert fused == (flag == "1"), f"MEGATRON_RL_COMPILE={flag}: fusion flags {fused}"
        act = model.decoder.layers[0].mlp.activation_func
        assert (type(act).__name__ == "SwiGLU") == (flag == "1"), f"MLP activation {act}"
        slot = rope_utils.fused_apply_rotary_pos_emb
        rope_utils.fused_apply_rotary_pos_emb = lambda *a, slot=slot, **k: calls.append(1) or slot(*a, **k)
        logits = forward_logits(model, ids)  # [B, T, V/tp]
        (logits.float().square().mean()).backward()
        rope_utils.fused_apply_rotary_pos_emb = slot
        runs.append((logits.detach(), {k: p.grad for k, p in model.named_parameters()}))
    os.environ.pop("MEGATRON_RL_COMPILE")
    (l0, g0), (l1, g1) = runs
    assert calls, "the fused model never called the fused-RoPE slot"
    err = rel_err(l1, l0)
    worst = max(rel_err(g1[k], g0[k]) for k in g0 if g0[k].norm() > 0)
    assert err < TOL and worst < TOL, f"fused vs unfused: logits {err:.3e}, worst grad {worst:.3e}"
    if dist.get_rank() == 0:
        print(
            f"fusions tp={ps.get_tensor_model_parallel_world_size()} logits {err:.1e} grads {worst:.1e}",
            flush=True,
        )


def main() -> None:
    root = Path(sys.argv[1])
    layouts = [
        tuple(int(x) for x in s.split("x"))
        for s in (sys.argv[2] if len(sys.argv) > 2 else "1x1,2x1,1x2,2x2").split(",")
    ]
    init_distributed(1, 1, seed=0)
    if dist.get_rank() == 0:
        for i, kind in enumerate(KINDS):
            make_tiny_hf(kind, root / kind, seed=i)
        make_tiny_hf("qwen2", root / "qwen2_cls", seed=5, seq_cls=True)
    dist.barrier()
    torch.manual_seed(0)
    ids = torch.randint(0, 250, (2, 13))
    refs = {kind: hf_logits(root / kind, ids) for kind in KINDS}
    for tp, pp in layouts:
        init_distributed(tp, pp, seed=0)
        check_logits(root, tp, pp, ids, refs)
        if (tp, pp) == (2, 1):
            check_fusions(root, ids)
    check_critic(root, ids)
    destroy_distributed()


if __name__ == "__main__":
    main()
