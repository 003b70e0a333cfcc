"""World 2, the optimizer package (``megatron_rl.optim``):

- ``hybrid``: megatron-core's hybrid-device optimizer (``optim.optimizer_cpu_offload``, a fraction of the
  optimizer state stepped by torch's CPU AdamW) gives the parameters, losses and grad norms of the plain
  distributed optimizer after two PPO actor updates (four optimizer steps) at DP=2, bf16 weights (it
  cannot take fp32 weights: megatron-core 0.16.1 hands it non-leaf views of them).
- ``hybrid_checkpoint``: its checkpoint resumes bit for bit at DP=2 with another offload fraction, at TP=2
  (DP=1: written from and read into the live tensors) and across the two; the plain distributed optimizer
  resumes it (see the function).
- ``fp32_accumulation``: the local backend sums 32 micro-batch gradients of a bf16 model in fp32
  ``main_grad``: equal to the float64 sum of the same 32 bf16 micro-batch gradients (the exact gradient of
  the whole batch for these bf16 backward passes) to fp32 tolerance. The old bf16 ``param.grad`` sum is
  measured alongside: relative error 6.1e-3 (2.2e-9 now).
- ``offload``: offloading fp32 main params, Adam moments and gradient buffers around every update (as the
  trainer does around generation) trains bit-identically to not offloading, on both backends (local,
  megatron with and without the distributed optimizer); while offloaded their storages hold 0 bytes and
  forward passes (generation) see the same weights.

    torchrun --nproc-per-node=2 tests/distributed/workers/optim_worker.py TMP_DIR [SECTION ...]
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from megatron_rl.checkpoint.safe_load import load_dist
from megatron_rl.checkpoint.state import role_sharded_state
from megatron_rl.config.schema import ActorConfig, OptimConfig
from megatron_rl.distributed import init_distributed
from megatron_rl.models import ModelArgs, build_model, export_hf_state_dict, load_hf_weights, unwrap
from megatron_rl.optim import LocalOptimizer
from megatron_rl.trainer.workers import PolicyWorker
from tests.distributed.workers.mcore_optim_worker import SEQS, R, global_batch
from tests.distributed.workers.models_tiny import make_tiny_hf
from tests.reference_forward import forward_logits


class Run:
    """A PolicyWorker on the tiny Qwen3 at TP=``tp``, PP=1 (DP=2 at TP=1), its optimizer built from ``optim``."""

    def __init__(self, path: Path, dtype=torch.float32, tp: int = 1, **optim):
        init_distributed(tp, 1, seed=0)
        self.args = ModelArgs.from_hf_config(path, tp=tp)
        model = build_model(self.args, "actor", dtype)
        load_hf_weights(model, path, self.args)
        model = model.to(dtype)
        cfg = OptimConfig(lr=3e-3, weight_decay=0.1, eps=1e-4, clip_grad=0.5, lr_warmup_steps=2,
                          lr_decay_style="cosine", **optim)  # fmt: skip
        actor = ActorConfig(optim=cfg, ppo_micro_batch_size_per_gpu=1, entropy_coeff=0.01)
        self.worker = PolicyWorker(model, actor, 1.0, self.args.vocab_size, total_steps=12, response_len=R)
        self.opt = self.worker.opt

    def batch(self, step: int):
        """This DP rank's half of ``global_batch(step)`` for two optimizer steps, and the per-step size."""
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mini = SEQS // 2 // dp
        rows = [half * SEQS // 2 + rank * mini + i for half in range(2) for i in range(mini)]
        return global_batch(step, self.args.vocab_size).select(rows), mini

    def update(self, step: int) -> dict:
        """Two optimizer steps over this DP rank's half of ``global_batch(step)``."""
        batch, mini = self.batch(step)
        batch.old_log_probs = self.worker.log_probs(batch)
        return self.worker.update(batch, mini)

    def params(self) -> dict:
        return export_hf_state_dict(self.worker.model, self.args)

    def save(self, ckpt: Path) -> dict:
        """The actor's weights and optimizer as the Checkpointer writes them; returns ``host_state``."""
        if dist.get_rank() == 0:
            ckpt.mkdir(parents=True)
        dist.barrier()
        w = self.worker
        dist_checkpointing.save({"actor": role_sharded_state("actor", unwrap(w.model), w.opt)}, str(ckpt))
        return w.opt.host_state()

    def load(self, ckpt: Path, host: dict) -> None:
        """As ``Checkpointer.load``: the weights, then the optimizer's tensors, then its host state."""
        w = self.worker
        loaded = load_dist(
            {"actor": role_sharded_state("actor", unwrap(w.model), w.opt, is_loading=True)}, ckpt
        )
        unwrap(w.model).load_state_dict({k[len("actor.") :]: v for k, v in loaded["actor"]["model"].items()})
        w.opt.load_sharded_state_dict(loaded["actor"]["optim"])
        w.opt.load_host_state(host)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def mean_diff(a: dict, b: dict) -> float:
    return torch.cat([(a[k].float() - b[k].float()).reshape(-1) for k in a]).abs().mean().item()


def hybrid(root: Path) -> None:
    """Hybrid-device optimizer == distributed optimizer, up to bf16 rounding ties of a different AdamW kernel
    (fused CPU vs foreach) after 4 steps, at offload fractions 0.5 (CPU and "device" parts) and 1.0 with overlap."""
    path, dtype = root / "qwen3", torch.bfloat16
    ref_run = Run(path, dtype, backend="megatron", use_distributed_optimizer=True)
    init = ref_run.params()
    ref_metrics = [ref_run.update(s) for s in range(2)]
    ref = ref_run.params()
    for fraction, overlap in ((0.5, False), (1.0, True)):
        what = f"hybrid {dtype} fraction={fraction} overlap={overlap}"
        run = Run(path, dtype, backend="megatron", use_distributed_optimizer=True,
                  optimizer_cpu_offload=True, optimizer_offload_fraction=fraction,
                  overlap_cpu_optimizer_d2h_h2d=overlap)  # fmt: skip
        inner = run.opt.inner
        assert isinstance(inner, HybridDeviceOptimizer), what
        on_host = sum(p.numel() for o in inner.cpu_optimizers for g in o.param_groups for p in g["params"])
        total = sum(p.numel() for g in inner.param_groups for p in g["params"])
        assert on_host >= fraction * total and (fraction == 1.0) == (inner.gpu_optimizer is None), what
        assert (len(inner.cpu_optimizers) > 1) == overlap, what  # overlap: one CPU optimizer per param
        metrics = [run.update(s) for s in range(2)]
        assert run.opt.adam_step() == 4, what
        got = run.params()
        for m, r in zip(metrics, ref_metrics, strict=True):
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr"):
                assert abs(m[key] - r[key]) <= 1e-4 * max(1.0, abs(r[key])), (what, key, m[key], r[key])
        if dist.get_rank() == 0:  # the exported weights live on rank 0
            moved, diff = mean_diff(ref, init), mean_diff(got, ref)
            differ = sum(int((got[k] != ref[k]).sum()) for k in ref) / sum(v.numel() for v in ref.values())
            print(
                f"ok {what}: mean |moved| {moved:.3g}, mean |diff| {diff:.3g}, differing elements "
                f"{differ:.3g}",
                flush=True,
            )
            assert moved > 1e-3 and diff < 1e-3 * moved and differ < 1e-3, (what, moved, diff, differ)


def fp32_accumulation(root: Path) -> None:
    """32 micro-batches of a bf16 model: fp32 main_grad == float64 sum of the bf16 micro-batch grads."""
    path, n_micro = root / "qwen3", 32
    init_distributed(1, 1, seed=0)
    args = ModelArgs.from_hf_config(path, tp=1)
    model = build_model(args, "actor", torch.bfloat16)
    load_hf_weights(model, path, args)
    model = model.to(torch.bfloat16)
    opt = LocalOptimizer(model, OptimConfig(), total_steps=1)
    ids = torch.randint(1, args.vocab_size, (n_micro, 10), generator=torch.Generator().manual_seed(7))

    def loss(i: int) -> torch.Tensor:
        logits = forward_logits(model, ids[i : i + 1, :-1]).float()  # [1, T-1, V]
        return torch.nn.functional.cross_entropy(logits[0], ids[i, 1:], reduction="sum") / n_micro

    exact = [torch.zeros_like(p, dtype=torch.float64) for p in opt.params]
    bf16_sum = [torch.zeros_like(p) for p in opt.params]  # what accumulating in bf16 .grad did
    for i in range(n_micro):  # autograd.grad fires no accumulate-grad hooks
        for e, b, g in zip(exact, bf16_sum, torch.autograd.grad(loss(i), opt.params)):
            e += g.double()
            b += g
    for i in range(n_micro):
        loss(i).backward()  # the trainer's path: hooks add each bf16 grad into the fp32 main_grad
    assert all(p.grad is None and p.main_grad.dtype == torch.float32 for p in opt.params)

    def rel_err(got) -> float:
        diff = torch.cat([(g.double() - e).reshape(-1) for g, e in zip(got, exact)])
        return (diff.norm() / torch.cat([e.reshape(-1) for e in exact]).norm()).item()

    fp32_err, bf16_err = rel_err([p.main_grad for p in opt.params]), rel_err(bf16_sum)
    if dist.get_rank() == 0:
        print(f"ok fp32 accumulation of {n_micro} micro-batches: relative error {fp32_err:.2g} "
              f"(bf16 .grad accumulation: {bf16_err:.2g})", flush=True)  # fmt: skip
    assert fp32_err < 1e-6, fp32_err
    assert bf16_err > 100 * fp32_err, (bf16_err, fp32_err)
    opt.zero_grad()
    assert all(p.main_grad is None for p in opt.params)


OFFLOAD = dict(param_offload=True, optimizer_offload=True, grad_offload=True)


def flat(run: Run) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in run.worker.model.parameters()])


