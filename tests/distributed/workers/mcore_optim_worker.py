"""World 2: ``optim.backend=megatron`` (megatron-core DDP + optimizer, with and without the distributed
optimizer) gives the parameters, losses and grad norms of ``optim.backend=local`` after a few PPO actor
updates (two optimizer steps each, clipping and weight decay active) at DP=2, TP=2 (Qwen3: q/k norms summed
over TP) and PP=2 (Qwen2: tied embedding summed over the embedding group); and its optimizer checkpoint,
saved at DP=2, resumes at TP=2 (and without the distributed optimizer) to the same parameters as an
uninterrupted run.

    torchrun --nproc-per-node=2 tests/distributed/workers/mcore_optim_worker.py TMP_DIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from safetensors.torch import load_file

from megatron_rl.checkpoint.layout import CheckpointError
from megatron_rl.checkpoint.state import (
    apply_loaded_optim,
    check_optimizer_backend,
    load_optimizer_json,
    optimizer_json,
    role_sharded_state,
)
from megatron_rl.config.schema import ActorConfig, OptimConfig
from megatron_rl.distributed import init_distributed
from megatron_rl.models import ModelArgs, build_model, export_hf_state_dict, load_hf_weights, unwrap
from megatron_rl.rollout.batch import RolloutBatch
from megatron_rl.trainer.workers import PolicyWorker
from tests.distributed.workers.models_tiny import make_tiny_hf

SEQS, T, PROMPT = 8, 12, 4  # global sequences per update, tokens, prompt tokens
R = T - PROMPT


def global_batch(step: int, vocab: int) -> RolloutBatch:
    """The same random PPO batch on every rank for update ``step`` (responses of varying length)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, vocab, (SEQS, T), generator=g)  # [B, T]
    lens = torch.randint(2, R + 1, (SEQS,), generator=g)  # [B]
    mask = (torch.arange(R)[None] < lens[:, None]).float()  # [B, R]
    return RolloutBatch(
        input_ids=ids,
        responses=ids[:, PROMPT:],
        response_mask=mask,
        score_pos=(PROMPT - 1 + torch.arange(R)).expand(SEQS, R),
        prompt_lens=torch.full((SEQS,), PROMPT),
        response_lens=lens,
        group_index=torch.arange(SEQS) // 2,
        rollout_log_probs=torch.zeros(SEQS, R),
        finish_reasons=["length"] * SEQS,
        rows=[None] * SEQS,
        advantages=torch.randn(SEQS, R, generator=g),
    )


class Run:
    """One layout + backend: a PolicyWorker on a tiny HF model, updated with ``global_batch``es."""

    def __init__(
        self, path: Path, tp: int, pp: int, backend: str, distopt: bool = False, dtype=torch.float32
    ):
        init_distributed(tp, pp, seed=0)
        self.args = ModelArgs.from_hf_config(path, tp=tp)
        model = build_model(self.args, "actor", dtype)
        load_hf_weights(model, path, self.args)
        model = model.to(dtype)
        # eps=1e-4: Adam would blow float noise up into lr-sized steps on weights whose true gradient is ~0
        # (the k bias: softmax ignores a shift shared by all keys); it is noise of either backend.
        optim = OptimConfig(lr=3e-3, weight_decay=0.1, eps=1e-4, clip_grad=0.5, lr_warmup_steps=2,
                            lr_decay_style="cosine", backend=backend, use_distributed_optimizer=distopt)  # fmt: skip
        cfg = ActorConfig(optim=optim, ppo_micro_batch_size_per_gpu=1, entropy_coeff=0.01)
        self.worker = PolicyWorker(model, cfg, 1.0, self.args.vocab_size, total_steps=12, response_len=R)
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

    def update(self, step: int) -> dict:
        """Two optimizer steps: global rows 0-3, then 4-7, split over the DP ranks."""
        mini = SEQS // 2 // self.dp  # sequences per rank per optimizer step
        rows = [half * SEQS // 2 + self.dp_rank * mini + i for half in range(2) for i in range(mini)]
        batch = global_batch(step, self.args.vocab_size).select(rows)
        batch.old_log_probs = self.worker.log_probs(batch)
        return self.worker.update(batch, mini)

    def params(self) -> dict | None:
        """The whole model on rank 0 (HF names); also checks that DP replicas hold the same weights."""
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.worker.model.parameters()])
        replicas = [torch.empty_like(flat) for _ in range(self.dp)]
        dist.all_gather(replicas, flat, group=ps.get_data_parallel_group())
        assert all(torch.equal(r, flat) for r in replicas), "DP replicas differ after the update"
        return export_hf_state_dict(self.worker.model, self.args)

    def save(self, ckpt: Path):
        if dist.get_rank() == 0:
            ckpt.mkdir(parents=True)
        dist.barrier()
        w = self.worker
        dist_checkpointing.save({"actor": role_sharded_state("actor", unwrap(w.model), w.opt)}, str(ckpt))
        return optimizer_json(w.opt, w.sched)

    def load(self, ckpt: Path, host: dict) -> None:
        w = self.worker
        sharded = {"actor": role_sharded_state("actor", unwrap(w.model), w.opt, is_loading=True)}
        loaded = dist_checkpointing.load(sharded, str(ckpt))
        unwrap(w.model).load_state_dict({k[len("actor.") :]: v for k, v in loaded["actor"]["model"].items()})
        apply_loaded_optim(w.opt, loaded["actor"]["optim"])
        load_optimizer_json(w.opt, w.sched, host)


