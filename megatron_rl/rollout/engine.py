"""The rollout engine: reshard in place, generate with continuous batching, gather back, free.

One ``generate`` call on every rank of the job (SPMD):

1. validate the arguments (before any collective or GPU work);
2. build the generation layout and gather the missing weights (``reshard.py``);
3. run this replica's share of the sequences through a fixed number of KV-cache slots: waiting sequences
   enter through a batched prefill whenever slots are free; one decode step advances every active slot
   (on GPU it is replayed from a CUDA graph, captured on first use of its batch bucket, ``batch_bucket``;
   eager on CPU). Sampling and per-slot bookkeeping stay on the device; the host syncs every few steps
   to retire finished sequences and admit waiting ones;
4. free the gathered weights (and, unless ``keep_cache``, the cache and the graphs), and all-gather the
   completions over the model-parallel group, so every TP/PP rank of a DP replica returns the same list.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.config.rollout_rules import check_engine
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.transfer import to_device_async, to_host_async
from megatron_rl.kernels import batch_invariant, decode_gemm, slot_state
from megatron_rl.kernels import decode_attention as decode_kernel
from megatron_rl.kernels.compile import env_switch
from megatron_rl.logging.timer import annotate
from megatron_rl.models import lora
from megatron_rl.rollout import decoder, reshard
from megatron_rl.rollout.decoder import GenWeights, check_decodable
from megatron_rl.rollout.kv_cache import (
    HEADROOM,
    KV_KEYS,
    KVCache,
    bytes_per_token,
    fit_free_memory,
    fits_free,
    plan_cache,
)
from megatron_rl.rollout.multi_turn import Session
from megatron_rl.rollout.sampling import (
    SamplingParams,
    logprob_temperature,
    sample_with_logprobs,
    seeded_key,
    step_row_keys,
    truncated_token_logprobs,
)

if TYPE_CHECKING:
    from megatron_rl.models.args import ModelArgs


class GenerationOOM(RuntimeError):
    """Out of device memory during generation; the message names the keys to lower."""


_ROLLOUT = RolloutConfig()  # the defaults below are the rollout.* keys' own (defined once, in the schema)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings: the ``rollout.*`` keys of the same names, with their defaults (see the schema for
    what each does); built from the config by ``from_config``."""

    tensor_model_parallel_size: int | None = _ROLLOUT.tensor_model_parallel_size  # TP_g; None = training TP
    max_num_seqs: int = _ROLLOUT.max_num_seqs  # KV-cache slots (sequences decoded together)
    kv_cache_tokens: int | None = _ROLLOUT.kv_cache_tokens  # 0 / None: gpu_memory_utilization of free memory
    gpu_memory_utilization: float = _ROLLOUT.gpu_memory_utilization
    max_prefill_tokens: int = _ROLLOUT.max_prefill_tokens  # padded tokens per prefill batch
    cuda_graphs: bool = _ROLLOUT.cuda_graphs  # capture the decode step on GPU
    # decode attention reads a prompt's keys/values for all its samples from one slot (same values)
    prompt_kv_sharing: bool = _ROLLOUT.prompt_kv_sharing
    # keep the KV cache and the captured decode graphs between generate calls: the next call skips the
    # allocation and the capture (while the weights stay where they are), but the cache's memory stays
    # taken during training. "auto" is the memory plan's to resolve; unresolved (no plan ran) it is off
    keep_cache: bool | str = _ROLLOUT.keep_cache
    # batch-invariant prefill/decode and log-probs: the trainer's exact recompute gives the same bits
    exact_logprobs: bool = _ROLLOUT.exact_logprobs

    def __post_init__(self):
        if self.kv_cache_tokens == 0:  # the config's "sized from the batch"
            object.__setattr__(self, "kv_cache_tokens", None)
        if self.keep_cache == "auto":
            object.__setattr__(self, "keep_cache", False)
        check_engine(gpu_memory_utilization=self.gpu_memory_utilization, max_num_seqs=self.max_num_seqs,
                     max_prefill_tokens=self.max_prefill_tokens, kv_cache_tokens=self.kv_cache_tokens)  # fmt: skip

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> EngineConfig:
        """The one place a ``rollout`` config section becomes engine settings (every field is a key)."""
        return cls(**{k: getattr(rollout, k) for k in cls.__dataclass_fields__})


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    key: int = (
        0  # sampling-noise key with SamplingParams.layout_invariant_sampling: (prompt key, sample index)
    )
    # multi-turn: 0 on response tokens the model did not sample (tool answers, user turns); their
    # logprobs are 0. Empty for single-turn responses (all sampled).
    response_mask: list[int] = field(default_factory=list)
    turns: int = 1
    tool_reward: float = 0.0  # sum of the tools' / interaction's reward deltas
    tool_counts: tuple[int, int, int] = (0, 0, 0)  # calls, errors, timeouts
    # with top-k / top-p (single-turn): each token's log-prob under the truncated, renormalised distribution
    truncated_logprobs: list[float] = field(default_factory=list)
    # single-turn, from the engine: (response_ids, logprobs) as numpy arrays (int64, float32) holding the same
    # values, so ``rollout.batch.build_batch`` copies them into its tensors without converting the lists back
    arrays: tuple | None = field(default=None, repr=False, compare=False)

    def set_arrays(self, ids, logprobs) -> None:
        """The engine's single-turn result as numpy arrays (``arrays``); ``response_ids`` and ``logprobs`` become
        their lists when first read. A fixed-length GRPO step (512 x 512 tokens) listed all of them at the end of
        generation and freed them again after ``build_batch``, which reads the arrays: ~25 ms of host time a
        step on a 2-core CPU (``benchmarks/bench_build_batch.py``, session 39) that the trainer's path never
        needed."""
        self.arrays = (ids, logprobs)
        self.__dict__["_unlisted"] = (ids, logprobs)  # kept apart from ``arrays``, which a caller may drop
        self.__dict__["_response_ids"] = self.__dict__["_logprobs"] = None

    def response_len(self) -> int:
        """``len(response_ids)``, without listing the engine's arrays."""
        ids = self.__dict__.get("_response_ids")
        return (
            len(self.__dict__["_unlisted"][0])
            if ids is None and "_unlisted" in self.__dict__
            else len(self.response_ids)
        )


