"""World 4: HF -> megatron -> HF round trip bit-exact through torch_dist and legacy at TP=2 x PP=2, and a
torch_dist checkpoint saved at TP=2 x PP=2 loading at TP=1 x PP=1 (and the reverse) with the same logits.

argv: a shared tmp dir.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from models_parity import gather_vocab, rel_err  # noqa: E402
from models_tiny import hf_logits, make_tiny_hf  # noqa: E402

from megatron_rl.checkpoint import convert  # noqa: E402
from megatron_rl.distributed import destroy_distributed, init_distributed  # noqa: E402
from megatron_rl.models import ModelArgs, build_model, load_hf_weights  # noqa: E402
from tests.reference_forward import forward_pipeline  # noqa: E402

KINDS = ("llama", "qwen2")  # llama: vocab 320 pads to 512 at TP=2, 384 at TP=1; qwen2: tied


def check_round_trip(root: Path, kind: str, fmt: str) -> None:
    from safetensors.torch import load_file

    ckpt, back = root / f"{kind}_{fmt}", root / f"{kind}_{fmt}_hf"
    convert.hf_to_megatron(root / kind, ckpt, tp=2, pp=2, fmt=fmt)
    dist.barrier()
    convert.megatron_to_hf(ckpt, back)
    dist.barrier()
    if dist.get_rank() == 0:
        original, exported = (
            load_file(root / kind / "model.safetensors"),
            load_file(back / "model.safetensors"),
        )
        assert set(original) == set(exported), f"{kind} {fmt}: keys differ {set(original) ^ set(exported)}"
        bad = [k for k in original if not torch.equal(original[k], exported[k])]
        assert not bad, f"{kind} {fmt}: not bit-exact: {bad[:5]}"
        assert (back / "config.json").is_file()
        print(f"roundtrip {kind} {fmt} tp=2 pp=2: {len(original)} tensors bit-exact", flush=True)


def logits_at(args: ModelArgs, model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return gather_vocab(forward_pipeline(model, ids))[..., : args.vocab_size]  # [B, T, V]


def check_reshard(root: Path, kind: str, save_layout, load_layout, ids, ref) -> None:
    ckpt = root / f"{kind}_reshard_{save_layout[0]}x{save_layout[1]}"
    init_distributed(*save_layout, seed=0)
    args = ModelArgs.from_hf_config(root / kind, tp=save_layout[0])
    model = build_model(args)
    load_hf_weights(model, root / kind, args)
    before = logits_at(args, model, ids)
    convert.save_torch_dist(model, ckpt / convert.iter_dir_name(1))
    if dist.get_rank() == 0:
        convert.write_metadata(ckpt, args, "torch_dist", *save_layout, "actor", 1, root / kind)
    dist.barrier()
    init_distributed(*load_layout, seed=0)
    info = convert.find_checkpoint(ckpt)
    loaded_args = info.args.with_tp(load_layout[0])
    model = build_model(loaded_args)
    convert.load_torch_dist(model, info.iter_dir)
    after = logits_at(loaded_args, model, ids)
    err, err_hf = rel_err(after, before), rel_err(after, ref)
    assert err < 1e-6 and err_hf < 1e-5, (
        f"{kind} {save_layout}->{load_layout}: rel err {err:.2e} / HF {err_hf:.2e}"
    )
    if dist.get_rank() == 0:
        print(f"reshard {kind} {save_layout}->{load_layout} rel_err={err:.2e} vs_hf={err_hf:.2e}", flush=True)


def main() -> None:
    root = Path(sys.argv[1])
    init_distributed(1, 1, seed=0)
    if dist.get_rank() == 0:
        for i, kind in enumerate(KINDS):
            make_tiny_hf(kind, root / kind, seed=10 + i)
    dist.barrier()
    for kind in KINDS:
        for fmt in convert.FORMATS:
            check_round_trip(root, kind, fmt)
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(3))
    for kind in KINDS:
        ref = hf_logits(root / kind, ids)
        check_reshard(root, kind, (2, 2), (1, 1), ids, ref)
        check_reshard(root, kind, (1, 1), (2, 2), ids, ref)
    destroy_distributed()


if __name__ == "__main__":  # required: dist_checkpointing's writer starts a spawn-context Manager
    main()
