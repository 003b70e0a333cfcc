"""World 4, TP=2 x PP=2 (with and without sequence parallelism): a LoRA actor against HF PEFT on the same tiny
Qwen2 model with the same (non-zero) adapters, fp32.

- logits and every adapter gradient equal PEFT's (the shared A of qkv / fc1 gets the sum of PEFT's q/k/v,
  gate/up A gradients); base weights have no gradient;
- adapters off gives the base model's logits (the reference policy); merged weights (what the engine
  generates with) give the LoRA logits and leave the base bit-identical;
- the adapters exported to a PEFT folder load with ``PeftModel.from_pretrained`` and give the same logits;
- both optimizer backends hold only the adapters; a step changes them and no base weight.

argv: a shared tmp dir.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

sys.path.insert(0, str(Path(__file__).parent))
from models_tiny import make_tiny_hf  # noqa: E402

from megatron_rl.config.schema import LoRAConfig, OptimConfig  # noqa: E402
from megatron_rl.distributed import destroy_distributed, init_distributed  # noqa: E402
from megatron_rl.distributed.grads import reduce_gradients  # noqa: E402
from megatron_rl.models import ModelArgs, build_model, load_hf_weights  # noqa: E402
from megatron_rl.models import lora as L  # noqa: E402
from megatron_rl.models.lora_export import save_peft_adapter  # noqa: E402
from megatron_rl.models.lora_hf import (  # noqa: E402
    HF_MODULES,
    adapters_from_peft,
    peft_from_adapter_shards,  # noqa: E402
    peft_target_modules,
)
from megatron_rl.models.pipeline import run_micro_batches  # noqa: E402
from megatron_rl.models.weights import gather_shards, parallel_ranks  # noqa: E402
from megatron_rl.optim import build_optimizer  # noqa: E402
from megatron_rl.rollout.reshard import model_params  # noqa: E402

TOL = 1e-5
RANK, ALPHA = 4, 8.0
TARGETS = list(L.TARGETS)


@dataclass
class MB:
    input_ids: torch.Tensor
    score_pos: torch.Tensor
    packed: None = None  # rows, not a packed THD row

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def random_peft_adapters(args: ModelArgs) -> dict[str, torch.Tensor]:
    """Non-zero PEFT adapters, A shared by q/k/v and by gate/up (what a fused megatron adapter is)."""
    gen = torch.Generator().manual_seed(11)
    h, attn, ffn = args.hidden_size, args.num_attention_heads * args.head_dim, args.ffn_hidden_size
    kv = args.num_query_groups * args.head_dim
    dims = {"q_proj": (h, attn), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (attn, h),
            "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}  # fmt: skip
    out = {}
    for i in range(args.num_layers):
        for parent, mods in HF_MODULES.values():
            a = torch.randn(RANK, dims[mods[0]][0], generator=gen) * 0.2
            for m in mods:
                pre = f"base_model.model.model.layers.{i}.{parent}.{m}"
                out[f"{pre}.lora_A.weight"] = a
                out[f"{pre}.lora_B.weight"] = torch.randn(dims[m][1], RANK, generator=gen) * 0.2
    return out


def peft_reference(hf_dir: Path, adapters: dict, ids: torch.Tensor, weights: torch.Tensor):
    """PEFT logits [B, T, V], base logits (adapter disabled) and adapter gradients of sum(logits * weights)."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=peft_target_modules(TARGETS))
    pm = get_peft_model(hf, cfg)
    set_peft_model_state_dict(pm, adapters)
    logits = pm(ids).logits
    (logits * weights).sum().backward()
    grads = {n.replace(".default", ""): p.grad for n, p in pm.named_parameters() if "lora_" in n}
    with torch.no_grad(), pm.disable_adapter():
        base = pm(ids).logits
    return logits.detach(), base, grads