def _listed(name: str, column: int) -> property:
    """``Completion.<name>``: a list; after ``set_arrays``, that array listed on the first read."""
    key = f"_{name}"

    def get(self) -> list:
        if key not in self.__dict__:  # e.g. a Completion unpickled from before these properties
            return self.__dict__.get(name, [])
        value = self.__dict__[key]
        if value is None and "_unlisted" in self.__dict__:
            value = self.__dict__[key] = self.__dict__["_unlisted"][column].tolist()
        return value

    def put(self, value: list) -> None:
        self.__dict__[key] = value

    return property(get, put)


# properties over the dataclass fields: the generated __init__, __eq__ and __repr__ go through them
Completion.response_ids = _listed("response_ids", 0)
Completion.logprobs = _listed("logprobs", 1)


@dataclass
class GenerationStats:
    peak_memory_bytes: int = 0  # GPU: max_memory_allocated; CPU: KV cache + gathered weights
    kv_cache_bytes: int = 0
    gathered_weight_bytes: int = 0
    slots: int = 0
    reshard_s: float = 0.0  # train -> generation layout (gather + cache + graph capture)
    generate_s: float = 0.0  # prefills + decode steps (capture excluded)
    gather_back_s: float = 0.0  # generation -> train: free + all-gather results
    capture_s: float = 0.0  # CUDA-graph capture (part of reshard_s)
    prefill_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens run through prefill (a prompt shared by its samples once)
    decode_steps: int = 0
    decode_s: float = 0.0  # time in decode steps (forward + sampling + bookkeeping), prefills excluded
    new_tokens: int = 0  # this replica's
    decode_rows: int = 0  # rows the decode steps ran (bucket sizes summed over steps)
    compactions: int = 0  # times live sequences moved to lower slots (``_Runner._compact``)
    moved_slots: int = 0
    syncs: int = 0  # host syncs between decode steps (``_Runner._retire``)
    # host time from each sync's read of the device state until retiring and compacting are done (the next
    # decode step is launched right after; a multi-turn next-turn prefill in between counts as prefill_s):
    # the device has run out of queued work and idles through it, bar the compaction's own copies
    sync_host_s: float = 0.0
    async_retires: int = 0  # retires read from a snapshot while the device ran on (``ASYNC_RETIRE``)


def _oom_message(exc: Exception) -> str:
    return (
        f"Out of device memory during generation ({exc}). Lower {KV_KEYS} (KV-cache size), "
        f"data.train_batch_size or rollout.n (sequences per rank), or rollout.max_new_tokens; "
        f"rollout.max_num_seqs bounds the sequences decoded together."
    )


class RolloutEngine:
    """Generates with the actor's own parameters. ``model``: the actor GPTModel (possibly wrapped) or a
    dict of its parameters by local-spec name (read at every ``generate``, so optimizer updates show)."""

    def __init__(self, model, spec: ModelArgs, config: EngineConfig | None = None):
        decode_gemm.table()  # a bad MEGATRON_RL_DECODE_GEMM_TABLE fails here, before any generation
        self.model = model
        self.spec = check_decodable(spec)
        self.config = config or EngineConfig()
        self.last_stats = GenerationStats()
        self._state: _DecodeState | None = None  # kept between calls with config.keep_cache

    def _params(self) -> dict[str, torch.Tensor]:
        """The weights to generate with; a LoRA actor's adapted weights are merged copies (``lora``)."""
        if isinstance(self.model, dict):
            return dict(self.model)
        return lora.merged_params(self.model, reshard.model_params(self.model))

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

    def _decode_state(self, w: GenWeights, lay, max_len: int, num_seqs: int) -> _DecodeState:
        """The kept cache and graphs when they fit this call, else a new cache sized for it."""
        slots = max(1, min(self.config.max_num_seqs, num_seqs))
        kept, self._state = self._state, None
        if kept is not None and kept.fits(max_len, slots, w.embed.dtype, self.config.exact_logprobs):
            kept.bind(w)
            return kept
        spec, cfg, dev = self.spec, self.config, w.embed.device
        if kept is not None:  # its memory is free for the new cache: back with the driver, where
            kept = None  # fit_free_memory looks
            if dev.type == "cuda":
                torch.cuda.empty_cache()
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
        planned = plan.slots
        if dev.type == "cuda":  # the plan counts bytes; the device must also hold them in one piece
            free, _ = torch.cuda.mem_get_info(dev)
            if not fits_free(plan, free):
                # the update leaves free blocks in the caching allocator (session 7, 8B: 9.85 GiB reserved
                # but unallocated) that the KV cache, one large tensor, cannot use: hand them back first.
                # Only then: returning them unmaps the update's pages and its next step maps them again
                # (with expandable segments, tens of thousands of 2 MiB pages)
                torch.cuda.empty_cache()
                free, _ = torch.cuda.mem_get_info(dev)
            held = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            plan, note = fit_free_memory(plan, free, held)
            if note:
                warnings.warn(note, stacklevel=2)
        if lay.tp_g > 1 and dist.is_initialized():  # a generation group admits and decodes in lockstep
            fewest = torch.tensor([plan.slots], device=dev)
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=lay.gen_group)
            plan = replace(plan, slots=int(fewest.item()))
        state = _DecodeState(spec, plan, groups, w.embed.dtype, dev, dev.type == "cuda" and cfg.cuda_graphs,
                             cfg.exact_logprobs, cfg.prompt_kv_sharing, fine_buckets=bool(cfg.keep_cache),
                             one_logits_buffer=lay.tp_g == 1)  # fmt: skip
        # a cache cut to the free memory still "fits" the calls it was planned for
        state.planned_slots = planned
        state.bind(w)
        return state

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_keys: list[int] | None = None,
        session: Session | None = None,
    ) -> list[Completion]:
        """Sample ``params.n`` completions for each of this DP rank's prompts (token ids).

        Every rank of the model-parallel group passes the same prompts and gets the same list back,
        ordered by (prompt, sample). Statistics land in ``self.last_stats``. ``prompt_keys`` (e.g. global
        prompt ids; default: the local index) key each sequence's noise when ``params.layout_invariant_sampling``.
        ``session`` (``multi_turn.MultiTurn.session``): multi-turn episodes, continued in the same slot.
        """
        max_len = self.validate(prompts, params)
        stats = self.last_stats = GenerationStats()
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        lay = reshard.build_layout(self.config.tensor_model_parallel_size)
        share = reshard.split_range(len(prompts), lay.num_replicas, lay.replica)
        keys = list(range(len(prompts))) if prompt_keys is None else prompt_keys
        seqs = [
            Completion(i, s, list(prompts[i]), key=keys[i] * 65537 + s)
            for i in share
            for s in range(params.n)
        ]
        try:
            with annotate("rollout.reshard"):
                weights = reshard.gather_weights(self._params(), self.spec, lay)
                stats.gathered_weight_bytes = weights.owned_bytes()
                state = self._decode_state(weights, lay, max_len, len(seqs))
            stats.kv_cache_bytes, stats.slots = state.cache.nbytes(), state.cache.plan.slots
            runner = _Runner(state, lay, params, stats, self.config, session)
            stats.reshard_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            runner.run(seqs)
            run_s = time.perf_counter() - t1
        except torch.OutOfMemoryError as exc:
            raise GenerationOOM(_oom_message(exc)) from exc
        stats.capture_s = state.capture_s
        stats.reshard_s += stats.capture_s
        stats.generate_s = run_s - stats.capture_s
        stats.decode_s = stats.generate_s - stats.prefill_s
        t2 = time.perf_counter()
        stats.peak_memory_bytes = (
            torch.cuda.max_memory_allocated()
            if on_gpu
            else stats.kv_cache_bytes + stats.gathered_weight_bytes
        )
        state.w = None  # gathered buffers go now; a kept state holds only the cache and graphs
        self._state = state if self.config.keep_cache else None
        del runner, weights, state
        stats.new_tokens = sum(c.response_len() for c in seqs)
        with annotate("rollout.gather_back"):
            out = reshard.gather_results(seqs, lay)
        stats.gather_back_s = time.perf_counter() - t2
        return out


