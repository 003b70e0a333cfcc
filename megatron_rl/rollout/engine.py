"""The rollout engine: reshard in place, generate with continuous batching, gather back, free.

One ``generate`` call on every rank of the job (SPMD):

1. validate the arguments (before any collective or GPU work);
2. build the generation layout and gather the missing weights (``reshard.py``);
3. run this replica's share of the sequences through a fixed number of KV-cache slots: waiting sequences
   enter through a batched prefill whenever slots are free; one decode step advances every active slot
   (on GPU it is replayed from a CUDA graph captured for a few batch-size buckets; eager on CPU);
4. free the gathered weights, the cache and the graphs, and all-gather the completions over the
   model-parallel group, so every TP/PP rank of a DP replica returns the same full list.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_rl.rollout import decoder, reshard
from megatron_rl.rollout.decoder import DecoderSpec, GenWeights
from megatron_rl.rollout.kv_cache import KV_KEYS, KVCache, bytes_per_token, plan_cache
from megatron_rl.rollout.sampling import SamplingParams, sample, token_logprobs


class GenerationOOM(RuntimeError):
    """Out of device memory during generation; the message names the keys to lower."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (the ``rollout.*`` keys of the same names)."""

    tensor_model_parallel_size: int | None = None  # TP_g; must divide the training TP; None = training TP
    max_num_seqs: int = 256  # KV-cache slots (sequences decoded together)
    kv_cache_tokens: int | None = None  # cache size in tokens; None = gpu_memory_utilization of free memory
    gpu_memory_utilization: float = 0.5  # fraction of free GPU memory for the cache when tokens is None
    max_prefill_tokens: int = 16384  # padded tokens per prefill batch
    cuda_graphs: bool = True  # capture the decode step on GPU

    def __post_init__(self):
        if self.kv_cache_tokens == 0:  # the config's "sized from the batch"
            object.__setattr__(self, "kv_cache_tokens", None)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]."
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"rollout.max_num_seqs={self.max_num_seqs} must be >= 1.")

    @classmethod
    def from_config(cls, rollout) -> EngineConfig:
        """From any object with (some of) these attribute names, e.g. the ``rollout`` config section."""
        return cls(**{k: getattr(rollout, k) for k in cls.__dataclass_fields__ if hasattr(rollout, k)})


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"


@dataclass
class GenerationStats:
    peak_memory_bytes: int = 0  # GPU: max_memory_allocated; CPU: KV cache + gathered weights
    kv_cache_bytes: int = 0
    gathered_weight_bytes: int = 0
    slots: int = 0
    reshard_s: float = 0.0  # train -> generation layout (gather + graph capture)
    generate_s: float = 0.0
    gather_back_s: float = 0.0  # generation -> train: free + all-gather results
    decode_steps: int = 0
    decode_s: float = 0.0  # time in decode steps (forward + sampling + bookkeeping), prefills excluded
    new_tokens: int = 0  # this replica's


def _oom_message(exc: Exception) -> str:
    return (
        f"Out of device memory during generation ({exc}). Lower {KV_KEYS} (KV-cache size), "
        f"data.train_batch_size or rollout.n (sequences per rank), or rollout.max_new_tokens; "
        f"rollout.max_num_seqs bounds the sequences decoded together."
    )