def gather_vocab(local: torch.Tensor) -> torch.Tensor:
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def run(model, ids, weights, vocab: int, forward_only: bool) -> torch.Tensor | None:
    """Forward (+ backward of sum(logits * weights)) through the pipeline schedule; full logits [B, T, V]
    on the last stage, None elsewhere."""
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    seen = {}

    def loss_fn(mb, logits):  # [B, T, V/tp]
        per = logits.shape[-1]
        w = F.pad(weights, (0, per * tp - vocab))[..., tp_rank * per : (tp_rank + 1) * per]
        seen["logits"] = gather_vocab(logits.detach())[..., :vocab]
        return (logits * w).sum(), {}

    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad() if forward_only else torch.enable_grad():
        run_micro_batches(model, [MB(ids.clone(), pos)], loss_fn, forward_only)
    return seen.get("logits")


def build(hf_dir: Path, sp: bool, lora: bool):
    args = ModelArgs.from_hf_config(hf_dir, tp=2)
    model = build_model(
        args, "actor", sequence_parallel=sp, lora=LoRAConfig(rank=RANK, alpha=ALPHA) if lora else None
    )
    load_hf_weights(model, hf_dir, args)
    return args, model


def check_layout(hf_dir: Path, sp: bool, ids, weights, ref) -> None:
    logits_ref, base_ref, grads_ref = ref
    args, model = build(hf_dir, sp, lora=True)
    tp, tp_rank, pp, pp_rank = parallel_ranks()
    shard = adapters_from_peft(ADAPTERS, args, TARGETS, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank)
    state = L.adapter_state(model)
    assert set(shard) == set(state), f"adapter names differ: {set(shard) ^ set(state)}"
    with torch.no_grad():
        for k, v in shard.items():
            state[k].copy_(v)
    frozen = [n for n, p in model.named_parameters() if p.requires_grad != L.is_adapter(n)]
    assert not frozen, f"requires_grad should be True exactly for the adapters: {frozen[:4]}"
    base_before = {k: v.clone() for k, v in model_params(model).items() if not L.is_adapter(k)}
    tag = f"tp=2 pp=2 sp={sp}"

    logits = run(model, ids, weights, args.vocab_size, forward_only=False)
    reduce_gradients(model)  # what the optimizer does first: sums the sequence-parallel partial grads
    assert all(p.grad is None for n, p in model.named_parameters() if not L.is_adapter(n)), "base got grads"
    grad_shards = gather_shards(model, lambda m: L.adapter_state(m, grads=True))
    if model.post_process:
        err = rel_err(logits, logits_ref)
        assert err < TOL, f"{tag}: LoRA logits vs PEFT relative error {err:.2e}"
    if dist.get_rank() == 0:
        ours = peft_from_adapter_shards(grad_shards, args, TARGETS)
        worst = 0.0
        for name, g in grads_ref.items():
            if name.endswith("lora_A.weight"):  # a fused layer's A: sum of its projections' A gradients
                parent, mod = name.split(".")[-4], name.split(".")[-3]
                group = next(mods for p, mods in HF_MODULES.values() if p == parent and mod in mods)
                g = sum(grads_ref[name.replace(f".{mod}.", f".{m}.")] for m in group)
            worst = max(worst, rel_err(ours[name], g))
        assert worst < TOL, f"{tag}: adapter gradients vs PEFT worst relative error {worst:.2e}"
        print(
            f"parity {tag}: logits and {len(grads_ref)} adapter grads match PEFT (worst {worst:.1e})",
            flush=True,
        )

    with L.adapters_disabled(model):
        off = run(model, ids, weights, args.vocab_size, forward_only=True)
    if model.post_process:
        assert rel_err(off, base_ref) < TOL, f"{tag}: adapters off != base model logits"

    merged = L.merged_params(model, model_params(model))
    _, plain = build(hf_dir, sp, lora=False)
    plain_params = model_params(plain)
    with torch.no_grad():
        for k, v in merged.items():
            if not L.is_adapter(k):
                plain_params[k].copy_(v)
    m_logits = run(plain, ids, weights, args.vocab_size, forward_only=True)
    if model.post_process:
        assert rel_err(m_logits, logits_ref) < TOL, f"{tag}: merged-weight logits != LoRA logits"
    after = model_params(model)
    assert all(torch.equal(after[k], v) for k, v in base_before.items()), "merging touched the base weights"
    if dist.get_rank() == 0:
        print(f"adapters off = base, merged = LoRA {tag}", flush=True)
    if not sp:
        check_export(model, args, hf_dir, ids, logits_ref)
        check_optimizers(hf_dir)