_SYNC_EVERY = 16  # decode steps between host syncs; a finished sequence is noticed at most this late
# ASYNC_RETIRE (single-turn generation; MEGATRON_RL_ASYNC_RETIRE=0 turns it off): at each window's end the
# device state is copied to pinned host memory behind the queued steps, _AHEAD more steps are queued, and only
# then does the host wait (for the copy, not for the steps) and retire / compact from it, while the device runs
# those steps. Without it every window ends in a sync the device idles through while the host retires
# (``sync_host_s``: 57-66 ms a 0.5B generation, session 25). A finished sequence is then noticed _AHEAD steps
# later (frozen on the device meanwhile), so compaction runs at other steps: greedy and layout-invariant
# sampling give the same tokens, the generator's stream (``layout_invariant_sampling=False``) other, equally
# valid, samples (as compaction itself does). Measured (session 26, H100, 0.5B GRPO step, same call): spread
# lengths generation 1.050 -> 1.036 s, fixed lengths 1.548 -> 1.546 s; host syncs 32 -> 1 a generation. On by
# default.
ASYNC_RETIRE = env_switch("MEGATRON_RL_ASYNC_RETIRE", True)
_AHEAD = 2
_SNAPSHOT_MAX_CELLS = 1 << 19  # slots x tokens a snapshot copies at most (12-16 bytes a cell)