class RolloutEngine:
    """Generates with the actor's own parameters. ``model``: the actor GPTModel (possibly wrapped) or a
    dict of its parameters by local-spec name (read at every ``generate``, so optimizer updates show)."""

    def __init__(self, model, spec: DecoderSpec, config: EngineConfig | None = None):
        self.model = model
        self.spec = spec
        self.config = config or EngineConfig()
        self.last_stats = GenerationStats()

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.model) if isinstance(self.model, dict) else reshard.model_params(self.model)

    def validate(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """Check arguments before any work; returns the per-slot cache length."""
        tp_t = 1
        if dist.is_initialized():
            from megatron.core import parallel_state as ps

            tp_t = ps.get_tensor_model_parallel_world_size()
        reshard.check_tp_sizes(self.config.tensor_model_parallel_size or tp_t, tp_t)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("Empty prompt: every prompt needs at least one token.")
        max_len = max((len(p) for p in prompts), default=1) + params.max_new_tokens
        tokens = self.config.kv_cache_tokens
        if tokens is not None and tokens < max_len:
            longest = max(len(p) for p in prompts)
            raise ValueError(
                f"A prompt of {longest} tokens plus rollout.max_new_tokens={params.max_new_tokens} needs "
                f"{max_len} KV-cache tokens but rollout.kv_cache_tokens={tokens}. Raise "
                f"rollout.kv_cache_tokens, lower rollout.max_new_tokens or shorten the prompts."
            )
        return max_len

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample ``params.n`` completions for each of this DP rank's prompts (token ids).

        Every rank of the model-parallel group passes the same prompts and gets the same list back,
        ordered by (prompt, sample). Statistics land in ``self.last_stats``.
        """
        max_len = self.validate(prompts, params)
        stats = self.last_stats = GenerationStats()
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        lay = reshard.build_layout(self.config.tensor_model_parallel_size)
        share = reshard.split_range(len(prompts), lay.num_replicas, lay.replica)
        seqs = [Completion(i, s, list(prompts[i])) for i in share for s in range(params.n)]
        try:
            weights = reshard.gather_weights(self._params(), self.spec, lay)
            stats.gathered_weight_bytes = weights.owned_bytes()
            runner = _Runner(self, weights, lay, params, max_len, len(seqs), stats)
            stats.reshard_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            runner.run(seqs)
            stats.generate_s = time.perf_counter() - t1
        except torch.OutOfMemoryError as exc:
            raise GenerationOOM(_oom_message(exc)) from exc
        t2 = time.perf_counter()
        stats.peak_memory_bytes = (
            torch.cuda.max_memory_allocated()
            if on_gpu
            else stats.kv_cache_bytes + stats.gathered_weight_bytes
        )
        del runner, weights
        stats.new_tokens = sum(len(c.response_ids) for c in seqs)
        out = reshard.gather_results(seqs, lay)
        stats.gather_back_s = time.perf_counter() - t2
        return out


class _Runner:
    """The continuous-batching loop for one generate call (owns the cache and the CUDA graphs)."""

    def __init__(self, engine, w: GenWeights, lay, params, max_len: int, num_seqs: int, stats):
        spec, cfg = engine.spec, engine.config
        self.spec, self.w, self.lay, self.params, self.stats = spec, w, lay, params, stats
        self.cfg = cfg
        dev = w.embed.device
        groups = spec.num_query_groups // lay.tp_g
        per_token = bytes_per_token(spec.num_layers, groups, spec.head_dim, w.embed.dtype)
        plan = plan_cache(
            max_len=max_len,
            wanted_slots=num_seqs,
            max_num_seqs=cfg.max_num_seqs,
            per_token=per_token,
            kv_cache_tokens=cfg.kv_cache_tokens,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            device=dev,
        )
        self.cache = KVCache(plan, spec.num_layers, groups, spec.head_dim, w.embed.dtype, dev)
        stats.kv_cache_bytes, stats.slots = self.cache.nbytes(), plan.slots
        self.tok = torch.zeros(plan.slots, dtype=torch.long, device=dev)  # [S] token fed at `pos`
        self.pos = torch.zeros(plan.slots, dtype=torch.long, device=dev)  # [S]
        self.stop = set(params.stop_token_ids)
        stream = params.seed * 1_000_003 + _dp_rank() * lay.num_replicas + lay.replica
        self.gen = torch.Generator(device=dev).manual_seed(stream)
        self.graphs = self._capture() if dev.type == "cuda" and cfg.cuda_graphs else {}

    def _buckets(self) -> list[int]:
        s = self.cache.plan.slots
        return sorted({min(2**i, s) for i in range(s.bit_length() + 1)})

    def _capture(self) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._eager(self.cache.plan.slots)
        torch.cuda.current_stream().wait_stream(side)
        graphs, pool = {}, None
        for b in reversed(self._buckets()):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._eager(b)
            pool = g.pool()
            graphs[b] = (g, out)
        return graphs

    def _eager(self, b: int) -> torch.Tensor:
        return decoder.decode(self.w, self.spec, self.cache.data, self.tok[:b], self.pos[:b])

    def _decode(self, b: int) -> torch.Tensor:
        """logits [b', V] for slots 0..b'-1, b' >= b (a captured bucket on GPU)."""
        if not self.graphs:
            return self._eager(b)
        bucket = min(k for k in self.graphs if k >= b)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out

    def _sample(self, logits: torch.Tensor) -> list[tuple[int, float]]:
        """logits [B, V] -> [(token, log-prob)] * B; identical on every rank of the generation TP group."""
        tokens = sample(logits, self.params, self.gen)
        if self.lay.tp_g > 1:
            dist.broadcast(tokens, src=self.lay.gen_src, group=self.lay.gen_group)
        lps = token_logprobs(logits, tokens, self.params.temperature)
        pairs = torch.stack([tokens.double(), lps.double()], dim=1).tolist()  # one host sync per step
        return [(int(t), lp) for t, lp in pairs]

    def _append(self, seq: Completion, token: int, lp: float) -> bool:
        seq.response_ids.append(token)
        seq.logprobs.append(lp)
        if token in self.stop:
            seq.finish_reason = "stop"
        elif len(seq.response_ids) >= self.params.max_new_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _admit(self, waiting: deque, active: dict[int, Completion]) -> None:
        """Prefill as many waiting sequences as free slots and the prefill token cap allow."""
        batch: list[Completion] = []
        longest = 0
        while waiting and len(batch) < self.cache.num_free:
            longest_next = max(longest, len(waiting[0].prompt_ids))
            if batch and longest_next * (len(batch) + 1) > self.cfg.max_prefill_tokens:
                break
            batch.append(waiting.popleft())
            longest = longest_next
        slots = [self.cache.allocate() for _ in batch]
        dev = self.tok.device
        tokens = torch.zeros(len(batch), longest, dtype=torch.long)  # [B, T] right-padded
        for row, seq in enumerate(batch):
            tokens[row, : len(seq.prompt_ids)] = torch.tensor(seq.prompt_ids)
        lengths = torch.tensor([len(s.prompt_ids) for s in batch], device=dev)
        slot_t = torch.tensor(slots, device=dev)
        logits = decoder.prefill(self.w, self.spec, self.cache.data, tokens.to(dev), lengths, slot_t)
        self._advance(list(zip(slots, batch)), self._sample(logits), active, first=True)

    def _advance(self, rows, sampled, active, first: bool = False) -> None:
        """Record one sampled token per (slot, seq) row; free finished slots, feed the others."""
        dev = self.tok.device
        keep, done = [], []
        for (slot, seq), (token, lp) in zip(rows, sampled):
            (done if self._append(seq, token, lp) else keep).append(slot)
            if slot in done:
                active.pop(slot, None)
                self.cache.release(slot)
            else:
                active[slot] = seq
        if keep:
            idx = torch.tensor(keep, device=dev)
            self.tok[idx] = torch.tensor([active[s].response_ids[-1] for s in keep], device=dev)
            if first:
                self.pos[idx] = torch.tensor([len(active[s].prompt_ids) for s in keep], device=dev)
            else:
                self.pos[idx] += 1
        if done:
            self.pos[torch.tensor(done, device=dev)] = 0  # idle slots write harmlessly at position 0

    def run(self, seqs: list[Completion]) -> None:
        waiting = deque(seqs)
        active: dict[int, Completion] = {}
        while waiting or active:
            if waiting and self.cache.num_free:
                self._admit(waiting, active)
                continue
            t0 = time.perf_counter()
            rows = sorted(active.items())
            logits = self._decode(rows[-1][0] + 1)  # [>= max slot + 1, V]
            picked = logits[torch.tensor([slot for slot, _ in rows], device=logits.device)]
            self._advance(rows, self._sample(picked), active)
            self.stats.decode_steps += 1
            self.stats.decode_s += time.perf_counter() - t0  # _sample synced with the host


def _dp_rank() -> int:
    if not dist.is_initialized():
        return 0
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank()