def offload(root: Path) -> None:
    """Offload + reload around every update == no offload, bit for bit, on both backends."""
    path = root / "qwen3"
    for backend, distopt in (("local", False), ("megatron", False), ("megatron", True)):
        what = f"offload {backend} distopt={distopt}"
        plain = Run(path, torch.bfloat16, backend=backend, use_distributed_optimizer=distopt)
        plain_metrics, plain_lp = [], []
        for s in range(2):
            plain_lp.append(plain.worker.log_probs(plain.batch(s)[0]))
            plain_metrics.append(plain.update(s))
        run = Run(path, torch.bfloat16, backend=backend, use_distributed_optimizer=distopt, **OFFLOAD)
        n = sum(p.numel() for p in run.opt.params)
        for s in range(2):
            tensors = run.opt.offload_tensors()
            released = run.opt.offload()
            parked = [t for ts in tensors.values() for t in ts if t is not None]
            assert parked and all(t.untyped_storage().nbytes() == 0 for t in parked), what
            # fp32 main params (4 B/param), after the first step Adam moments (8 B), megatron's fp32 grad
            # buffers (4 B); the distributed optimizer holds half of the main params and moments at DP=2
            expect = (4 + (8 if s else 0)) * n / (2 if distopt else 1) + (
                4 * n if backend == "megatron" else 0
            )
            assert released >= expect, (what, s, released, expect)
            lp = run.worker.log_probs(run.batch(s)[0])  # generation reads the weights meanwhile
            assert torch.equal(lp, plain_lp[s]), what
            run.opt.reload()
            assert run.opt.offload() == released and run.opt.offloaded, "a second round trip moves as much"
            run.opt.reload()
            assert run.update(s) == plain_metrics[s], what
        assert torch.equal(flat(run), flat(plain)), what
        if dist.get_rank() == 0:
            print(f"ok {what}: bit-identical, {released / n:.1f} bytes/param offloaded", flush=True)


