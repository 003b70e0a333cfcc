"""End-to-end RL step of our trainer (issue 8, parts 1 and 3): throughput, time per phase, memory per phase.

A Python driver over the trainer's own pieces (``build_components`` + ``train_step``, the loop of
``megatron-rl train``), so it can read peak memory around each phase without changes to the trainer:
the engine's ``generate``, the actor/reference ``log_probs``, the critic's ``values`` and both ``update``
methods are wrapped on the instances and ``torch.cuda.max_memory_allocated`` is reset before and read
after each call.

Workload (the defaults): Qwen2.5-0.5B shape (vocab 151936, hidden 896, ffn 4864, 24 layers, 14 heads,
2 KV groups, qkv bias, tied embeddings, rope theta 1e6), random bf16 weights; 64 prompts x 8 samples,
prompts of exactly 256 tokens, responses of exactly 512 tokens (the tokenizer's EOS is dropped from the
stop ids, so every run does the same work), one optimizer step per rollout, a random reward.
``--algo ppo`` runs PPO with actor, critic and reference colocated (512 prompts x 1 sample by default).
``--lengths spread`` (issue 16): each response stops at a length drawn from a fixed-seed log-normal with
mean ~40% of the cap (``spread_lengths.py``; EOS forced there, never sampled earlier; the same lengths as
``bench_trl_grpo.py --lengths spread``); the roofline then counts the real trained tokens and live KV.

Tokens per second per GPU = (prompt + response tokens of the step) / step time / GPUs; the first step is
warm-up and excluded from the medians. Writes ``--out`` (JSON, rank 0).

    python benchmarks/bench_rl_step.py --algo grpo --out $OUT/rl_grpo.json                  # one GPU
    torchrun --nproc-per-node=2 benchmarks/bench_rl_step.py --algo grpo --out $OUT/rl2.json  # two GPUs
    python benchmarks/bench_rl_step.py --tiny --prompts 4 --n 2 --prompt-len 16 --response-len 8  # CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, for megatron_rl (no install)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for device_gaps
from _timing import machine_rates  # noqa: E402
from device_gaps import device_gaps  # noqa: E402
from sync_audit import SyncAudit, write  # noqa: E402

from megatron_rl.models.facts import (  # noqa: E402
    PEAK_BF16_FLOPS,
    PEAK_HBM_BYTES_PER_S,
    hbm_bytes_per_s,
    roofline_step_s,
)
from megatron_rl.models.shapes import SHAPES, hf_config, tiny_hf_config  # noqa: E402

# the CPU smoke shape: the tiny test model at 2 layers, vocab 1000
TINY = tiny_hf_config("qwen2", vocab_size=1000, num_hidden_layers=2, max_position_embeddings=2048)
PROMPT_CHARS = string.ascii_letters + string.digits  # one token each with the char-level tokenizer


def random_score(data_source, solution_str, ground_truth, extra_info=None, **_) -> float:
    """The benchmark's reward (reward.reward_fn=custom): uniform in [0, 1), so advantages are non-zero."""
    return random.random()