def check_export(model, args, hf_dir: Path, ids, logits_ref) -> None:
    out = hf_dir.parent / "peft_export"
    save_peft_adapter(model, args, LoRAConfig(rank=RANK, alpha=ALPHA), out, base_path=str(hf_dir))
    if dist.get_rank() == 0:
        import transformers as tf
        from peft import PeftModel
        from safetensors.torch import load_file

        exported = load_file(out / "adapter_model.safetensors")
        assert set(exported) == set(ADAPTERS), f"exported names differ: {set(exported) ^ set(ADAPTERS)}"
        assert all(torch.equal(exported[k], v) for k, v in ADAPTERS.items()), "export is not bit-exact"
        hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        pm = PeftModel.from_pretrained(hf, out).eval()
        with torch.no_grad():
            err = rel_err(pm(ids).logits, logits_ref)
        assert err < TOL, f"PeftModel.from_pretrained(exported) logits relative error {err:.2e}"
        print(
            f"export peft adapter tp=2 pp=2: {len(exported)} tensors bit-exact, logits {err:.1e}", flush=True
        )
    dist.barrier()


def check_optimizers(hf_dir: Path) -> None:
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(2, 12, 250, generator=torch.Generator().manual_seed(4))
    for backend in ("local", "megatron"):
        args, model = build(hf_dir, False, lora=True)
        with torch.no_grad():  # non-zero B so every adapter gets a gradient
            for k, p in L.adapter_state(model).items():
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(k)))
        opt = build_optimizer(model, OptimConfig(backend=backend, lr=1e-2), 10)
        held = {id(p) for p in opt.params}
        adapters = {id(p) for p in L.adapter_state(model).values()}
        assert held == adapters, f"{backend}: optimizer params are not exactly the adapters"
        base = {k: v.clone() for k, v in model_params(model).items() if not L.is_adapter(k)}
        before = {k: v.clone() for k, v in L.adapter_state(model).items()}
        run(model, ids, weights, args.vocab_size, forward_only=False)
        opt.step()
        after = model_params(model)
        assert all(torch.equal(after[k], v) for k, v in base.items()), f"{backend}: a base weight changed"
        moved = sum(not torch.equal(before[k], v) for k, v in L.adapter_state(model).items())
        assert moved == len(before), f"{backend}: {len(before) - moved} adapters did not move"
        if dist.get_rank() == 0:
            print(f"optimizer {backend}: holds {len(held)} adapter tensors only; base unchanged", flush=True)


ADAPTERS: dict = {}


def main() -> None:
    root = Path(sys.argv[1])
    hf_dir = root / "qwen2"
    init_distributed(1, 1, seed=0)
    if dist.get_rank() == 0:
        make_tiny_hf("qwen2", hf_dir, seed=1)
    dist.barrier()
    args = ModelArgs.from_hf_config(hf_dir, tp=2)
    ADAPTERS.update(random_peft_adapters(args))
    ids = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, 12, args.vocab_size, generator=torch.Generator().manual_seed(1))
    ref = peft_reference(hf_dir, ADAPTERS, ids, weights)
    for sp in (False, True):
        init_distributed(2, 2, seed=0)
        check_layout(hf_dir, sp, ids, weights, ref)
    destroy_distributed()


if __name__ == "__main__":
    main()
