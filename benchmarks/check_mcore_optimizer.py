"""``optim.backend=megatron`` (megatron-core DDP + optimizer, issue 5) against ``optim.backend=local`` on the
Qwen2.5-0.5B shape (random bf16 weights), two GPUs: N PPO actor updates (``PolicyWorker.update``, one
optimizer step each) on the same synthetic batches, per layout and backend.

Writes per run: per-step pg_loss / grad_norm / lr, seconds per update (median), peak and steady memory per
GPU, which Adam megatron-core picked; and per megatron run the parameter difference to the local run of the
same layout after the N steps (max / mean |diff|, fraction of elements that differ, next to how far the
local run moved the weights). Expect small non-zero differences: megatron accumulates and reduces grads in
fp32 buffers, the local backend in bf16.

    torchrun --nproc-per-node=2 benchmarks/check_mcore_optimizer.py --out $OUT/mcore_optimizer.json
    torchrun --nproc-per-node=2 benchmarks/check_mcore_optimizer.py --tiny --out /tmp/mcore_optimizer.json  # CPU

Runs (world 2): ``dp2/local``, ``dp2/megatron``, ``dp2/megatron_distopt`` and, unless ``--no-tp``,
``tp2/local``, ``tp2/megatron_distopt``; unless ``--no-ckpt``, ``dp2/megatron_distopt`` also writes the
trainer's checkpoint (weights + distributed-optimizer state, ``fully_reshardable``) before its last update,
and ``dp2_ckpt_resumed_at_tp2/megatron_distopt`` loads it at TP=2 and does that last update (its params are
compared with the uninterrupted DP=2 run's). Budget on 2 H200: ~2-3 minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rl_step import prepare  # noqa: E402

RUNS_DP2 = (("dp2/local", 1, "local", False), ("dp2/megatron", 1, "megatron", False),
            ("dp2/megatron_distopt", 1, "megatron", True))  # fmt: skip
RUNS_TP2 = (("tp2/local", 2, "local", False), ("tp2/megatron_distopt", 2, "megatron", True))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synthetic_batch(step: int, n: int, seq_len: int, prompt_len: int, vocab: int):
    """The same global RolloutBatch of ``n`` sequences on every rank for update ``step``."""
    from megatron_rl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(1000 + step)
    r = seq_len - prompt_len
    ids = torch.randint(1, vocab, (n, seq_len), generator=g)  # [B, T]
    lens = torch.randint(r // 2, r + 1, (n,), generator=g)  # [B]
    return RolloutBatch(
        input_ids=ids,
        responses=ids[:, prompt_len:],  # [B, R]
        response_mask=(torch.arange(r)[None] < lens[:, None]).float(),  # [B, R]
        score_pos=(prompt_len - 1 + torch.arange(r)).expand(n, r),  # [B, R]
        prompt_lens=torch.full((n,), prompt_len),
        response_lens=lens,
        group_index=torch.arange(n),
        rollout_log_probs=torch.zeros(n, r),
        finish_reasons=["length"] * n,
        rows=[None] * n,
        advantages=torch.randn(n, r, generator=g),
    )


def to_device(batch, dev):
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            setattr(batch, name, value.to(dev))
    return batch


def save_ckpt(worker, ckpt: Path) -> dict:
    """The trainer's checkpoint of the actor's weights + optimizer (dist_checkpointing), as the manager
    writes it. Returns the host-side optimizer JSON."""
    import shutil

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.state import optimizer_json, role_sharded_state
    from megatron_rl.models import unwrap

    if dist.get_rank() == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(
        {"actor": role_sharded_state("actor", unwrap(worker.model), worker.opt)}, str(ckpt)
    )
    return optimizer_json(worker.opt, worker.sched)


def load_ckpt(worker, ckpt: Path, host: dict) -> None:
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.state import apply_loaded_optim, load_optimizer_json, role_sharded_state
    from megatron_rl.models import unwrap

    core = unwrap(worker.model)
    loaded = dist_checkpointing.load(
        {"actor": role_sharded_state("actor", core, worker.opt, is_loading=True)}, str(ckpt)
    )
    core.load_state_dict({k[len("actor.") :]: v for k, v in loaded["actor"]["model"].items()})
    apply_loaded_optim(worker.opt, loaded["actor"]["optim"])
    load_optimizer_json(worker.opt, worker.sched, host)


def one_run(
    a, model_dir: str, tp: int, backend: str, distopt: bool, dtype, ckpt: Path | None = None,
    save_before: int | None = None, host: dict | None = None,
) -> tuple[dict, dict | None]:  # fmt: skip
    """Updates ``first..a.steps-1`` of one layout/backend; with ``save_before`` a checkpoint is written to
    ``ckpt`` before that update; with ``host`` the run starts from ``ckpt`` at update ``save_before``.
    Returns (record, full HF-named params on rank 0 else None)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.config.schema import ActorConfig, OptimConfig
    from megatron_rl.distributed import device, init_distributed
    from megatron_rl.models import ModelArgs, build_model, export_hf_state_dict, load_hf_weights
    from megatron_rl.trainer.workers import PolicyWorker

    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0  # left over by earlier runs (want 0)
    init_distributed(tp, 1, seed=0)
    args = ModelArgs.from_hf_config(model_dir, tp=tp)
    model = build_model(args, "actor", dtype)
    load_hf_weights(model, model_dir, args)
    model = model.to(dtype)
    optim = OptimConfig(lr=a.lr, backend=backend, use_distributed_optimizer=distopt)
    cfg = ActorConfig(optim=optim, ppo_micro_batch_size_per_gpu=a.micro, use_kl_loss=False)
    worker = PolicyWorker(model, cfg, 1.0, args.vocab_size, a.steps, a.seq_len - a.prompt_len)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = a.mini // dp
    steps, seconds, record = [], [], {}
    first = 0
    if host is not None:
        t0 = time.perf_counter()
        load_ckpt(worker, ckpt, host)
        record["load_s"], first = time.perf_counter() - t0, save_before
    for step in range(first, a.steps):
        if step == save_before and host is None:
            t0 = time.perf_counter()
            record["host"] = save_ckpt(worker, ckpt)
            record["save_s"] = time.perf_counter() - t0
        full = synthetic_batch(step, a.mini, a.seq_len, a.prompt_len, args.vocab_size)
        batch = to_device(full.select(range(dp_rank * per_rank, (dp_rank + 1) * per_rank)), device())
        batch.old_log_probs = worker.log_probs(batch)
        sync()
        t0 = time.perf_counter()
        m = worker.update(batch, per_rank)  # one optimizer step
        sync()
        seconds.append(time.perf_counter() - t0)
        steps.append({k: m[f"actor/{k}"] for k in ("pg_loss", "grad_norm", "lr", "entropy")})
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(dp)]
    dist.all_gather(replicas, flat, group=ps.get_data_parallel_group())
    mem = {"start_gib": start_gib, "peak_gib": 0.0, "steady_gib": 0.0}
    if cuda:  # steady: weights + grad buffers + optimizer state between updates
        mem |= {"peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "steady_gib": torch.cuda.memory_allocated() / 2**30}  # fmt: skip
    per_rank_mem = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank_mem, mem)
    record |= {
        "tp": tp, "dp": dp, "backend": backend, "use_distributed_optimizer": distopt, "first_update": first,
        "steps": steps, "seconds_per_update": seconds, "median_s": statistics.median(seconds[1:] or seconds),
        "memory_per_gpu": per_rank_mem,
        "dp_replicas_identical": all(torch.equal(r, flat) for r in replicas),
    }  # fmt: skip
    if backend == "megatron":
        from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

        record["adam"] = worker.opt.adam_class
        record["megatron_core_torch_optimizer_fallback"] = bool(USING_PYTORCH_OPTIMIZER)
    params = export_hf_state_dict(model, args)
    if params is not None:
        params = {k: v.detach().float().cpu() for k, v in params.items()}
    del worker, model, flat, replicas
    return record, params