def _weights_key(w: GenWeights) -> tuple:
    """Where the generation weights live: a captured graph stays valid while this is unchanged."""
    tensors = [w.embed, w.final_norm, w.output, *(t for layer in w.layers for t in layer.values())]
    return (id(w.group), *((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors))


class _DecodeState:
    """The KV cache, the decode step's input buffers (``tok``, ``pos``) and its CUDA graphs.

    A graph is captured the first time its batch bucket is needed (a full batch that runs to the end
    captures one). Graphs read the weights by address, so ``bind`` drops them when the weights moved;
    with ``EngineConfig.keep_cache`` the engine keeps this object between generate calls, and the actor's
    tensors (updated in place by the optimizer) reuse the graphs with no new capture.
    """

    def __init__(
        self, spec: ModelArgs, plan, local_groups: int, dtype, device, use_graphs: bool, exact: bool,
        prompt_kv_sharing: bool = False, fine_buckets: bool = False, one_logits_buffer: bool = False,
    ):  # fmt: skip
        self.spec, self.use_graphs, self.exact = spec, use_graphs, exact
        self.one_logits_buffer = one_logits_buffer and not exact  # (generation TP 1) see ``logits_buf``
        # the finer ``batch_bucket`` ladder where its extra captures happen once per run, not once per call:
        # the state is kept between generate calls (keep_cache), the weights stayed where they were at the
        # last ``bind`` (``stable``: not so for LoRA's merged copies, other pipeline stages' gathered layers,
        # merged TP shards, weights moved to the host and back), and the graphs share one logits buffer
        # (else each graph's own logits [bucket, V] stay in the pool: ~4x the powers of two's at 512 slots)
        self.fine_buckets = fine_buckets and self.one_logits_buffer
        self.stable = False
        # the Triton decode kernel stops at each sequence's own position: no length buckets needed
        self.reads_live_only = decode_kernel.serves(device, dtype, spec.head_dim)
        # rollout.prompt_kv_sharing: slot s reads positions < plen[s] from slot lead[s] (``_Runner`` keeps
        # lead pointing at a live slot holding the same prompt, else at s itself)
        self.shares_prompts = prompt_kv_sharing  # read by the Triton decode kernels; SDPA reads its own copy
        self.lead = torch.arange(plan.slots, device=device)  # [S]
        self.plen = torch.zeros(plan.slots, dtype=torch.long, device=device)  # [S]
        self.cache = KVCache(plan, spec.num_layers, local_groups, spec.head_dim, dtype, device)
        self.planned_slots = plan.slots  # before ``fit_free_memory`` (set by the engine)
        self.tok = torch.zeros(plan.slots, dtype=torch.long, device=device)  # [S] token fed at `pos`
        self.pos = torch.zeros(plan.slots, dtype=torch.long, device=device)  # [S]
        # (bucket, kv) -> (graph, its logits). With ``one_logits_buffer`` every graph's logits are a view of
        # ``logits_buf``: a replay overwrites the logits of the graph replayed before it (read each step's
        # logits before the next replay, as ``_Runner._step`` does)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        # every graph writes its logits into the first rows of this one buffer (the LM head GEMM's ``out``;
        # generation TP 1, not exact), allocated at the first capture outside the graphs' pool: a graph's own
        # output would otherwise hold [bucket, V] of the pool for the whole run
        self.logits_buf: torch.Tensor | None = None
        self.stream: torch.cuda.Stream | None = None  # warm-ups and captures (``_capture``)
        self.w: GenWeights | None = None
        self.key: tuple | None = None
        self.capture_s = 0.0  # this generate call's

    def fits(self, max_len: int, slots: int, dtype, exact: bool) -> bool:
        plan = self.cache.plan
        fits = plan.max_len >= max_len and self.planned_slots >= slots and self.cache.data.dtype == dtype
        return fits and self.exact == exact

    def bind(self, w: GenWeights) -> None:
        key = _weights_key(w)
        self.stable = key == self.key  # the graphs captured so far stay valid
        if key != self.key:
            self.graphs, self.pool, self.key = {}, None, key
        self.w, self.capture_s = w, 0.0

    def _eager(self, b: int, kv: int, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        prefix = (self.lead[:b], self.plen[:b]) if self.shares_prompts else None
        return decoder.decode(self.w, self.spec, self.cache.data, self.tok[:b], self.pos[:b], kv, self.exact,
                              prefix, logits_out)  # fmt: skip

    def _logits_out(self) -> torch.Tensor | None:
        """The shared logits buffer [slots, Vp] where the decoder writes into it (``one_logits_buffer``),
        allocated at the first capture (outside the graphs' pool), else None."""
        w = self.w
        if not self.one_logits_buffer:
            return None
        if self.logits_buf is None:
            self.logits_buf = w.output.new_empty(self.cache.plan.slots, w.output.shape[0])
        return self.logits_buf

    def _capture(self, b: int, kv: int) -> None:
        t0 = time.perf_counter()
        # one stream for every warm-up and capture of this state: the allocator reuses a freed block only on
        # the stream that freed it, so the graphs sharing ``pool`` share its memory (as torch.cuda.graph's one
        # default capture stream does)
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        side = self.stream
        # capture_begin/end, not ``torch.cuda.graph``: its __enter__ empties the caching allocator, which
        # unmaps the pages the update left cached and makes its next step map them again (H200, 0.5B GRPO:
        # ~0.4 s of a 4.5 s step; benchmarks/results/2026-12-04-h200-session17/README.md). A capture cannot
        # take the allocator's cached blocks (it does not release them while capturing), so where the driver
        # has less than the cache plan's headroom free, they go back first, as torch.cuda.graph would do.
        if torch.cuda.mem_get_info(self.cache.data.device)[0] < HEADROOM:
            torch.cuda.empty_cache()
        # warm-up outside the capture (library handles, kernel choice); it rewrites the keys/values the
        # replay writes next, from the same inputs
        buf = self._logits_out()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._eager(b, kv, buf)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.capture_begin(*(() if self.pool is None else (self.pool,)))
            try:
                out = self._eager(b, kv, buf)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        self.pool = graph.pool()
        self.graphs[b, kv] = (graph, out)
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - t0

    def bucket(self, b: int) -> int:
        """Rows a decode step over slots 0..b-1 runs: with CUDA graphs ``batch_bucket``'s (the finer ladder
        where ``fine_buckets`` and ``stable``, see ``__init__``), else b."""
        if not self.use_graphs:
            return b
        return batch_bucket(b, self.cache.plan.slots, self.fine_buckets and self.stable)

    def decode(self, b: int, kv_need: int) -> torch.Tensor:
        """logits [b', V] for slots 0..b'-1, b' >= b (``batch_bucket``'s on GPU), attending over the
        first kv' >= ``kv_need`` cache positions (``kv_need`` rounded up to ``_KV_BUCKET``): decode
        attention reads the live part of the cache, not all of it. Caches of at most ``_KV_BUCKET_FROM``
        positions are read whole: there attention is a small part of the step and each extra length bucket
        costs a graph capture (~20 ms) in every generate call. With the Triton decode kernel, which reads
        each sequence's keys only up to its position, the whole cache is passed (one graph per batch
        bucket)."""
        full = self.cache.plan.max_len
        whole = full <= _KV_BUCKET_FROM or self.reads_live_only
        kv = full if whole else min(-(-kv_need // _KV_BUCKET) * _KV_BUCKET, full)
        if not self.use_graphs:
            return self._eager(b, kv)
        bucket = self.bucket(b)
        if (bucket, kv) not in self.graphs:
            self._capture(bucket, kv)
        graph, out = self.graphs[bucket, kv]
        graph.replay()
        return out


class _Runner:
    """The continuous-batching loop of one generate call.

    Per-slot progress lives on the device (``live``, ``count``, the response buffers), so a decode step
    is a graph replay plus a few kernels with no host sync; the host looks every ``_SYNC_EVERY`` steps
    (or when a sequence must have hit max_new_tokens) to retire finished sequences and admit waiting ones.
    """

    def __init__(
        self, state: _DecodeState, lay, params: SamplingParams, stats: GenerationStats, cfg, session
    ):
        self.state, self.lay, self.params, self.stats, self.cfg = state, lay, params, stats, cfg
        self.session = session
        # when ``_retire`` last read the device state, and prefill_s then (``GenerationStats.sync_host_s``)
        self.synced_at, self.prefill_at_sync = 0.0, 0.0
        self.appended: dict[int, list[tuple[int, int]]] = {}  # slot -> response spans not sampled
        self.cache, self.w = state.cache, state.w
        slots, dev, n = state.cache.plan.slots, state.tok.device, params.max_new_tokens
        self.rows = torch.arange(slots, device=dev)  # [S]
        self.live = torch.zeros(slots, dtype=torch.bool, device=dev)  # [S] still generating
        self.count = torch.zeros(slots, dtype=torch.long, device=dev)  # [S] tokens generated
        # column n takes the harmless writes of idle / finished slots
        self.out_tok = torch.zeros(slots, n + 1, dtype=torch.long, device=dev)  # [S, N+1]
        self.out_lp = torch.zeros(slots, n + 1, dtype=torch.float32, device=dev)  # [S, N+1]
        truncated = params.top_k > 0 or params.top_p < 1.0
        self.out_tlp = torch.zeros_like(self.out_lp) if truncated else None  # [S, N+1] see Completion
        # multi-turn: a turn also ends at the end of a tool call (the parser's end marker, one token)
        stops = params.stop_token_ids + (session.turn_stop_ids if session is not None else ())
        self.stop_ids = torch.tensor(stops, dtype=torch.long, device=dev)
        self.stop = set(stops)
        self.active: dict[int, Completion] = {}
        self.left: dict[int, int] = {}  # slot -> decode steps it may still take (exact after a sync)
        self.kv_need = 0  # cache positions the next decode step attends over (bound; see _refresh_kv_need)
        stream = params.seed * 1_000_003 + _dp_rank() * lay.num_replicas + lay.replica
        self.gen = torch.Generator(device=dev).manual_seed(stream)
        self.keys = torch.zeros(slots, dtype=torch.long, device=dev)  # [S] sampling.seeded_key s
        self.seq_keys = torch.zeros(slots, dtype=torch.long, device=dev)  # [S] the sequences' own keys
        self.slot_kernels: bool | None = None  # kernels.slot_state keeps the step's bookkeeping (first step)
        state.lead.copy_(self.rows)  # every slot reads its own prompt copy until _admit says otherwise
        state.plen.zero_()

    def _row_keys(self, rows: torch.Tensor | slice) -> torch.Tensor | None:
        """The layout-invariant noise keys of slots ``rows`` (ids, or a slice: views) for this step, or None
        (``layout_invariant_sampling`` off: the draw takes keys from the generator)."""
        if not self.params.layout_invariant_sampling:
            return None
        seeded, count = self.keys[rows], self.count[rows]  # keys hold sampling.seeded_key (see _admit)
        if isinstance(rows, slice) and slot_state.usable(seeded):  # views: one kernel
            return slot_state.row_keys(seeded, count)
        return step_row_keys(seeded, count)

    def _sample(self, logits: torch.Tensor, rows: torch.Tensor, key_rows: slice | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """logits [B, V] of slots ``rows`` [B] -> tokens [B], log-probs [B]; tokens identical on every
        rank of the TP group. ``key_rows``: the same slots as a slice (``_row_keys`` reads views)."""
        row_keys = self._row_keys(rows if key_rows is None else key_rows)
        share = None
        if self.lay.tp_g > 1:

            def share(tokens):
                dist.broadcast(tokens, src=self.lay.gen_src, group=self.lay.gen_group)
                return tokens

        tokens, lps = sample_with_logprobs(logits, self.params, self.gen, row_keys, share)
        p = self.params
        if self.state.exact:  # the trainer's exact recompute: the same log-softmax, split at its vocab shards
            shard = self.w.output.shape[0] if self.w.tp > 1 else None  # V/tp (generation TP = training TP)
            lps = batch_invariant.token_logprobs(
                logits, tokens, logprob_temperature(p.temperature), shard=shard
            )
        if self.out_tlp is not None:  # at the column _record writes next
            tlp = truncated_token_logprobs(logits, tokens, p.temperature, p.top_k, p.top_p, self.state.exact)
            self.out_tlp[rows, self.count[rows]] = tlp
        return tokens, lps

    def _record(self, rows, tokens, lps, live, next_pos) -> None:
        """On the device: append one sampled token to each live row. rows [R] slot ids; tokens, lps,
        live, next_pos [R] (next_pos: the position the new token is fed at). The decode step's rows (slots
        0..R-1) go through ``kernels.slot_state`` (``record`` or its torch ops, ``record_reference``)."""
        n = self.count[rows]
        self.out_tok[rows, n] = tokens
        self.out_lp[rows, n] = lps
        n = n + live
        self.count[rows] = n
        self.live[rows] = live & ~torch.isin(tokens, self.stop_ids) & (n < self.params.max_new_tokens)
        self.state.tok[rows] = tokens
        # a sequence that just finished keeps feeding its last token at that token's own position (the
        # key written there is the right one, and a multi-turn episode continues from that slot's cache);
        # idle rows stay where they are (a released slot is parked at 0, see _retire)
        self.state.pos[rows] = torch.where(live, next_pos, self.state.pos[rows])

    def _admit(self, waiting: deque) -> None:
        """Prefill as many waiting sequences as free slots and the prefill token cap allow. Sequences of
        one prompt admitted together (a prompt's ``n`` samples) share its prefill: the prompt runs once,
        its cache rows are copied to the other slots and each slot samples its own first token, so the
        prefill costs ``n`` times fewer FLOPs and the cap counts each prompt once."""
        t0 = time.perf_counter()
        batch: list[Completion] = []
        first: dict[tuple[int, ...], int] = {}  # prompt ids -> its unique row (order of first arrival)
        longest = 0
        while waiting and len(batch) < self.cache.num_free:
            ids = tuple(waiting[0].prompt_ids)
            if ids not in first:
                longest_next = max(longest, len(ids))
                if first and longest_next * (len(first) + 1) > self.cfg.max_prefill_tokens:
                    break
                first[ids], longest = len(first), longest_next
            batch.append(waiting.popleft())
        slots = [self.cache.allocate() for _ in batch]
        dev = self.rows.device
        unique = [first[tuple(seq.prompt_ids)] for seq in batch]  # [B] unique row of each sequence
        lead = {u: row for row, u in reversed(list(enumerate(unique)))}  # unique row -> its first batch row
        tokens = torch.zeros(len(first), longest, dtype=torch.long)  # [U, T] right-padded
        for ids, u in first.items():
            tokens[u, : len(ids)] = torch.tensor(ids)
        lengths = torch.tensor([len(ids) for ids in first], device=dev)  # [U]
        slot_t = torch.tensor(slots, device=dev)
        lead_slots = torch.tensor([slots[lead[u]] for u in range(len(first))], device=dev)  # [U]
        logits = decoder.prefill(
            self.w, self.state.spec, self.cache.data, tokens.to(dev), lengths, lead_slots, self.state.exact
        )
        copies = [(slots[lead[u]], slot) for u, slot in zip(unique, slots) if slot != slots[lead[u]]]
        if copies:
            src, dst = (torch.tensor(c, device=dev) for c in zip(*copies))
            self.cache.copy_prefix(src, dst, longest)
        rows = torch.tensor(unique, device=dev)  # [B]
        self.state.lead[slot_t] = lead_slots[rows]  # the samples of a prompt read the lead's copy
        self.state.plen[slot_t] = lengths[rows]
        self.count[slot_t] = 0
        self.seq_keys[slot_t] = torch.tensor([seq.key for seq in batch], device=dev)
        self.keys[slot_t] = torch.tensor([seeded_key(seq.key, self.params.seed) for seq in batch], device=dev)
        live = torch.ones(len(batch), dtype=torch.bool, device=dev)
        self._record(slot_t, *self._sample(logits[rows], slot_t), live, lengths[rows])
        for slot, seq in zip(slots, batch):
            self.active[slot] = seq
            self.left[slot] = self.params.max_new_tokens - 1
        self.stats.prefill_tokens += sum(len(ids) for ids in first)
        self._refresh_kv_need()
        _sync(dev)
        self.stats.prefill_s += time.perf_counter() - t0

    def _snapshot_shape(self) -> tuple[int, int]:
        """(slots, tokens) a snapshot copies: the slots up to the highest active one, and one column more than
        any slot holds yet (a live slot's count is ``max_new_tokens - left``, a finished one's less)."""
        return max(self.active) + 1, self.params.max_new_tokens - min(self.left.values()) + 1

    def _async_retire_fits(self) -> bool:
        """``ASYNC_RETIRE`` serves this retire: single-turn, no live slot reaches the cap in the ``_AHEAD``
        steps, and the snapshot is small (it waits in the stream before those steps: at ~25 GB/s 6 MB is
        ~0.25 ms, against the ~2 ms a sync costs a 0.5B window; long responses keep the syncing retire)."""
        if not (ASYNC_RETIRE and self.session is None and min(self.left.values()) > _AHEAD):
            return False
        b, n = self._snapshot_shape()
        return b * n <= _SNAPSHOT_MAX_CELLS

    def _snapshot(self) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """What a retire reads of the device state (live, count and the tokens, log-probs so far of the slots
        up to the highest active one), copied behind the queued steps into pinned host memory (on CUDA: no
        host sync; the event marks the copies done). ``_retire(snapshot)`` reads it after more steps ran."""
        b, n = self._snapshot_shape()
        parts = [
            torch.stack([self.live[:b].long(), self.count[:b]]),
            self.out_tok[:b, :n],
            self.out_lp[:b, :n],
        ]
        if self.out_tlp is not None:
            parts.append(self.out_tlp[:b, :n])
        return to_host_async(parts)

    def _retire(self, snapshot: tuple[list[torch.Tensor], torch.cuda.Event | None] | None = None) -> None:
        """Host sync: hand finished sequences their tokens (or, multi-turn, continue their episodes in the
        same slot), free their slots, refresh the step bounds. With ``snapshot`` (``_snapshot``, taken
        ``_AHEAD`` decode steps ago; single-turn only) the device state is read from it: no wait for the
        device, whose queued steps run on meanwhile. A sequence that finished since is frozen on the device
        (``_record``) and retired at the next window; a live one's ``left`` is exact without the sync."""
        if snapshot is None:
            live, count = torch.stack([self.live.long(), self.count]).tolist()  # [2, S]
            # a multi-turn episode's next-turn prefill below counts as prefill, not as sync time
            self.synced_at, self.prefill_at_sync = time.perf_counter(), self.stats.prefill_s
            tok, lp, tlp = self.out_tok, self.out_lp, self.out_tlp
        else:
            host, event = snapshot
            if event is not None:
                event.synchronize()  # the copies only: steps queued after them run on
            (live, count), tok, lp = host[0].tolist(), host[1], host[2]
            tlp = host[3] if self.out_tlp is not None else None
        done = [slot for slot in self.active if not live[slot]]
        if done:
            idx = torch.tensor(done, device=tok.device)
            tlps = dict(zip(done, tlp[idx].tolist())) if tlp is not None else {}
            ended = []
            # one copy of the finished rows; a multi-turn row's first n values go on as lists (a row at a time
            # through numpy: 17.5 against 25.2 ms for whole-row lists cut after, 512 x 512 on a 2-core CPU,
            # session 30), a single-turn row's as views, listed only if read (``Completion.set_arrays``)
            tok_h, lp_h = tok[idx].cpu().numpy(), lp[idx].cpu().numpy()
            rows = {slot: i for i, slot in enumerate(done)}
            single = self.session is None
            for i, slot in enumerate(done):
                n = count[slot]
                listed = (None, None) if single else (tok_h[i, :n].tolist(), lp_h[i, :n].tolist())
                ended.append((slot, *listed, int(tok_h[i, n - 1]) in self.stop))
            if not single:
                ended = self._next_turns(ended, count)
            for slot, toks, lps, stopped in ended:
                seq = self.active.pop(slot)
                if single:
                    n = count[slot]
                    seq.set_arrays(tok_h[rows[slot], :n], lp_h[rows[slot], :n])
                    if slot in tlps:
                        seq.truncated_logprobs = tlps[slot][:n]
                else:
                    seq.response_ids, seq.logprobs = toks, lps
                seq.finish_reason = seq.finish_reason or ("stop" if stopped else "length")
                self._finish_episode(slot, seq)
                del self.left[slot]
                self.cache.release(slot)
            if ended:  # one host-to-device copy for all of them (``pos[slot] = 0`` was a sync a slot)
                freed = self._to_device([slot for slot, *_ in ended])
                # idle: their writes land at 0, inside any attention window
                self.state.pos.index_fill_(0, freed, 0)
                self._unlead(freed)
        if snapshot is None:  # from the snapshot, count is _AHEAD steps old: left (counted down) is exact
            for slot in self.active:
                self.left[slot] = self.params.max_new_tokens - count[slot]
        self._refresh_kv_need()

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """An int64 index tensor on the engine's device, without a host sync."""
        return to_device_async(torch.tensor(values, dtype=torch.long), self.rows.device)

    def _unlead(self, freed: torch.Tensor) -> None:
        """Slots ``freed`` (int64, on the device) are released (their cache rows may be overwritten by the next
        admitted prompt): every slot that read its prompt from one of them reads its own copy from now on.
        No host sync (``torch.where``, not a masked assignment)."""
        lead = self.state.lead
        lead.copy_(torch.where(torch.isin(lead, freed), self.rows, lead))
        self.state.plen.index_fill_(0, freed, 0)

    def _next_turns(self, ended: list, count: list[int]) -> list:
        """Ask the session what follows each ended turn; prefill the appended ids onto the slots that go
        on (all in one batch; ``count`` is updated for them), return the sequences whose episode is over."""
        n = self.params.max_new_tokens
        items = [(self.active[slot], toks, stopped, n - len(toks)) for slot, toks, _, stopped in ended]
        group = self.lay.gen_group if self.lay.tp_g > 1 else None
        decisions = self.session.after_turns(items, group, self.lay.gen_src)
        over, going = [], []
        for (slot, toks, lps, stopped), d in zip(ended, decisions):
            if d.append is None:
                self.active[slot].finish_reason = d.finish_reason
                over.append((slot, toks, lps, stopped))
            else:
                going.append((slot, toks[-1], d.append, count[slot]))
        if going:
            self._extend(going)
        for slot, _, ids, c in going:  # the appended ids and the next turn's first token
            count[slot] = c + len(ids) + 1
        return over

    def _extend(self, going: list[tuple[int, int, list[int], int]]) -> None:
        """``(slot, last sampled token, appended ids, response length)`` per slot: the last sampled token
        (never fed yet) and the appended ids go into the cache; the next turn's first token is sampled."""
        t0 = time.perf_counter()
        dev = self.rows.device
        feeds = [[last, *ids] for _, last, ids, _ in going]
        tokens = torch.zeros(len(feeds), max(map(len, feeds)), dtype=torch.long)  # [B, T] right-padded
        for row, feed in enumerate(feeds):
            tokens[row, : len(feed)] = torch.tensor(feed)
        slots = [slot for slot, *_ in going]
        slot_t = torch.tensor(slots, device=dev)
        lengths = torch.tensor([len(f) for f in feeds], device=dev)
        # the last sampled token sits at response index c - 1, i.e. position prompt + c - 1
        starts = torch.tensor([len(self.active[s].prompt_ids) + c - 1 for s, _, _, c in going], device=dev)
        for slot, _, ids, c in going:
            self.out_tok[slot, c : c + len(ids)] = torch.tensor(ids, device=dev)
            self.out_lp[slot, c : c + len(ids)] = 0.0
            self.count[slot] = c + len(ids)
            self.appended.setdefault(slot, []).append((c, c + len(ids)))
        logits = decoder.extend(
            self.w, self.state.spec, self.cache.data, tokens.to(dev), starts, lengths, slot_t
        )
        live = torch.ones(len(going), dtype=torch.bool, device=dev)
        self._record(slot_t, *self._sample(logits, slot_t), live, starts + lengths)
        _sync(dev)
        self.stats.prefill_s += time.perf_counter() - t0

    def _finish_episode(self, slot: int, seq: Completion) -> None:
        if self.session is None:
            return
        mask = [1] * len(seq.response_ids)
        for a, b in self.appended.pop(slot, []):
            mask[a:b] = [0] * (b - a)
        ep = self.session.episode(seq)
        seq.response_mask, seq.turns, seq.tool_reward = mask, ep.turns, ep.reward
        seq.tool_counts = (ep.tool_calls, ep.tool_errors, ep.tool_timeouts)

    def _refresh_kv_need(self) -> None:
        """After admitting or retiring: the position a live slot feeds next is prompt + tokens so far - 1,
        and tokens so far = max_new_tokens - ``left`` (exact after a sync); every step adds one to all."""
        n = self.params.max_new_tokens
        self.kv_need = max(
            (len(seq.prompt_ids) + n - self.left[s] for s, seq in self.active.items()), default=0
        )

    def _step(self) -> None:
        logits = self.state.decode(max(self.active) + 1, self.kv_need)  # [b, V], b a bucket >= max slot + 1
        self.stats.decode_rows += logits.shape[0]
        b = logits.shape[0]
        rows = self.rows[:b]
        drawn = self._sample(logits, rows, slice(0, b))
        st = self.state
        slots = (
            self.live[:b],
            self.count[:b],
            self.out_tok,
            self.out_lp,
            st.tok[:b],
            st.pos[:b],
            self.stop_ids,
        )
        if self.slot_kernels is None:  # the same dtypes and strides every step: decided once
            self.slot_kernels = slot_state.record_fits(*drawn, *slots)
        if self.slot_kernels:  # _record's updates in one kernel
            slot_state.record(*drawn, *slots, self.params.max_new_tokens)
        else:  # the same updates in torch ops, on rows 0..b-1 as views (a copy each, no gather or scatter)
            slot_state.record_reference(*drawn, *slots, self.params.max_new_tokens)
        for slot in self.left:
            self.left[slot] -= 1
        self.kv_need += 1

    def _compact(self) -> None:
        """Nothing waiting: move the sequences of the highest slots into free lower ones, so that the decode
        batch (the bucket over the highest active slot) shrinks as sequences finish. Without it
        a batch of 512 decoded 512 rows to the end while most had stopped (spread-length GRPO, H200: 4.4 ms
        a step at 0.5B, more than with every row live). Moves a slot's cached keys/values (the positions
        written so far) and its device-side progress; sampling noise follows the sequence (its key and
        token count), so layout-invariant sampling gives the same tokens. With the finer batch buckets
        (``batch_bucket``) this runs about every 32 finished rows, each time copying the movers' cached
        prefixes (inside the spread-length step times measured in session 22)."""
        if not self.active:
            return
        target = self.state.bucket(len(self.active))
        movers = sorted(s for s in self.active if s >= target)
        if not movers or self.state.bucket(max(self.active) + 1) <= target:
            return
        dests = [self.cache.allocate() for _ in movers]  # lowest first: all below target
        src, dst = self._to_device(movers), self._to_device(dests)
        self.cache.copy_prefix(src, dst, min(self.kv_need, self.cache.plan.max_len))
        per_slot = [
            self.state.tok,
            self.state.pos,
            self.live,
            self.count,
            self.keys,
            self.seq_keys,
            self.out_tok,
            self.out_lp,
        ]
        for t in per_slot + ([self.out_tlp] if self.out_tlp is not None else []):
            t[dst] = t[src]
        lead, plen = self.state.lead, self.state.plen  # a moved lead is read at its new slot
        lead[dst], plen[dst] = lead[src], plen[src]
        moved_to = self.rows.clone()
        moved_to[src] = dst
        lead.copy_(moved_to[lead])
        lead[src] = src
        plen.index_fill_(0, src, 0)  # not ``plen[src] = 0``: that copies the 0 to the device (a sync)
        self.live.index_fill_(0, src, False)
        self.state.pos.index_fill_(0, src, 0)  # idle, as a released slot
        for a, b in zip(movers, dests):
            self.active[b], self.left[b] = self.active.pop(a), self.left.pop(a)
            if a in self.appended:
                self.appended[b] = self.appended.pop(a)
            self.cache.release(a)
        self.stats.compactions += 1
        self.stats.moved_slots += len(movers)

    def run(self, seqs: list[Completion]) -> None:
        waiting = deque(seqs)
        since_sync = 0
        while waiting or self.active:
            if waiting and self.cache.num_free:
                with annotate("rollout.admit"):
                    self._admit(waiting)
            elif since_sync >= _SYNC_EVERY or min(self.left.values()) <= 0:
                ahead = _AHEAD if self._async_retire_fits() else 0
                # with ahead: read the state behind the window, queue more steps, retire while they run
                snapshot = self._snapshot() if ahead else None
                for _ in range(ahead):
                    with annotate("rollout.decode_step"):
                        self._step()
                    self.stats.decode_steps += 1
                with annotate("rollout.retire"):
                    self._retire(snapshot)
                    if not waiting and _COMPACT:
                        self._compact()
                since_sync = ahead
                if ahead:
                    self.stats.async_retires += 1
                else:
                    self.stats.syncs += 1
                    prefilled = self.stats.prefill_s - self.prefill_at_sync
                    self.stats.sync_host_s += time.perf_counter() - self.synced_at - prefilled
            else:
                with annotate("rollout.decode_step"):
                    self._step()
                since_sync += 1
                self.stats.decode_steps += 1


_COMPACT = True  # move live sequences to low slots when nothing waits (``_Runner._compact``)
_FINE_STEP_MIN = 32  # the finer batch buckets' smallest step (``batch_bucket``)
_KV_BUCKET = 128  # decode attention length granularity (one CUDA graph per bucket used)
_KV_BUCKET_FROM = 512  # caches up to this many positions are attended whole (one graph per batch bucket)


def batch_bucket(b: int, slots: int, fine: bool) -> int:
    """The decode graph's rows for b live slots (0..b-1) of ``slots``: the next power of two, and with
    ``fine`` above ``step`` = max(_FINE_STEP_MIN, next power of two of slots / 16) the next multiple of ``step``
    (at most ~16 graphs more). A step's time follows its rows (H100, 0.5B, 512 slots: 1.77 ms at 256 rows,
    2.03 at 320, 2.60 at 512; ``benchmarks/bench_decode_rows.py``), and once sequences finish the
    power-of-two bucket runs ~1/3 more rows than are live (spread-length GRPO: 248 a step for 187 live)."""
    b = max(1, b)
    bucket = 1 << (b - 1).bit_length()
    if fine:
        step = max(_FINE_STEP_MIN, (1 << (slots - 1).bit_length()) // 16)
        if bucket > step:
            bucket = -(-b // step) * step
    return min(bucket, slots)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dp_rank() -> int:
    if not dist.is_initialized():
        return 0
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank()