def close(got: dict | None, ref: dict | None, what: str, atol: float = 1e-6) -> None:
    if dist.get_rank() != 0:
        return
    assert sorted(got) == sorted(ref), what
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert worst < atol, f"{what}: max |param difference| {worst:.3g}"


def close_metrics(got: list[dict], ref: list[dict], what: str) -> None:
    for g, r in zip(got, ref, strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/entropy"):
            assert abs(g[key] - r[key]) <= 1e-5 * max(1.0, abs(r[key])), (what, key, g[key], r[key])


def parity(root: Path) -> None:
    """megatron (both optimizers) against local at the same layout (across layouts the local backend itself
    differs by float reduction order)."""
    for kind, layouts in (("qwen3", ((1, 1), (2, 1))), ("qwen2", ((1, 1), (1, 2)))):
        path = root / kind
        if dist.get_rank() == 0:
            make_tiny_hf(kind, path)
        dist.barrier()
        for tp, pp in layouts:
            local = Run(path, tp, pp, "local")
            ref_metrics = [local.update(s) for s in range(2)]
            ref = local.params()
            for distopt in (False, True):
                what = f"{kind} TP={tp} PP={pp} DP={2 // (tp * pp)} megatron distopt={distopt}"
                run = Run(path, tp, pp, "megatron", distopt)
                assert (
                    unwrap(run.worker.opt.ddp) is run.worker.model
                )  # megatron_rl.models.unwrap sees through
                metrics = [run.update(s) for s in range(2)]
                close(run.params(), ref, what)
                close_metrics(metrics, ref_metrics, what)
                if dist.get_rank() == 0:
                    print("ok", what, flush=True)


def bf16_smoke(root: Path) -> None:
    """bf16 at DP=2 (Float16Optimizer / DistributedOptimizer with fp32 main params, fp32 grad buffers): the
    update moves the weights as the local backend's does (bf16 grads reduced in bf16 there, so only close)."""
    path = root / "qwen3"
    runs = {}
    for backend, distopt in (("local", False), ("megatron", False), ("megatron", True)):
        run = Run(path, 1, 1, backend, distopt, dtype=torch.bfloat16)
        metrics = run.update(0)
        assert all(v == v for v in metrics.values()), metrics  # no NaN
        runs[(backend, distopt)] = (run.params(), metrics)
    if dist.get_rank() == 0:
        init = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
        ref, ref_m = runs[("local", False)]
        names = sorted(init)

        def mean_abs(a: dict, b: dict) -> float:  # over all elements
            return torch.cat([(a[k].float() - b[k].float()).reshape(-1) for k in names]).abs().mean().item()

        for key, (got, m) in runs.items():
            moved, diff = mean_abs(got, init), mean_abs(got, ref)
            assert moved > 1e-4 and diff < 0.2 * moved, (key, moved, diff)  # ties of bf16 rounding differ
            print(f"bf16 {key}: mean |moved| {moved:.3g}, mean |diff to local| {diff:.3g}", flush=True)
            assert abs(m["actor/grad_norm"] - ref_m["actor/grad_norm"]) < 0.02 * ref_m["actor/grad_norm"], key
        print("ok bf16 at DP=2, both megatron optimizers", flush=True)


def checkpoint_reshard(root: Path) -> None:
    """Save at DP=2 after 2 updates, resume at TP=2 (and at DP=2), update twice more: the parameters equal
    the uninterrupted DP=2 run's. Another optimizer kind is refused before anything is read."""
    path = root / "qwen3"
    for distopt in (True, False):
        uninterrupted = Run(path, 1, 1, "megatron", distopt)  # DP=2
        for s in range(2):
            uninterrupted.update(s)
        ckpt = root / f"ckpt_dp2_distopt{int(distopt)}"
        host = uninterrupted.save(ckpt)
        assert host["backend"] == "megatron" and host["adam_step"] == 4, host
        assert host["use_distributed_optimizer"] == distopt, host
        for s in range(2, 4):
            uninterrupted.update(s)
        ref = uninterrupted.params()
        for tp in (2, 1):
            what = f"resume of a DP=2 megatron distopt={distopt} checkpoint at TP={tp} DP={2 // tp}"
            run = Run(path, tp, 1, "megatron", distopt)
            run.load(ckpt, host)
            assert run.worker.opt.adam_step() == 4, what
            for s in range(2, 4):
                run.update(s)
            close(run.params(), ref, what)
            if dist.get_rank() == 0:
                print("ok", what, flush=True)
        for backend, other in (("megatron", not distopt), ("local", False)):
            run = Run(path, 2, 1, backend, other)
            try:
                check_optimizer_backend("actor", host, run.worker.opt, ckpt)
            except CheckpointError as err:
                assert f"actor.optim.use_distributed_optimizer={str(distopt).lower()}" in str(err), err
            else:
                raise AssertionError(f"{backend} distopt={other} accepted a distopt={distopt} checkpoint")
        if dist.get_rank() == 0:
            print("ok other optimizer kinds refused", flush=True)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    init_distributed(1, 1)
    parity(root)
    bf16_smoke(root)
    checkpoint_reshard(root)
    if dist.get_rank() == 0:
        print("mcore optimizer checks passed")