def prompts(count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` strings of ``length`` characters, each one token for the synthetic tokenizer."""
    rng = random.Random(seed)
    return ["".join(rng.choice(PROMPT_CHARS) for _ in range(length)) for _ in range(count)]


def shape_config(shape: str) -> dict:
    """The HF config dict of ``--shape`` (``megatron_rl.models.shapes``; "tiny" for the CPU smoke).
    Llama-3.1's llama3 rope scaling is dropped: the rollout decoder does not build it yet, and it changes
    only the rotary frequencies, not a FLOP or a byte of the step."""
    if shape == "tiny":
        return dict(TINY)
    cfg = hf_config(shape)
    cfg.pop("rope_scaling", None)
    return cfg


def prepare(model_dir: str, data_dir: str, shape: str, num_prompts: int, prompt_len: int) -> None:
    """A random-weight model of ``shape`` (bf16, HF format, initialised on the GPU when there is one) with
    the synthetic tokenizer of its vocab size, and ``<data_dir>/train.parquet`` of plain-text prompts;
    each skipped when already there."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_synthetic_gsm8k import tokenizer

    hf = shape_config(shape)
    if not (Path(model_dir) / "config.json").is_file():
        import transformers

        torch.manual_seed(0)
        arch = hf.pop("architectures")[0]
        cfg = transformers.AutoConfig.for_model(**hf, eos_token_id=0, pad_token_id=0, bos_token_id=0)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
        with torch.device(dev):  # random init on the GPU: minutes faster at 7-8B than on the host
            model = getattr(transformers, arch)(cfg).to(dtype)
        model.save_pretrained(model_dir)
        del model
        tokenizer(hf["vocab_size"]).save_pretrained(model_dir)
    train = Path(data_dir) / "train.parquet"
    if train.is_file() and pq.read_metadata(train).num_rows >= num_prompts:
        return
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    texts = prompts(num_prompts, prompt_len)
    table = pa.table(
        {
            "prompt": texts,
            "data_source": ["bench/random"] * num_prompts,
            "reward_model": [{"style": "rule", "ground_truth": "0"}] * num_prompts,
            "extra_info": [{"index": i} for i in range(num_prompts)],
        }
    )
    pq.write_table(table, train)


def overrides(a: argparse.Namespace) -> list[str]:
    """Hydra overrides of ``megatron-rl train`` for this workload (the same list works on the CLI)."""
    seqs = a.prompts * a.n
    common = [
        f"algorithm={a.algo}",
        "model=qwen2_5_0_5b",
        f"model.path={a.model_dir}",
        f"model.dtype={'float32' if a.shape == 'tiny' else 'bfloat16'}",
        f"data.train_files={a.data_dir}/train.parquet",
        "data.val_files=null",
        "data.apply_chat_template=false",
        f"data.max_prompt_length={a.prompt_len}",
        f"data.train_batch_size={a.prompts}",
        "data.shuffle=false",
        f"rollout.n={a.n}",
        f"rollout.max_new_tokens={a.response_len}",
        "rollout.temperature=1.0",
        f"actor.ppo_mini_batch_size={a.prompts}",  # the whole rollout: one optimizer step per step
        f"actor.ppo_micro_batch_size_per_gpu={min(a.micro, seqs)}",
        "reward.reward_fn=custom",
        f"reward.custom_reward_function.path={Path(__file__).resolve()}",
        "reward.custom_reward_function.name=random_score",
        f"trainer.total_training_steps={a.steps}",
        "trainer.total_epochs=1000",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "trainer.save_final=false",
        "trainer.write_report=false",
        "trainer.log_generations_freq=-1",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={a.output_dir}",
    ]
    if a.algo == "grpo":
        common += [f"actor.use_kl_loss={a.kl_coef > 0}", f"actor.kl_loss_coef={a.kl_coef}"]
    else:
        common += [
            f"critic.ppo_mini_batch_size={a.prompts}",
            f"critic.ppo_micro_batch_size_per_gpu={min(a.micro, seqs)}",
        ]
    return common + list(a.override)


class NoEosTokenizer:
    """The tokenizer with ``eos_token_id`` hidden from the trainer's stop ids: every response runs to
    ``rollout.max_new_tokens`` (a random model samples any id now and then, EOS included)."""

    eos_token_id = None

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)


class PhaseMemory:
    """Peak allocated/reserved GPU memory per wrapped phase (GiB), the max over the steps seen."""

    def __init__(self):
        self.peak: dict[str, float] = {}
        self.reserved: dict[str, float] = {}
        self.before: dict[str, float] = {}

    def wrap(self, phase: str, fn):
        import torch

        if not torch.cuda.is_available():
            return fn

        def wrapped(*args, **kwargs):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before[phase] = torch.cuda.memory_allocated() / 2**30
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            gib = torch.cuda.max_memory_allocated() / 2**30
            res = torch.cuda.max_memory_reserved() / 2**30
            self.peak[phase] = max(self.peak.get(phase, 0.0), gib)
            self.reserved[phase] = max(self.reserved.get(phase, 0.0), res)
            return out

        return wrapped


def instrument(c, mem: PhaseMemory) -> None:
    """Wrap the phase methods of the built components (instances only; the trainer is unchanged)."""
    c.engine.generate = mem.wrap("generation", c.engine.generate)
    c.actor.log_probs = mem.wrap("log_probs", c.actor.log_probs)
    c.actor.update = mem.wrap("actor_update", c.actor.update)
    if c.ref is not None:
        c.ref.log_probs = mem.wrap("ref_log_probs", c.ref.log_probs)
    if c.critic is not None:
        c.critic.values = mem.wrap("values", c.critic.values)
        c.critic.update = mem.wrap("critic_update", c.critic.update)


class HostTimeline:
    """Host seconds of the trainer's pieces inside a step, from the step's start (no device syncs added):
    where the step's time outside generation and the update goes. ``wrap_trainer`` wraps the functions
    ``train_step`` calls through its module (the trainer's code is unchanged)."""

    PIECES = ("rollout", "build_batch", "_defer_advantages", "_score", "compute_advantages",
              "rollout_correction", "batch_metrics")  # fmt: skip

    def __init__(self):
        self.t0 = 0.0
        self.spans: list[tuple[str, float, float]] = []
        self._gc_start: float | None = None  # the running collection's start
        self.full: list[list[float]] = []  # full collections: start ms, end ms, objects collected
        self.alloc_generate: dict[str, int] = {}  # the allocator's calls inside generation

    def start(self, t0: float) -> None:
        self.t0, self.spans, self.full, self.alloc_generate = t0, [], [], {}

    def gc_callback(self, phase: str, info: dict) -> None:
        """``gc.callbacks``: each collection of Python's collector as a span ``gc<generation>``."""
        now = time.perf_counter() - self.t0
        if phase == "start":
            self._gc_start = now
        elif self._gc_start is not None:
            self.spans.append((f"gc{info.get('generation')}", self._gc_start, now))
            if info.get("generation") == 2:  # a long walk, or much garbage freed?
                self.full.append([round(self._gc_start * 1e3, 2), round(now * 1e3, 2), info.get("collected")])
            self._gc_start = None

    def wrap(self, name: str, fn):
        def wrapped(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((name, t - self.t0, time.perf_counter() - self.t0))

        return wrapped

    def wrap_trainer(self, c) -> None:
        from megatron_rl.rollout import batch as batch_mod
        from megatron_rl.trainer import run as trainer_run

        for name in self.PIECES:
            setattr(trainer_run, name, self.wrap(name, getattr(trainer_run, name)))
        batch_mod._from_arrays = self.wrap("from_arrays", batch_mod._from_arrays)  # build_batch's host part
        c.train_loader.global_batch = self.wrap("global_batch", c.train_loader.global_batch)
        c.engine.generate = self.wrap("generate", self.count_allocator(c.engine.generate))
        c.actor.update = self.wrap("actor_update", c.actor.update)
        c.actor._split = self.wrap("actor_split", c.actor._split)  # the micro-batches, before the first runs
        gc.callbacks.append(self.gc_callback)

    ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")

    def count_allocator(self, fn):
        """``fn`` with the allocator's calls inside it added to ``alloc_generate`` (the rest of the step's
        are the update's and the host pieces'). Its two reads of the allocator's counters fall inside the
        wrapped call's time (tens of microseconds against generation's seconds)."""

        def counted(*args, **kwargs):
            before = self.allocator()
            out = fn(*args, **kwargs)
            for k, v in self.allocator().items():
                self.alloc_generate[k] = self.alloc_generate.get(k, 0) + v - before[k]
            return out

        return counted

    @staticmethod
    def collector_state() -> dict:
        """What Python's collector tracks after a step (outside its time: ``gc.get_objects`` walks them all)."""
        return {
            "tracked": len(gc.get_objects()),
            "frozen": gc.get_freeze_count(),
            "counts": list(gc.get_count()),
        }

    @classmethod
    def allocator(cls) -> dict[str, int]:
        """The CUDA caching allocator's counters of calls that can stall the host (cudaMalloc / cudaFree,
        retries after a failed allocation); {} on CPU."""
        import torch

        if not torch.cuda.is_available():
            return {}
        stats = torch.cuda.memory_stats()
        return {k: stats.get(k, 0) for k in cls.ALLOCATOR}

    def report(self, step_s: float) -> dict:
        """Spans in ms from the step's start, and the step's ms in none of the top-level spans."""
        spans = sorted(self.spans, key=lambda s: s[1])
        covered, end = 0.0, 0.0
        for _, a, b in spans:  # the union of the spans (collections inside a piece count once)
            if b > end:
                covered += b - max(a, end)
                end = b
        return {
            "spans_ms": [[n, round(a * 1e3, 2), round(b * 1e3, 2)] for n, a, b in spans],
            "uncovered_ms": round((step_s - covered) * 1e3, 2),
            "full_collections": list(self.full),  # a copy: after_first_step's collection is no step's
            "allocator_calls_generate": self.alloc_generate,
        }


def _global_max(values: dict[str, float]) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    if not values:
        return {}
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def live_kv(batch) -> tuple[float, float]:
    """(decode steps, live KV tokens summed over them) of this rank's batch, all sequences decoding
    together: sequence i is live for its L_i steps and attends over P_i + j tokens at step j."""
    p, r = batch.prompt_lens.double(), batch.response_lens.double()
    return float(r.max()), float((r * p + r * (r - 1) / 2).sum())


def live_kv_unique_prompts(batch) -> float:
    """Live KV tokens summed over the decode steps if each group's prompt were read once per step while
    any of its samples decodes (``rollout.prompt_kv_sharing`` reads it from one slot; the L2 cache may or
    may not keep it): the responses' own keys per row, plus P_g x (longest response of group g)."""
    import torch

    p, r = batch.prompt_lens.double().cpu(), batch.response_lens.double().cpu()
    _, g = torch.unique(batch.group_index.cpu(), return_inverse=True)  # [B] group 0..G-1
    longest = torch.zeros(int(g.max()) + 1, dtype=torch.float64).scatter_reduce(0, g, r, "amax")
    prompt = torch.zeros_like(longest).scatter_reduce(0, g, p, "amax")
    return float((r * (r - 1) / 2).sum()) + float((prompt * longest).sum())


def decode_numbers(c, dims, batch) -> dict:
    """This step's generation: new tokens per second per GPU over the decode steps, and the decode time
    against its HBM floor: every sequence decoding together (one step per token of the longest response),
    each step reading the actor's bf16 weights and the live KV at PEAK_HBM_BYTES_PER_S. Where the KV cache
    holds fewer slots than sequences the engine runs more steps than that floor (``decode_steps``), so the
    fraction compares whole decode times, not per-step times."""
    s = c.engine.last_stats
    weights = c.args.stage_params(dims.tp, 1)["first"] * 2
    steps, kv_tokens = live_kv(batch)
    step_s = s.decode_s / max(s.decode_steps, 1)
    floor_total_s = (weights * steps + kv_tokens * c.args.kv_bytes_per_token(dims.tp)) / PEAK_HBM_BYTES_PER_S
    unique_s = (
        weights * steps + live_kv_unique_prompts(batch) * c.args.kv_bytes_per_token(dims.tp)
    ) / PEAK_HBM_BYTES_PER_S
    return {"tok_per_s": s.new_tokens / max(s.generate_s, 1e-9), "decode_steps": s.decode_steps,
            "ms_per_decode_step": 1e3 * step_s, "hbm_floor_ms_per_step": 1e3 * floor_total_s / max(steps, 1),
            "fraction_of_hbm_floor": floor_total_s / max(s.decode_s, 1e-12), "slots": s.slots,
            "fraction_of_hbm_floor_prompts_once": unique_s / max(s.decode_s, 1e-12),
            "mean_rows_per_step": s.decode_rows / max(s.decode_steps, 1), "compactions": s.compactions,
            "syncs": s.syncs, "sync_host_s": s.sync_host_s, "async_retires": s.async_retires,
            "prefill_s": s.prefill_s, "prefill_tokens": s.prefill_tokens, "decode_s": s.decode_s,
            # the rest of the generation phase: layout change (gather, cache, graph capture) and back
            "reshard_s": s.reshard_s, "capture_s": s.capture_s, "gather_back_s": s.gather_back_s}  # fmt: skip


def measured_rates(machine: dict) -> tuple[float, float] | None:
    """(FLOP/s, HBM bytes/s): the means of ``machine``'s measurements (``_timing.machine_rates``: the
    sustained bf16 GEMM rate and the device copy's bytes read and written per second) that ran, or None."""
    ok = [m for m in machine.values() if "gemm_tflops" in m]
    if not ok:
        return None
    return (
        1e12 * statistics.mean(m["gemm_tflops"] for m in ok),
        1e12 * statistics.mean(m["copy_tb_s"] for m in ok),
    )


def roofline(c, dims, counts, batch, rates: tuple[float, float] | None) -> dict:
    """The step's roofline time (``models.facts.roofline_step_s``) written out: N (6N per trained token,
    2N per prefilled prompt token) and the decode bytes (weights + live KV per decode step: one step per
    new token of the longest response, all sequences together, each live until its own end)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    n = c.args.matmul_params()
    prompt_t, response_t = float(counts[0]), float(counts[1])
    weights = c.args.stage_params(dims.tp, 1)["first"] * 2 * dims.world_size  # every GPU reads its copy
    kv = c.args.kv_bytes_per_token(dims.tp) * dims.tp
    steps, kv_tokens = (
        torch.tensor(x, dtype=torch.float64, device=batch.prompt_lens.device) for x in live_kv(batch)
    )
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    dist.all_reduce(kv_tokens, group=ps.get_data_parallel_group())  # TP/PP ranks of a replica: one batch
    decode_bytes = float(steps) * weights + kv * float(kv_tokens)
    terms = (
        n,
        (prompt_t + response_t) / dims.world_size,
        prompt_t / dims.world_size,
        decode_bytes / dims.world_size,
    )
    r = roofline_step_s(*terms)
    # on another GPU (an H100 where no H200 was lent) the same arithmetic at that card's HBM rate too
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    this_gpu = roofline_step_s(*terms, hbm_bytes_per_s=hbm_bytes_per_s(gpu))
    if rates is not None:  # and at the rates the slowest GPU sustained (``slowest_rates``)
        at_rates = roofline_step_s(*terms, hbm_bytes_per_s=rates[1], flops_per_s=rates[0])
        r["total_s_measured_rates"] = at_rates["total_s"]
    formula = (f"6 x {n:.4g} x {prompt_t + response_t:.0f} / {PEAK_BF16_FLOPS:.3g} + 2 x {n:.4g} x {prompt_t:.0f} "
               f"/ {PEAK_BF16_FLOPS:.3g} + {decode_bytes:.4g} B / {PEAK_HBM_BYTES_PER_S:.3g} B/s")  # fmt: skip
    return r | {"gpu": gpu, "total_s_this_gpu": this_gpu["total_s"], "N": n, "trained_tokens": prompt_t + response_t, "prompt_tokens": prompt_t,
                "decode_bytes": decode_bytes, "formula": formula}  # fmt: skip


def _rates() -> dict:
    """``_timing.machine_rates`` on this rank's GPU, or why it could not run (after the steps the allocator's
    free memory may not hold its buffers, or cuBLAS its workspace): the run's results are kept either way."""
    try:
        return machine_rates()
    except Exception as exc:  # noqa: BLE001 - a measurement that failed is recorded, never fatal
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}


def slowest_rates(machine: dict) -> tuple[float, float] | None:
    """``measured_rates`` of the slowest GPU of the job (a step waits for its slowest rank): the minimum over
    ranks of each rate; None where any rank has none."""
    import torch
    import torch.distributed as dist

    from megatron_rl.distributed.runtime import device

    rates = measured_rates(machine)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return rates
    t = torch.tensor([-1.0, -1.0] if rates is None else list(rates), dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return None if float(t.min()) <= 0 else (float(t[0]), float(t[1]))


def run(a: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir
    from megatron.core import parallel_state as ps

    from megatron_rl.config.entry import checked_layout, quiet_third_party
    from megatron_rl.config.store import CONFIG_DIR, to_job_config
    from megatron_rl.distributed import init_distributed
    from megatron_rl.logging import Timer
    from megatron_rl.models.packed_attention import (
        fa4_layout_status,
        varlen_kernel,
        varlen_notes,
        varlen_status,
    )
    from megatron_rl.trainer.build import build_components
    from megatron_rl.trainer.collector import Collector
    from megatron_rl.trainer.memory_model import estimate
    from megatron_rl.trainer.run import train_step

    quiet_third_party()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = to_job_config(compose("config", overrides=overrides(a)))
    dims = checked_layout(cfg)
    init_distributed(dims.tp, dims.pp, seed=cfg.trainer.seed, timeout_minutes=cfg.trainer.timeout_minutes)
    machine = {"before": _rates()} if torch.cuda.is_available() else {}  # this GPU now, before the build
    rates = slowest_rates(machine)
    t_build = time.perf_counter()
    c = build_components(cfg, dims)
    build_s = time.perf_counter() - t_build
    if a.lengths == "spread":
        from spread_lengths import install_engine_hook, length_table

        table = length_table(a.steps + bool(a.profile) + bool(a.sync_audit), a.prompts, a.n, a.response_len)
        install_engine_hook(table, a.n, c.tokenizer.eos_token_id)
    elif a.ignore_eos:
        c.tokenizer = NoEosTokenizer(c.tokenizer)
    mem = PhaseMemory()
    instrument(c, mem)
    host = HostTimeline()
    host.wrap_trainer(c)
    cuda = torch.cuda.is_available()
    n_params = c.args.matmul_params()
    # the memory model at the values the run resolved (auto budgets included), for the measured peaks
    dry = estimate(cfg, dims, c.args, a.prompt_len)
    steps = []
    collector = Collector(cfg.trainer.gc_freeze, cfg.trainer.manual_gc_interval)  # as run_training's loop
    settle = {"before": HostTimeline.collector_state()}  # whether something froze objects before setup's end
    collector.settle()
    settle["after"] = HostTimeline.collector_state()
    for step in range(a.steps):
        timer = Timer()
        if cuda:
            torch.cuda.synchronize()
        alloc_before = host.allocator()
        t0 = time.perf_counter()
        host.start(t0)
        metrics, batch = train_step(c, step, timer)
        t_collect = time.perf_counter()
        collector.after_step(step + 1)  # a manual collection inside the step's time, as in run_training
        t_sync = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        host.spans += [("collector", t_collect - t0, t_sync - t0), ("final_sync", t_sync - t0, seconds)]
        gc_s = collector.take_pause_s()  # the collector's time inside this step
        counts = torch.tensor(
            [float(batch.prompt_lens.sum()), float(batch.response_lens.sum()), float(len(batch))],
            dtype=torch.float64,
            device=batch.prompt_lens.device,
        )
        dist.all_reduce(counts, group=ps.get_data_parallel_group())  # TP/PP ranks of a replica: one batch
        tokens = float(counts[0] + counts[1])
        phases = {k.split("/", 1)[1]: v for k, v in timer.metrics().items()}
        update_s = phases.get("update_actor", 0.0)
        row = {
            "step": step,
            "step_s": seconds,
            "sequences": int(counts[2]),
            "prompt_tokens": int(counts[0]),
            "response_tokens": int(counts[1]),
            "tok_per_s_per_gpu": tokens / seconds / dims.world_size,
            "timing_s": phases,
            "gc_s": gc_s,
            "host_timeline": host.report(seconds)
            | {"allocator_calls": {k: v - alloc_before[k] for k, v in host.allocator().items()}},
            "actor_update_mfu": 6
            * n_params
            * tokens
            / dims.world_size
            / max(update_s, 1e-9)
            / PEAK_BF16_FLOPS,
            "actor_grad_norm": metrics.get("actor/grad_norm"),
            "rollout_logprob_abs_diff": metrics.get("rollout/logprob_abs_diff"),
            "rollout_logprob_mismatch_frac": metrics.get("rollout/logprob_mismatch_frac"),
            "update_pad_frac": metrics.get("perf/update_pad_frac"),
            # actor.share_prompts: the share of row-by-row tokens not run again (the MFU above counts the
            # FLOPs of every row; the hardware ran 1 - this of them)
            "update_shared_frac": metrics.get("perf/update_shared_frac"),
            "decode": decode_numbers(c, dims, batch),
            "roofline": roofline(c, dims, counts, batch, rates),
        }
        if a.lengths == "spread" and dims.world_size == 1:  # the forced lengths are the ones trained on
            want = sorted(table[step * a.prompts * a.n : (step + 1) * a.prompts * a.n].tolist())
            row["lengths_as_forced"] = sorted(batch.response_lens.tolist()) == want
        row["step_over_roofline"] = seconds / row["roofline"]["total_s"]
        row["step_over_roofline_this_gpu"] = seconds / row["roofline"]["total_s_this_gpu"]
        if "total_s_measured_rates" in row["roofline"]:
            row["step_over_roofline_measured_rates"] = seconds / row["roofline"]["total_s_measured_rates"]
        slower = PEAK_HBM_BYTES_PER_S / hbm_bytes_per_s(
            row["roofline"]["gpu"]
        )  # the floor at this card's rate
        row["decode"]["fraction_of_hbm_floor_this_gpu"] = row["decode"]["fraction_of_hbm_floor"] * slower
        row["actor_update_mfu_as_run"] = row["actor_update_mfu"] * (1 - (row["update_shared_frac"] or 0.0))
        row["host_timeline"]["collector_after"] = host.collector_state()
        steps.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
        if step == 0:  # as run_training: the first step's batch dropped, then collect and freeze again
            del metrics, batch
            collector.after_first_step()
            row["host_timeline"]["collector_after_freeze"] = host.collector_state()
    collector.close()
    if a.profile:  # one more step, not timed: where generation's and the update's device time goes
        profile_phases(
            c, a.steps, a.profile, update_seqs=a.profile_update_seqs, device_only=a.profile_device_only
        )
    timed = steps[1:] or steps
    med = {
        "step_s": statistics.median(r["step_s"] for r in timed),
        "tok_per_s_per_gpu": statistics.median(r["tok_per_s_per_gpu"] for r in timed),
        "actor_update_mfu": statistics.median(r["actor_update_mfu"] for r in timed),
        "step_over_roofline": statistics.median(r["step_over_roofline"] for r in timed),
        "step_over_roofline_this_gpu": statistics.median(r["step_over_roofline_this_gpu"] for r in timed),
        "decode_tok_per_s": statistics.median(r["decode"]["tok_per_s"] for r in timed),
        "decode_fraction_of_hbm_floor": statistics.median(
            r["decode"]["fraction_of_hbm_floor"] for r in timed
        ),
        "decode_fraction_of_hbm_floor_this_gpu": statistics.median(
            r["decode"]["fraction_of_hbm_floor_this_gpu"] for r in timed
        ),
        "update_pad_frac": statistics.median(r["update_pad_frac"] or 0.0 for r in timed),
        "update_shared_frac": statistics.median(r["update_shared_frac"] or 0.0 for r in timed),
        "actor_update_mfu_as_run": statistics.median(r["actor_update_mfu_as_run"] for r in timed),
        "timing_s": {
            k: statistics.median(r["timing_s"].get(k, 0.0) for r in timed) for k in timed[0]["timing_s"]
        },
    }
    if all("step_over_roofline_measured_rates" in r for r in timed):
        # at the GEMM and copy rates the slowest GPU sustained before the build (``slowest_rates``)
        med["step_over_roofline_measured_rates"] = statistics.median(
            r["step_over_roofline_measured_rates"] for r in timed
        )
    result = {
        "workload": {
            "algo": a.algo,
            "prompts": a.prompts,
            "n": a.n,
            "prompt_len": a.prompt_len,
            "response_len": a.response_len,
            "micro_batch_per_gpu": min(a.micro, a.prompts * a.n),
            "kl_coef": a.kl_coef,
            "ignore_eos": a.ignore_eos,
            "lengths": a.lengths,
            "mean_response_len": statistics.mean(r["response_tokens"] / r["sequences"] for r in steps),
            "model": f"{a.shape} shape, random {'fp32' if a.shape == 'tiny' else 'bf16'}",
            "actor_params": n_params,
        },
        "world_size": dims.world_size,
        # which tree ran: this script puts its own repo first on sys.path, so an older package is run from
        # that package's own tree (its benchmarks/ copied in), never through PYTHONPATH
        "package": str(Path(sys.modules["megatron_rl"].__file__).parent),
        "overrides": overrides(a),
        "build_s": build_s,
        "collector_settle": settle,
        "steps": steps,
        "median_after_warmup": med,
        "resolved": {
            "actor.ppo_max_token_len_per_gpu": cfg.actor.ppo_max_token_len_per_gpu,
            "rollout.max_num_seqs": cfg.rollout.max_num_seqs,
        },
        "packed_attention_varlen": varlen_status(),  # {} unless packed: per-segment SDPA where False
        "packed_attention_varlen_notes": varlen_notes(),  # the trial's errors vs float32
        "packed_attention_kernel": varlen_kernel(torch.device("cuda", torch.cuda.current_device()))
        if cuda
        else None,
        "packed_attention_fa4_layouts": fa4_layout_status(),  # FA4's trial per head layout, where it ran
        "dry_run_gib_by_phase": {k: v / 2**30 for k, v in dry["peaks"].items()},
        "dry_run_bytes": dry["bytes"],
        "exact_gemm": exact_gemm_summary(),  # rollout.exact_logprobs: which fixed-rows paths served
    }
    if cuda:
        result["machine"] = machine | {"after": _rates()}  # and after the steps
        result["peak_allocated_gib_by_phase"] = _global_max(mem.peak)
        result["peak_reserved_gib_by_phase"] = _global_max(mem.reserved)
        result["allocated_gib_before_phase"] = _global_max(mem.before)
        result["peak_allocated_gib"] = max(result["peak_allocated_gib_by_phase"].values())
    if a.sync_audit:  # one more step, not timed: which lines make the host wait for the device
        result["sync_audit"] = sync_audit_step(c, a.steps + bool(a.profile), a, result, cuda)
    return result


def sync_audit_step(c, step: int, a: argparse.Namespace, result: dict, cuda: bool) -> str:
    """Training step ``step`` under ``SyncAudit``, its report to ``a.sync_audit``; the timed results are
    written to ``a.out`` first, so a failed or cut audit loses nothing. Returns "written" or the error."""
    import torch.distributed as dist

    from megatron_rl.logging import Timer
    from megatron_rl.trainer.run import train_step

    if dist.get_rank() == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2))
    try:
        with SyncAudit() as audit:
            train_step(c, step, Timer())
    except Exception as err:  # the timed results stand; the audit's entry says why it has none
        return f"failed: {type(err).__name__}: {err}"
    if dist.get_rank() == 0:
        write(audit.report() | {"cuda": cuda, "step": step}, a.sync_audit)
    return "written"


def exact_gemm_summary() -> dict:
    """The exact mode's fixed-rows matmul this run: weights whose invariance trial passed / failed, and
    (weight, call count) pairs whose single strided-batched call matched the separate calls / did not."""
    from megatron_rl.kernels import batch_invariant as bi

    def count(d):
        return {"passed": sum(map(bool, d.values())), "failed": sum(not v for v in d.values())}

    trials = [{"weight": list(k[2]), "calls": k[-2], "agreed": a, "disagreed": d}
              for k, (a, d) in bi._BATCHED_TRIALS.items()]  # fmt: skip
    return {"weights": count(bi._FIXED_ROWS), "batched_call_counts": count(bi._BATCHED),
            "batched": bi.EXACT_BATCHED, "batched_trials": trials}  # fmt: skip


def profile_phases(
    c, step: int, folder: str, rows: int = 60, update_seqs: int | None = None, device_only: bool = False
) -> None:
    """Run training step ``step`` with ``engine.generate`` and ``actor.update`` each under torch.profiler;
    write their op tables (top ``rows`` by self device time) to ``folder``/{generate,update}_ops.txt, and
    split by input shapes to {generate,update}_ops_by_shape.txt (recording shapes adds host overhead: the
    wall time under the profiler is not comparable with runs before session 19).
    ``update_seqs``: the profiled update runs on the batch's first that many sequences only (whole groups,
    one mini-batch), so that a long update's trace stays small enough to tabulate; its wall time goes
    into ``folder``/update_slice.json beside the table. ``device_only``: the device's activity alone (no host ops,
    no shapes), so the host runs at nearly its unprofiled speed and the gaps are the ones a plain step has;
    the gaps then carry no host annotation."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from megatron_rl.logging import Timer
    from megatron_rl.trainer.run import train_step

    acts = [] if device_only else [ProfilerActivity.CPU]
    acts += [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    Path(folder).mkdir(parents=True, exist_ok=True)
    originals = {"generate": (c.engine, "generate"), "update": (c.actor, "update")}

    def profiled(name, fn):
        def run(*args, **kwargs):
            if name == "update" and update_seqs is not None:
                batch, mini = args
                seqs = min(update_seqs, len(batch))
                args = (batch.select(range(seqs)), min(mini, seqs))
            with profile(activities=acts, record_shapes=not device_only) as prof:
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            if dist.get_rank() == 0:
                table = prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=90)
                (Path(folder) / f"{name}_ops.txt").write_text(table)
                # the same ops split by input shapes: which tensors the copies and elementwise kernels move
                by_shape = prof.key_averages(group_by_input_shape=True).table(
                    sort_by=sort, row_limit=rows, max_name_column_width=60, max_shapes_column_width=120
                )
                (Path(folder) / f"{name}_ops_by_shape.txt").write_text(by_shape)
                if name == "update" and update_seqs is not None:
                    slice_info = {"sequences": len(args[0]), "of": len(batch), "wall_s_under_profiler": wall}
                    (Path(folder) / "update_slice.json").write_text(json.dumps(slice_info))
                # the device's idle gaps by the host phase open then (device_gaps.py; the trace itself is
                # too large to bring back)
                with tempfile.TemporaryDirectory() as tmp:
                    prof.export_chrome_trace(f"{tmp}/trace.json")
                    with open(f"{tmp}/trace.json") as f:
                        gaps = device_gaps(json.load(f))
                gaps["wall_s_under_profiler"] = wall
                (Path(folder) / f"{name}_gaps.json").write_text(json.dumps(gaps, indent=1))
            return out

        return run

    kept = {name: getattr(obj, attr) for name, (obj, attr) in originals.items()}
    for name, (obj, attr) in originals.items():
        setattr(obj, attr, profiled(name, kept[name]))
    try:
        train_step(c, step, Timer())
    finally:
        for name, (obj, attr) in originals.items():
            setattr(obj, attr, kept[name])


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algo", choices=["grpo", "ppo"], default="grpo")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (grpo 64, ppo 512)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (grpo 8, ppo 1)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--micro", type=int, default=16, help="actor/critic micro-batch (sequences per GPU)")
    p.add_argument("--steps", type=int, default=3, help="steps; the first is warm-up")
    p.add_argument("--kl-coef", type=float, default=0.0, help="GRPO KL-loss coefficient (0: no reference)")
    p.add_argument("--keep-eos", dest="ignore_eos", action="store_false", help="stop at the tokenizer's EOS")
    p.add_argument(
        "--lengths", choices=["fixed", "spread"], default="fixed",
        help="fixed: every response runs to the cap; spread: EOS forced at log-normal lengths (spread_lengths.py)",
    )  # fmt: skip
    p.add_argument(
        "--shape", default="qwen2.5-0.5b", choices=[*SHAPES, "tiny"], help="model shape, random weights"
    )
    p.add_argument(
        "--tiny", action="store_true", help="= --shape tiny (hidden 64, 2 layers, vocab 1000): CPU smoke"
    )
    p.add_argument("--model-dir", default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--output-dir", default=None, help="trainer output (metrics.jsonl)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_rl_step.json"))
    p.add_argument("--profile-update-seqs", type=int, default=None,
                   help="with --profile: profile the update of the first N sequences only (whole groups)")  # fmt: skip
    p.add_argument("--profile-device-only", action="store_true",
                   help="with --profile: record the device's activity only (the host at nearly its own speed)")  # fmt: skip
    p.add_argument("--profile", default=None,
                   help="after the timed steps, one more under torch.profiler: op tables of generation and the update here")  # fmt: skip
    p.add_argument("--sync-audit", default=None,
                   help="after the timed steps, one more with its synchronizing CUDA calls counted by site (sync_audit.py): JSON here")  # fmt: skip
    p.add_argument(
        "override", nargs="*", help="extra Hydra overrides, e.g. rollout.gpu_memory_utilization=0.6"
    )
    a = p.parse_args(argv)
    a.prompts = a.prompts or (64 if a.algo == "grpo" else 512)
    a.n = a.n or (8 if a.algo == "grpo" else 1)
    a.shape = "tiny" if a.tiny else a.shape
    tag = a.shape.replace(".", "_").replace("-", "_")
    a.model_dir = a.model_dir or f"/tmp/bench_{tag}_random"
    a.data_dir = a.data_dir or f"/tmp/bench_{tag}_prompts{a.prompt_len}"
    a.output_dir = a.output_dir or f"/tmp/bench_rl_{a.algo}_{tag}"
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        prepare(a.model_dir, a.data_dir, a.shape, max(a.prompts, 512), a.prompt_len)
    else:
        while not (Path(a.data_dir) / "train.parquet").is_file():
            time.sleep(1)
    result = run(a)
    if rank == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2))
        m = result["median_after_warmup"]
        print(
            f"{a.algo} ({a.lengths}): {m['step_s']:.2f} s/step, {m['tok_per_s_per_gpu']:.0f} tok/s/GPU, "
            f"update MFU {m['actor_update_mfu']:.3f}, pad {m['update_pad_frac']:.3f}, "
            f"x roofline {m['step_over_roofline']:.2f} (this GPU's {m['step_over_roofline_this_gpu']:.2f}, "
            f"at its measured rates {m.get('step_over_roofline_measured_rates', float('nan')):.2f}), "
            f"phases {json.dumps(m['timing_s'])}",
            flush=True,
        )
        if "peak_allocated_gib_by_phase" in result:
            print("peak GiB by phase", json.dumps(result["peak_allocated_gib_by_phase"]), flush=True)
        for when, r in result.get("machine", {}).items():  # what this GPU sustained before / after the steps
            print(
                f"machine {when}:",
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}),
            )
    return result


if __name__ == "__main__":
    main()