def compare(got: dict, ref: dict, init: dict, ref_name: str) -> dict:
    """How far ``got`` is from ``ref`` (the run named ``ref_name``), next to how far ``ref`` moved."""
    names = sorted(ref)
    diff = torch.cat([(got[k] - ref[k]).reshape(-1) for k in names]).abs()
    moved = torch.cat([(ref[k] - init[k]).reshape(-1) for k in names]).abs()
    return {
        "reference": ref_name,
        "max_abs_param_diff": diff.max().item(),
        "mean_abs_param_diff": diff.mean().item(),
        "frac_elements_differing": (diff > 0).float().mean().item(),
        "ref_max_abs_move_from_init": moved.max().item(),
        "ref_mean_abs_move_from_init": moved.mean().item(),
    }


def versions() -> dict:
    import megatron.core
    import transformers

    out = {"torch": torch.__version__, "megatron_core": megatron.core.__version__,
           "transformers": transformers.__version__}  # fmt: skip
    for mod in ("transformer_engine", "apex"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "present")
        except ImportError:
            out[mod] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="PPO updates (one optimizer step each) per run")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--mini", type=int, default=32, help="sequences per optimizer step, global")
    p.add_argument("--micro", type=int, default=4, help="sequences per forward/backward per rank")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--no-tp", action="store_true", help="skip the TP=2 runs")
    p.add_argument(
        "--no-ckpt", action="store_true", help="skip the checkpoint save (DP=2) / resume (TP=2) run"
    )
    p.add_argument("--ckpt-dir", default="/tmp/check_mcore_optimizer_ckpt")
    p.add_argument("--tiny", action="store_true", help="tiny shape, fp32 (the CPU smoke run)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "mcore_optimizer.json"))
    a = p.parse_args(argv)
    if a.tiny:
        a.seq_len, a.prompt_len, a.mini, a.micro = min(a.seq_len, 48), min(a.prompt_len, 16), 8, 2

    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_rl.config.entry import quiet_third_party
    from megatron_rl.distributed import init_distributed

    quiet_third_party()
    init_distributed(1, 1, seed=0)
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc-per-node=2 (the runs are DP=2 and TP=2 on 2 ranks)")
    tag = "tiny" if a.tiny else "qwen2_5_0_5b"
    model_dir = f"/tmp/bench_{tag}_random"
    if dist.get_rank() == 0:
        prepare(model_dir, f"/tmp/bench_{tag}_prompts_mcore", a.tiny, 8, 16)
    dist.barrier()
    dtype = torch.float32 if a.tiny or not torch.cuda.is_available() else torch.bfloat16
    init = None
    if dist.get_rank() == 0:
        init = {k: v.float() for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}
    t_start = time.perf_counter()
    runs, diffs, params_of = {}, {}, {}
    ckpt, save_before = Path(a.ckpt_dir), max(1, a.steps - 1)

    def report(name: str, record: dict) -> None:
        print(f"{name:26} {record['median_s'] * 1e3:8.1f} ms/update  peak "
              f"{max(m['peak_gib'] for m in record['memory_per_gpu']):6.2f} GiB  grad_norm "
              f"{[round(s['grad_norm'], 4) for s in record['steps']]}"
              + (f"  max|diff| {diffs[name]['max_abs_param_diff']:.3g}" if name in diffs else ""),
              flush=True)  # fmt: skip

    groups = [RUNS_DP2] + ([] if a.no_tp else [RUNS_TP2])
    for group in groups:
        ref, ref_name = None, None
        for name, tp, backend, distopt in group:
            with_ckpt = name == "dp2/megatron_distopt" and not a.no_ckpt
            record, params = one_run(a, model_dir, tp, backend, distopt, dtype, ckpt,
                                     save_before if with_ckpt else None)  # fmt: skip
            runs[name], params_of[name] = record, params
            if dist.get_rank() == 0:
                if backend == "local":
                    ref, ref_name = params, name
                else:
                    diffs[name] = compare(params, ref, init, ref_name)
                report(name, record)
    if not a.no_ckpt:  # the DP=2 distributed-optimizer checkpoint, resumed at TP=2 for the last update
        name = "dp2_ckpt_resumed_at_tp2/megatron_distopt"
        host = runs["dp2/megatron_distopt"].pop("host")
        record, params = one_run(a, model_dir, 2, "megatron", True, dtype, ckpt, save_before, host)
        runs[name] = record
        if dist.get_rank() == 0:  # against the uninterrupted DP=2 run (layouts differ: bf16 noise)
            diffs[name] = compare(params, params_of["dp2/megatron_distopt"], init, "dp2/megatron_distopt")
            report(name, record)
    out = {
        "config": vars(a) | {"model": f"{tag} shape, random weights", "dtype": str(dtype), "world_size": 2},
        "versions": versions(),
        "runs": runs,
        "param_diff": diffs,
        "wall_s": time.perf_counter() - t_start,
    }
    if dist.get_rank() == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {a.out} ({out['wall_s']:.0f} s)", flush=True)
    dist.barrier()
    return out


if __name__ == "__main__":
    main()