HYBRID = dict(backend="megatron", use_distributed_optimizer=True, optimizer_cpu_offload=True)


def state_ptrs(run: Run) -> set[int]:
    """Data pointers of the hybrid optimizer's fp32 master params and moments (created if absent)."""
    run.opt._ensure_state()
    return {t.data_ptr() for st in run.opt.inner.state.values() for k, t in st.items() if k != "step"}


def hybrid_checkpoint(root: Path) -> None:
    """The hybrid optimizer's checkpoint: saved at DP=2 after 4 steps (megatron-core's exchange), resumed at
    DP=2 with another offload fraction and overlap it trains on bit for bit like the uninterrupted run (the
    state is split anew; on CPU both parts run the same AdamW kernel). Resumed at TP=2 (DP=1) it loads into
    the live tensors and continues close to it (TP changes the reduction order); saved there (from the live
    tensors) it resumes bit for bit at DP=1 and at DP=2. The plain distributed optimizer resumes it."""
    path, bf16 = root / "qwen3", torch.bfloat16
    ref = Run(path, bf16, optimizer_offload_fraction=0.5, **HYBRID)
    for s in range(2):
        ref.update(s)
    ckpt = root / "hybrid_dp2"
    host, saved_params = ref.save(ckpt), ref.params()
    assert host["adam_step"] == 4, host
    ref_metrics = [ref.update(s) for s in (2, 3)]
    ref_flat, ref_params = flat(ref), ref.params()

    def resumed(ckpt: Path, host: dict, what: str, tp: int = 1, **optim) -> tuple[Run, list[dict]]:
        run = Run(path, bf16, tp=tp, **optim)
        run.load(ckpt, host)
        assert run.opt.adam_step() == host["adam_step"], what
        if run.opt.hybrid is not None:  # nothing loaded stays referenced: each state tensor owns its storage
            for sub in run.opt.hybrid.sub_optimizers:
                for p, st in sub.state.items():
                    assert st["master_param"] is p, what
                    for t in st.values():
                        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), what
        metrics = [run.update(s) for s in (2, 3)]
        assert run.opt.adam_step() == host["adam_step"] + 4, what  # each param's step moved once per step
        return run, metrics

    what = "hybrid resume at DP=2, fraction 0.5 -> 1.0 with overlap"
    run, metrics = resumed(ckpt, host, what, optimizer_offload_fraction=1.0, overlap_cpu_optimizer_d2h_h2d=True,
                           **HYBRID)  # fmt: skip
    assert metrics == ref_metrics and torch.equal(flat(run), ref_flat), what
    if dist.get_rank() == 0:
        print(f"ok {what}: bit-identical", flush=True)

    what = "hybrid DP=2 checkpoint resumed at TP=2 DP=1 (in place)"
    tp2 = Run(path, bf16, tp=2, optimizer_offload_fraction=0.5, **HYBRID)
    live = state_ptrs(tp2)
    tp2.load(ckpt, host)
    assert state_ptrs(tp2) == live, f"{what}: the state tensors were replaced"
    ckpt_tp2 = root / "hybrid_tp2"
    host_tp2 = tp2.save(ckpt_tp2)
    tp2_metrics = [tp2.update(s) for s in (2, 3)]
    tp2_flat, tp2_params = flat(tp2), tp2.params()
    if dist.get_rank() == 0:
        diff, moved = mean_diff(tp2_params, ref_params), mean_diff(ref_params, saved_params)
        differ = sum(int((tp2_params[k] != ref_params[k]).sum()) for k in ref_params) / sum(
            v.numel() for v in ref_params.values()
        )
        print(f"ok {what}: mean |diff to DP=2| {diff:.3g}, mean |moved| since the save {moved:.3g}, differing "
              f"elements {differ:.3g}", flush=True)  # fmt: skip
        assert diff < 0.02 * moved, (
            what,
            diff,
            moved,
        )  # measured 0.6%: bf16 ties of another TP reduction order
    run, metrics = resumed(
        ckpt_tp2, host_tp2, "TP=2 in place", tp=2, optimizer_offload_fraction=0.5, **HYBRID
    )
    assert metrics == tp2_metrics and torch.equal(flat(run), tp2_flat), (
        "written from the live tensors at DP=1"
    )
    run, metrics = resumed(ckpt_tp2, host_tp2, "TP=2 -> DP=2", optimizer_offload_fraction=0.5, **HYBRID)
    assert metrics == ref_metrics and torch.equal(flat(run), ref_flat), (
        "the DP=1 checkpoint holds the DP=2 state"
    )
    if dist.get_rank() == 0:
        print(
            "ok hybrid checkpoint written in place at DP=1 resumes at DP=1 and DP=2: bit-identical",
            flush=True,
        )

    what = "hybrid checkpoint resumed by the plain distributed optimizer"
    run, metrics = resumed(ckpt, host, what, backend="megatron", use_distributed_optimizer=True)
    for m, r in zip(metrics, ref_metrics, strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr"):
            assert abs(m[key] - r[key]) <= 1e-4 * max(1.0, abs(r[key])), (what, key, m[key], r[key])
    if dist.get_rank() == 0:
        print(f"ok {what}", flush=True)


SECTIONS = {"hybrid": hybrid, "hybrid_checkpoint": hybrid_checkpoint, "fp32_accumulation": fp32_accumulation,
            "offload": offload}  # fmt: skip

if __name__ == "__main__":
    root = Path(sys.argv[1])
    init_distributed(1, 1)
    if dist.get_rank() == 0:
        make_tiny_hf("qwen3", root / "qwen3")
    dist.barrier()
    for name in sys.argv[2:] or SECTIONS:
        SECTIONS[name](root)
    if dist.get_rank() == 0:
        print("optimizer checks passed")
