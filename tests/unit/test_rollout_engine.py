"""The rollout engine in one process: decoder vs HF, continuous batching, log-probs, seeds, errors."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "workers"))
from rollout_common import hf_greedy, hf_logprobs, hf_to_mcore, random_prompts, spec_of, tiny_hf  # noqa: E402

from megatron_rl.rollout import decoder  # noqa: E402
from megatron_rl.rollout.engine import EngineConfig, GenerationOOM, RolloutEngine  # noqa: E402
from megatron_rl.rollout.sampling import SamplingParams  # noqa: E402


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model(request):
    hf = tiny_hf(request.param)
    spec = spec_of(hf)
    return hf, spec, hf_to_mcore(hf, spec, 1, 0, 1, 0)


def test_greedy_equals_hf_and_logprobs_equal_hf_forward(model):
    hf, spec, params = model
    prompts = random_prompts(6, seed=1)
    before = {k: p.detach().clone() for k, p in params.items()}
    engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=4))
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10))
    assert [c.response_ids for c in out] == [hf_greedy(hf, p, 10) for p in prompts]
    sampled = engine.generate(
        prompts, SamplingParams(temperature=0.7, top_p=0.9, n=2, max_new_tokens=10, seed=1)
    )
    assert [(c.prompt_index, c.sample_index) for c in sampled] == [(i, s) for i in range(6) for s in range(2)]
    # single-turn results come unlisted (``Completion.set_arrays``): listed only when read, below
    assert all(c.__dict__["_response_ids"] is None and c.__dict__["_logprobs"] is None for c in sampled)
    assert engine.last_stats.new_tokens == 12 * 10
    for c in sampled:
        ref = hf_logprobs(hf, c.prompt_ids, c.response_ids, 0.7)
        assert (torch.tensor(c.logprobs) - ref).abs().max() < 1e-5
        # the arrays build_batch copies from hold the lists' values (single-turn)
        assert c.arrays[0].tolist() == c.response_ids and c.arrays[1].tolist() == c.logprobs
    assert all(torch.equal(p, before[k]) for k, p in params.items())
    stats = engine.last_stats
    assert stats.gathered_weight_bytes == 0 and stats.peak_memory_bytes == stats.kv_cache_bytes > 0


def test_continuous_batching_with_stop_ids_equals_each_prompt_alone():
    hf = tiny_hf("llama")
    spec = spec_of(hf)
    params = hf_to_mcore(hf, spec, 1, 0, 1, 0)
    prompts = random_prompts(10, seed=4)
    full = [hf_greedy(hf, p, 16) for p in prompts]
    stop = {full[0][1], full[3][6], full[5][11]}  # responses end early at different lengths
    sp = SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=tuple(stop))
    engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=3, max_prefill_tokens=40))
    batched = engine.generate(prompts, sp)
    lengths = {len(c.response_ids) for c in batched}
    assert len(lengths) >= 3 and {c.finish_reason for c in batched} == {"stop", "length"}
    for p, c, ref in zip(prompts, batched, full):
        alone = RolloutEngine(params, spec, EngineConfig(max_num_seqs=1)).generate([p], sp)[0]
        assert c.response_ids == alone.response_ids
        cut = next((i + 1 for i, t in enumerate(ref) if t in stop), len(ref))
        assert c.response_ids == ref[:cut]
        assert c.finish_reason == ("stop" if c.response_ids[-1] in stop else "length")
    assert engine.last_stats.slots == 3


def test_engine_sampling_is_reproducible_with_a_seed(model):
    hf, spec, params = model
    engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=2))
    prompts = random_prompts(3, seed=2)
    run = [
        engine.generate(prompts, SamplingParams(temperature=1.0, top_k=50, n=2, max_new_tokens=8, seed=s))
        for s in (9, 9, 10)
    ]
    ids = [[c.response_ids for c in r] for r in run]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_bad_arguments_fail_before_any_work(model):
    _, spec, params = model
    with pytest.raises(
        ValueError, match="rollout.tensor_model_parallel_size=2.*parallel.tensor_model_parallel_size"
    ):
        RolloutEngine(params, spec, EngineConfig(tensor_model_parallel_size=2)).generate(
            [[1, 2]], SamplingParams()
        )
    engine = RolloutEngine(params, spec, EngineConfig(kv_cache_tokens=20))
    with pytest.raises(ValueError, match="rollout.kv_cache_tokens"):
        engine.generate([[1] * 15], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="Empty prompt"):
        engine.generate([[]], SamplingParams(max_new_tokens=8))


def test_out_of_memory_names_the_keys_to_lower(model, monkeypatch):
    _, spec, params = model

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(decoder, "prefill", oom)
    with pytest.raises(
        GenerationOOM, match="rollout.kv_cache_tokens.*data.train_batch_size.*rollout.max_new_tokens"
    ):
        RolloutEngine(params, spec).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))


def test_kv_cache_starts_finite_so_masked_positions_cannot_poison_attention():
    from megatron_rl.rollout.kv_cache import CachePlan, KVCache

    cache = KVCache(
        CachePlan(slots=3, max_len=7, bytes_per_token=0), 2, 2, 4, torch.bfloat16, torch.device("cpu")
    )
    assert cache.data.shape == (2, 2, 3, 2, 7, 4) and torch.isfinite(cache.data).all()
    assert [cache.allocate() for _ in range(2)] == [0, 1]
    cache.release(0)
    assert cache.allocate() == 0 and cache.num_free == 1


def test_rope_by_roll_equals_rotate_half_bitwise():
    x = torch.randn(3, 5, 2, 4, 16, dtype=torch.bfloat16)  # [B, T, G, rep+1, D]
    positions = torch.randint(0, 1000, (3, 5))
    cos, sin = decoder.rope_cos_sin(positions, 16, 1e6, torch.bfloat16)  # signed sin
    x1, x2 = x.chunk(2, dim=-1)
    hf_sin = torch.cat((sin[..., 8:], sin[..., 8:]), dim=-1)  # HF's unsigned sin
    plain = x * cos + torch.cat((-x2, x1), dim=-1) * hf_sin
    assert torch.equal(decoder.apply_rope(x, cos, sin), plain)


def test_decode_rope_matrix_equals_elementwise_rope():
    x = torch.randn(6, 9, 16, dtype=torch.float64)  # [B, n, D]
    cos, sin = decoder.rope_cos_sin(torch.randint(0, 5000, (6, 1)), 16, 1e6, torch.float64)  # [B, 1, 1, 1, D]
    want = decoder.apply_rope(x, cos[:, 0, 0], sin[:, 0, 0])
    assert torch.allclose(x @ decoder.rope_matrix(cos[:, 0, 0, 0], sin[:, 0, 0, 0]), want, atol=1e-12)


@pytest.mark.parametrize("sync_every", [1, 5])
def test_device_side_bookkeeping_is_independent_of_the_sync_interval(monkeypatch, sync_every):
    """Sequences stopping between host syncs, slots refilled later: same tokens and log-probs as HF."""
    from megatron_rl.rollout import engine as engine_mod

    monkeypatch.setattr(engine_mod, "_SYNC_EVERY", sync_every)
    hf = tiny_hf("qwen2")
    spec = spec_of(hf)
    params = hf_to_mcore(hf, spec, 1, 0, 1, 0)
    prompts = random_prompts(7, seed=5)
    full = [hf_greedy(hf, p, 24) for p in prompts]
    stop = {full[1][2], full[4][9], full[6][17]}
    sp = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=tuple(stop))
    out = RolloutEngine(params, spec, EngineConfig(max_num_seqs=3)).generate(prompts, sp)
    for p, c, ref in zip(prompts, out, full):
        cut = next((i + 1 for i, t in enumerate(ref) if t in stop), len(ref))
        assert c.response_ids == ref[:cut] and len(c.logprobs) == cut
        assert c.finish_reason == ("stop" if ref[cut - 1] in stop else "length")
        assert (torch.tensor(c.logprobs) - hf_logprobs(hf, p, c.response_ids, 1.0)).abs().max() < 1e-5


def test_keep_cache_reuses_the_cache_and_matches_fresh_engines():
    hf = tiny_hf("llama")
    spec = spec_of(hf)
    params = hf_to_mcore(hf, spec, 1, 0, 1, 0)
    prompts = random_prompts(5, seed=6)
    sp = SamplingParams(temperature=0.8, n=2, max_new_tokens=9, seed=4)

    def ids(out):
        return [c.response_ids for c in out]

    kept = RolloutEngine(params, spec, EngineConfig(max_num_seqs=4, keep_cache=True))
    kept.generate(prompts, sp)
    state, key = kept._state, kept._state.key
    with torch.no_grad():
        for p in params.values():  # an optimizer step: new values in the same storage
            p.mul_(0.9)
    again = kept.generate(prompts[:3], sp)  # fewer sequences fit the kept cache (stale keys inside)
    fresh = RolloutEngine(params, spec, EngineConfig(max_num_seqs=4)).generate(prompts[:3], sp)
    assert kept._state is state and state.key == key and kept.last_stats.slots == 4
    assert ids(again) == ids(fresh)
    kept.model = {k: p.clone() for k, p in params.items()}  # same values in new storage: rebound
    assert ids(kept.generate(prompts[:3], sp)) == ids(fresh)
    assert kept._state is state and state.key != key
    kept.generate(prompts, SamplingParams(max_new_tokens=40))  # longer than the kept cache: a new one
    assert kept._state is not state and kept._state.cache.plan.max_len >= 40
    plain = RolloutEngine(params, spec, EngineConfig(max_num_seqs=4))
    plain.generate(prompts, sp)
    assert plain._state is None  # default: cache and graphs are freed after every call


def test_layout_invariant_sampling_does_not_depend_on_batching(model):
    """With SamplingParams.layout_invariant_sampling a sequence's samples depend only on (seed, prompt key, sample
    index): the slot count, the batch it shares and the prompt's position in the call do not matter."""
    hf, spec, params = model
    sp = SamplingParams(temperature=1.0, n=2, max_new_tokens=8, seed=4, layout_invariant_sampling=True)
    prompts = random_prompts(5, seed=3)
    keys = [100 + i for i in range(5)]
    together = RolloutEngine(params, spec, EngineConfig(max_num_seqs=6)).generate(prompts, sp, keys)
    alone = [
        RolloutEngine(params, spec, EngineConfig(max_num_seqs=1)).generate([p], sp, [k])
        for p, k in zip(prompts, keys)
    ]
    assert [c.response_ids for c in together] == [c.response_ids for one in alone for c in one]
    assert len({tuple(c.response_ids) for c in together}) > 1  # it does sample
    reordered = RolloutEngine(params, spec, EngineConfig(max_num_seqs=3)).generate(
        prompts[::-1], sp, keys[::-1]
    )
    back = {(c.key, tuple(c.response_ids)) for c in reordered}
    assert back == {(c.key, tuple(c.response_ids)) for c in together}
    other_seed = SamplingParams(
        temperature=1.0, n=2, max_new_tokens=8, seed=5, layout_invariant_sampling=True
    )
    moved = RolloutEngine(params, spec, EngineConfig(max_num_seqs=6)).generate(prompts, other_seed, keys)
    assert [c.response_ids for c in moved] != [c.response_ids for c in together]


def test_decode_attention_over_the_live_cache_length_only(model, monkeypatch):
    """With a KV bucket of 4 positions the decode step reads a growing prefix of the cache (bucket ->
    kv length): greedy still equals HF token for token, sampled log-probs equal the HF forward, and the
    attended lengths really were shorter than the cache."""
    from megatron_rl.rollout import engine as engine_mod

    hf, spec, params = model
    monkeypatch.setattr(engine_mod, "_KV_BUCKET", 4)
    monkeypatch.setattr(engine_mod, "_KV_BUCKET_FROM", 8)
    seen = []
    original = decoder.decode
    monkeypatch.setattr(decoder, "decode", lambda *a, **k: seen.append(a[5]) or original(*a, **k))
    prompts = random_prompts(5, seed=7)
    engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=3))
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    assert [c.response_ids for c in out] == [hf_greedy(hf, p, 12) for p in prompts]
    cache_len = max(len(p) for p in prompts) + 12
    assert min(seen) < cache_len and len(set(seen)) > 2 and all(kv % 4 == 0 or kv == cache_len for kv in seen)
    for c in engine.generate(prompts, SamplingParams(temperature=0.8, max_new_tokens=12, seed=3)):
        assert (
            torch.tensor(c.logprobs) - hf_logprobs(hf, c.prompt_ids, c.response_ids, 0.8)
        ).abs().max() < 1e-5


def test_fused_sampler_in_the_engine_matches_hf_logprobs_and_the_eager_sampler(model, monkeypatch):
    """MEGATRON_RL_COMPILE=1 runs the compiled sampler (the GPU default) on CPU: its log-probs equal the
    HF forward, and with layout-invariant noise it samples what the eager path samples."""
    hf, spec, params = model
    prompts = random_prompts(4, seed=11)
    sp = SamplingParams(temperature=0.8, n=2, max_new_tokens=6, seed=2, layout_invariant_sampling=True)
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MEGATRON_RL_COMPILE", flag)
        outs[flag] = RolloutEngine(params, spec, EngineConfig(max_num_seqs=8)).generate(prompts, sp)
    assert [c.response_ids for c in outs["1"]] == [c.response_ids for c in outs["0"]]
    plain = SamplingParams(temperature=0.8, n=2, max_new_tokens=6, seed=2)
    for c in RolloutEngine(params, spec, EngineConfig(max_num_seqs=8)).generate(prompts, plain):
        ref = hf_logprobs(hf, c.prompt_ids, c.response_ids, 0.8)
        assert (torch.tensor(c.logprobs) - ref).abs().max() < 1e-5


def test_engine_with_the_triton_decode_kernel_equals_hf(model, monkeypatch):
    """The decode step with the Triton attention kernel (interpreted on CPU; the GPU path): greedy equals
    HF token for token and sampled log-probs equal the HF forward."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import decode_attention as kernel

    hf, spec, params = model
    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    calls = []
    original = kernel.decode_attention
    monkeypatch.setattr(kernel, "decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    prompts = random_prompts(3, seed=5)
    engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=3))
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=5))
    assert calls and [c.response_ids for c in out] == [hf_greedy(hf, p, 5) for p in prompts]
    for c in engine.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=5, seed=1)):
        assert (
            torch.tensor(c.logprobs) - hf_logprobs(hf, c.prompt_ids, c.response_ids, 0.9)
        ).abs().max() < 1e-5


def test_samples_of_one_prompt_share_its_prefill_and_match_unshared_generation(model):
    """A prompt's n samples admitted together run its prefill once (its cache rows copied to the other
    slots); tokens and log-probs equal the one-slot engine's (each sample prefilled alone) and HF's."""
    hf, spec, params = model
    sp = SamplingParams(temperature=1.0, n=3, max_new_tokens=6, seed=2, layout_invariant_sampling=True)
    prompts = random_prompts(4, seed=8)
    keys = [7 + i for i in range(4)]
    shared_engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=12))
    shared = shared_engine.generate(prompts, sp, keys)
    assert shared_engine.last_stats.prefill_tokens == sum(map(len, prompts))  # each prompt once
    alone_engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=1))
    alone = alone_engine.generate(prompts, sp, keys)
    assert alone_engine.last_stats.prefill_tokens == 3 * sum(map(len, prompts))
    assert [c.response_ids for c in shared] == [c.response_ids for c in alone]
    assert len({tuple(c.response_ids) for c in shared}) > 4  # the samples of a prompt differ
    for s, a in zip(shared, alone):
        assert (torch.tensor(s.logprobs) - torch.tensor(a.logprobs)).abs().max() < 1e-5
        assert (
            torch.tensor(s.logprobs) - hf_logprobs(hf, s.prompt_ids, s.response_ids, 1.0)
        ).abs().max() < 1e-5


def test_kv_slots_come_from_the_plan_or_from_free_plus_cached_memory():
    """The slot decision: the memory plan's kv_cache_tokens (rollout.max_num_seqs=auto) gives all 512
    sequences one wave; without it, the allocator's unused cached blocks count as free. Session 4, 3B
    after an update: ~11.8 GB free by the driver (208 slots at gpu_memory_utilization 0.5, three waves),
    ~75 GB more cached by the allocator."""
    from megatron_rl.rollout.kv_cache import free_memory_tokens, plan_cache

    per_token, max_len = 36864, 768  # Qwen2.5-3B: 2 x 36 layers x 2 groups x 128 x bf16
    planned = plan_cache(max_len=max_len, wanted_slots=512, max_num_seqs=512, per_token=per_token,
                         kv_cache_tokens=512 * max_len, gpu_memory_utilization=0.5, device=torch.device("cpu"))  # fmt: skip
    assert planned.slots == 512
    free, cached = int(11.8e9), int(75e9)
    assert free_memory_tokens(free, 0, 0.5, per_token) // max_len == 208
    assert free_memory_tokens(free, cached, 0.5, per_token) // max_len >= 512
    assert free_memory_tokens(free, -5, 0.5, per_token) == free_memory_tokens(free, 0, 0.5, per_token)


def test_copy_prefix_copies_only_the_prompt_positions_of_the_chosen_slots():
    from megatron_rl.rollout.kv_cache import CachePlan, KVCache

    cache = KVCache(
        CachePlan(slots=4, max_len=6, bytes_per_token=0), 2, 2, 3, torch.float32, torch.device("cpu")
    )
    cache.data.copy_(torch.randn_like(cache.data))
    before = cache.data.clone()
    cache.copy_prefix(torch.tensor([0, 0]), torch.tensor([2, 3]), 4)
    for dst in (2, 3):
        assert torch.equal(cache.data[:, :, dst, :, :4], before[:, :, 0, :, :4])
        assert torch.equal(cache.data[:, :, dst, :, 4:], before[:, :, dst, :, 4:])
    assert torch.equal(cache.data[:, :, :2], before[:, :, :2])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_finished_sequences_free_the_decode_batch_and_results_do_not_change(monkeypatch, family):
    """All prompts admitted at once, nothing waiting: as sequences stop, the live ones move to the lowest
    slots (``_Runner._compact``) so later decode steps run fewer rows. Greedy tokens and log-probs still
    equal HF; sampled (layout-invariant) tokens equal the run without compaction."""
    from megatron_rl.rollout import engine as engine_mod

    monkeypatch.setattr(engine_mod, "_SYNC_EVERY", 2)
    hf = tiny_hf(family)
    spec = spec_of(hf)
    params = hf_to_mcore(hf, spec, 1, 0, 1, 0)
    prompts = random_prompts(9, seed=7)
    full = [hf_greedy(hf, p, 20) for p in prompts]
    stop = {full[0][1], full[2][4], full[5][8], full[7][13]}  # the early finishers sit in low slots
    sp = SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=tuple(stop))
    runs = {}
    for compact in (True, False):
        monkeypatch.setattr(engine_mod, "_COMPACT", compact)
        engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=9))
        runs[compact] = (engine.generate(prompts, sp), engine.last_stats)
    out, stats = runs[True]
    for p, c, ref in zip(prompts, out, full):
        cut = next((i + 1 for i, t in enumerate(ref) if t in stop), len(ref))
        assert c.response_ids == ref[:cut] and c.finish_reason == (
            "stop" if ref[cut - 1] in stop else "length"
        )
        assert (torch.tensor(c.logprobs) - hf_logprobs(hf, p, c.response_ids, 1.0)).abs().max() < 1e-5
    assert len({len(c.response_ids) for c in out}) >= 3
    assert stats.compactions > 0 and stats.moved_slots > 0
    assert stats.decode_rows < runs[False][1].decode_rows  # fewer rows decoded for the same tokens
    assert runs[False][1].compactions == 0
    sampled = SamplingParams(temperature=1.0, n=3, max_new_tokens=20, seed=3, stop_token_ids=tuple(stop),
                             layout_invariant_sampling=True)  # fmt: skip
    got = {}
    for compact in (True, False):
        monkeypatch.setattr(engine_mod, "_COMPACT", compact)
        got[compact] = RolloutEngine(params, spec, EngineConfig(max_num_seqs=27)).generate(prompts, sampled)
    assert [c.response_ids for c in got[True]] == [c.response_ids for c in got[False]]
    assert len({len(c.response_ids) for c in got[True]}) >= 3
    for a, b in zip(got[True], got[False]):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_a_planned_kv_cache_that_the_free_device_memory_cannot_hold_gets_fewer_slots():
    """The 8B OOM of session 7: 421 slots planned (39.5 GiB), 37.5 GiB free, 9.9 GiB in fragments. The engine
    empties the allocator's cache before planning only where the plan does not fit the free memory beside
    its 1.5 GiB headroom (``fits_free``; emptying it costs the update's next step re-mapping its pages)."""
    from megatron_rl.rollout.kv_cache import CachePlan, fit_free_memory, fits_free

    gib = 2**30
    plan = CachePlan(slots=421, max_len=768, bytes_per_token=131072)
    same, note = fit_free_memory(plan, free=60 * gib, held=0)
    assert same == plan and note is None
    fewer, note = fit_free_memory(plan, free=int(37.5 * gib), held=int(9.9 * gib))
    assert fewer.max_len == 768 and fewer.bytes <= 36 * gib and fewer.slots == 36 * gib // (768 * 131072)
    assert "421 slots" in note and "expandable_segments" in note and "rollout.max_num_seqs" in note
    # not even one slot: the plan stands and the allocation raises GenerationOOM naming the keys
    assert fit_free_memory(plan, free=gib, held=0) == (plan, None)
    assert fits_free(plan, plan.bytes + 3 * gib // 2) and not fits_free(plan, plan.bytes + 3 * gib // 2 - 1)


def test_engine_with_the_fused_decode_kernels_equals_hf(model, monkeypatch):
    """The decode step with the fused Triton kernels (``kernels.decode_fused``: RoPE + KV-cache write,
    add + RMSNorm, SwiGLU; interpreted on CPU, on by default on the GPU): every kernel
    runs, greedy equals HF token for token and sampled log-probs equal the HF forward (qk-norm included)."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import decode_fused

    hf, spec, params = model
    monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)
    calls = []
    for name in ("rope_kv_write", "add_rms_norm", "swiglu"):
        original = getattr(decode_fused, name)
        monkeypatch.setattr(decode_fused, name,
                            lambda *a, _n=name, _f=original, **k: calls.append(_n) or _f(*a, **k))  # fmt: skip
    prompts = random_prompts(3, seed=6)
    engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=3))
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=5))
    assert set(calls) == {"rope_kv_write", "add_rms_norm", "swiglu"}
    assert [c.response_ids for c in out] == [hf_greedy(hf, p, 5) for p in prompts]
    for c in engine.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=5, seed=1)):
        assert (
            torch.tensor(c.logprobs) - hf_logprobs(hf, c.prompt_ids, c.response_ids, 0.9)
        ).abs().max() < 1e-5


def test_the_fused_decode_step_with_the_attention_kernel_builds_no_mask(monkeypatch):
    """With the Triton decode attention serving (interpreted here) the fused decode step passes no additive
    mask (the kernel reads the positions); greedy still equals HF. With SDPA the mask is built once a step."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import decode_attention as kernel
    from megatron_rl.kernels import decode_fused

    hf = tiny_hf("qwen2")
    spec = spec_of(hf)
    params = hf_to_mcore(hf, spec, 1, 0, 1, 0)
    monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)
    masks = []
    original = decoder._decode_mask
    monkeypatch.setattr(decoder, "_decode_mask", lambda *a: masks.append(a) or original(*a))
    prompts = random_prompts(3, seed=8)
    want = [hf_greedy(hf, p, 4) for p in prompts]
    for on in (False, True):
        monkeypatch.setattr(kernel, "RUN_ON_CPU", on)
        masks.clear()
        out = RolloutEngine(params, spec, EngineConfig(max_num_seqs=3)).generate(
            prompts, SamplingParams(temperature=0, max_new_tokens=4)
        )
        assert [c.response_ids for c in out] == want, on
        assert (len(masks) == 0) == on, (on, len(masks))  # SDPA: one mask a decode step


def test_rope_inside_the_decode_attention_kernel_gives_the_engine_the_same_bits(model, monkeypatch):
    """``MEGATRON_RL_DECODE_ROPE_IN_ATTENTION`` (one kernel for RoPE, the KV write and attention; the fused
    kernels and the Triton decode kernel interpreted on CPU): it runs, passed its trial, and the engine's
    sampled tokens and log-probs are the two-kernel decode step's bit for bit, with prompt KV sharing."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import decode_attention as kernel
    from megatron_rl.kernels import decode_fused

    _, spec, params = model
    monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)
    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    calls, original = [], kernel.rope_decode_attention
    monkeypatch.setattr(kernel, "rope_decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    prompts = random_prompts(3, seed=7)
    sp = SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=2)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(kernel, "ROPE_IN_ATTENTION", on)
        engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=6))
        runs[on] = engine.generate(prompts, sp)
        assert bool(calls) == on
    assert [c.response_ids for c in runs[True]] == [c.response_ids for c in runs[False]]
    assert all(a.logprobs == b.logprobs for a, b in zip(runs[True], runs[False]))


@pytest.mark.parametrize("slots,compact", [(7, False), (18, True)])
def test_prompt_kv_sharing_gives_the_same_bits_through_retire_reuse_and_compaction(
    monkeypatch, slots, compact
):
    """``rollout.prompt_kv_sharing``: the samples of a prompt read its keys and values from the lead slot
    (the Triton kernel, interpreted). Through continuous batching (leads that stop before their group, their
    slots re-used by other prompts while the group decodes on) and compaction, tokens and log-probs are the
    unshared engine's bit for bit, and the kernel was handed slots that read another slot's prompt."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import decode_attention as kernel
    from megatron_rl.rollout import engine as engine_mod

    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    monkeypatch.setattr(engine_mod, "_SYNC_EVERY", 2)
    monkeypatch.setattr(engine_mod, "_COMPACT", compact)
    hf = tiny_hf("qwen2")
    spec = spec_of(hf)
    params = hf_to_mcore(hf, spec, 1, 0, 1, 0)
    prompts = random_prompts(6, seed=11)
    stops = tuple(range(100, 140))  # ~12% of the vocabulary: samples of one prompt stop at uneven lengths
    sp = SamplingParams(temperature=1.0, n=3, max_new_tokens=14, seed=4, stop_token_ids=stops,
                        layout_invariant_sampling=True)  # fmt: skip
    seen = []
    original = kernel.decode_attention

    def spy(*a, prefix=None, **k):
        if prefix is not None:
            lead, plen = prefix
            seen.append(int(((lead != torch.arange(len(lead))) & (plen > 0)).sum()))
        return original(*a, prefix=prefix, **k)

    monkeypatch.setattr(kernel, "decode_attention", spy)
    runs = {}
    for sharing in (True, False):
        engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=slots, prompt_kv_sharing=sharing))
        runs[sharing] = (engine.generate(prompts, sp), engine.last_stats)
    (shared, stats), (plain, _) = runs[True], runs[False]
    assert [c.response_ids for c in shared] == [c.response_ids for c in plain]
    assert all(torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs)) for a, b in zip(shared, plain))
    assert len({len(c.response_ids) for c in shared}) >= 4 and max(seen) >= 2  # members read their lead
    assert stats.compactions > 0 if compact else stats.compactions == 0


def test_batch_buckets_cover_the_live_rows_with_few_graphs():
    """``batch_bucket``: never fewer rows than are live nor more than the slots; powers of two without
    ``fine``; with it multiples of 32 above 32 at 512 slots (21 graphs at most, 10 before), of 64 at 1024."""
    from megatron_rl.rollout.engine import batch_bucket

    for slots, fine, step in (
        (512, False, None),
        (512, True, 32),
        (421, True, 32),
        (1024, True, 64),
        (7, True, 32),
    ):
        got = [batch_bucket(b, slots, fine) for b in range(1, slots + 1)]
        assert all(b <= g <= slots for b, g in zip(range(1, slots + 1), got))
        assert got == sorted(got)  # a shrinking batch never gets a larger bucket
        for g in set(got) - {slots}:
            assert (g & (g - 1)) == 0 or (step is not None and g > step and g % step == 0), (slots, g)
        if step is not None and slots > step:
            assert (
                batch_bucket(step + 1, slots, fine) == 2 * step
                and batch_bucket(3 * step - 1, slots, fine) == 3 * step
            )
    assert len({batch_bucket(b, 512, True) for b in range(1, 513)}) == 6 + 15
    assert len({batch_bucket(b, 512, False) for b in range(1, 513)}) == 10
    assert batch_bucket(300, 512, False) == 512 and batch_bucket(300, 512, True) == 320


def test_logits_into_a_shared_buffer_equal_the_plain_ones(model):
    """``decoder.logits(out=...)`` writes the first B rows of one [slots, Vp] buffer (the decode graphs' shared
    logits) and returns the same values as the plain GEMM, as a view of that buffer."""
    from megatron_rl.rollout import reshard

    _, spec, params = model
    w = reshard.gather_weights(params, spec, reshard.build_layout(1))
    h = torch.randn(5, spec.hidden_size, dtype=w.output.dtype)
    buf = torch.full((8, w.output.shape[0]), float("nan"), dtype=w.output.dtype)
    got = decoder.logits(h, w, spec, out=buf)
    assert torch.equal(got, decoder.logits(h, w, spec))
    assert got.data_ptr() == buf.data_ptr() and torch.isnan(buf[5:]).all()


def _stop_workload(top_k: int = -1):
    """The tiny qwen2 model, 9 prompts, their 20 greedy HF tokens, stop ids that end five of them early
    (at 2-17 tokens), and greedy / sampled (n=3, layout-invariant, ``top_k``) sampling to 20 tokens."""
    hf = tiny_hf("qwen2")
    spec = spec_of(hf)
    prompts = random_prompts(9, seed=7)
    full = [hf_greedy(hf, p, 20) for p in prompts]
    stop = tuple({full[0][1], full[2][4], full[5][8], full[7][13], full[3][16]})
    greedy = SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=stop)
    sampled = SamplingParams(temperature=1.0, n=3, max_new_tokens=20, seed=3, stop_token_ids=stop, top_k=top_k,
                             layout_invariant_sampling=True)  # fmt: skip
    return hf, spec, hf_to_mcore(hf, spec, 1, 0, 1, 0), prompts, full, stop, greedy, sampled


@pytest.mark.parametrize("fine", [False, True])
def test_fine_batch_buckets_and_one_logits_buffer_leave_tokens_and_logprobs_unchanged(monkeypatch, fine):
    """The GPU path on CPU: every decode step runs its bucket's rows (idle slots padding it, as a replayed graph
    does) and writes its logits into the state's one buffer. With keep_cache, from the second call on (the
    weights stayed where they were: the graphs of the first call stay valid), the finer ladder (step 2 here):
    non-power-of-two buckets, fewer rows than powers of two for the same steps. Greedy tokens equal HF's,
    log-probs the run without buckets, and sampled layout-invariant tokens the run without buckets too."""
    from megatron_rl.rollout import engine as engine_mod

    monkeypatch.setattr(engine_mod, "_SYNC_EVERY", 2)
    hf, spec, params, prompts, full, stop, greedy, sampled = _stop_workload()
    plain = {sp.n: RolloutEngine(params, spec, EngineConfig(max_num_seqs=27)).generate(prompts, sp)
             for sp in (greedy, sampled)}  # fmt: skip

    seen, pow2 = [], []
    init = engine_mod._DecodeState.__init__

    def init_graphs(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.use_graphs = True  # the GPU path's buckets; ``decode`` below runs them eagerly

    def decode(self, b, kv_need):
        rows = self.bucket(b)
        seen.append(rows)
        pow2.append(engine_mod.batch_bucket(b, self.cache.plan.slots, False))
        out = self._eager(rows, self.cache.plan.max_len, self._logits_out())
        assert out.data_ptr() == self.logits_buf.data_ptr()
        return out

    monkeypatch.setattr(engine_mod, "_FINE_STEP_MIN", 2)
    monkeypatch.setattr(engine_mod._DecodeState, "__init__", init_graphs)
    monkeypatch.setattr(engine_mod._DecodeState, "decode", decode)
    for sp in (greedy, sampled):
        # the finer ladder comes with keep_cache (graphs captured once per run) and stable weights
        engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=27, keep_cache=fine))
        seen.clear()
        engine.generate(prompts, sp)  # the first call: powers of two
        assert not {r for r in seen if r & (r - 1) and r != engine.last_stats.slots}
        seen.clear()
        pow2.clear()
        out = engine.generate(prompts, sp)
        assert [c.response_ids for c in out] == [c.response_ids for c in plain[sp.n]]
        for a, b in zip(out, plain[sp.n]):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
        assert engine.last_stats.compactions > 0 or not (fine or sp.n == 1)
        odd = {r for r in seen if r & (r - 1) and r != engine.last_stats.slots}  # the cap may be any number
        assert bool(odd) == fine, sorted(set(seen))
        assert (sum(seen) < sum(pow2)) == fine and sum(seen) <= sum(pow2)
        if sp.n == 1:
            for c, ref in zip(out, full):
                cut = next((i + 1 for i, t in enumerate(ref) if t in stop), len(ref))
                assert c.response_ids == ref[:cut]
    assert len({len(c.response_ids) for c in out}) >= 3


def test_sync_statistics_count_the_host_syncs(monkeypatch):
    """``GenerationStats.syncs`` / ``sync_host_s``: every retire counts once and adds the host time after its read
    of the device state, compaction included (what a GPU idles through); 20 steps at a sync every 4 take at
    least 5 syncs, and a compaction made 20 ms slower adds 20 ms a sync."""
    import time

    from megatron_rl.rollout import engine as engine_mod

    hf = tiny_hf("qwen2")
    spec = spec_of(hf)
    params = hf_to_mcore(hf, spec, 1, 0, 1, 0)
    monkeypatch.setattr(engine_mod, "_SYNC_EVERY", 4)
    monkeypatch.setattr(engine_mod, "ASYNC_RETIRE", False)  # every retire reads the device (and counts)
    sp = SamplingParams(temperature=0, max_new_tokens=20)
    stats = []
    for delay in (0.0, 0.02):
        compact = engine_mod._Runner._compact

        def slow(self, compact=compact, delay=delay):
            time.sleep(delay)
            compact(self)

        monkeypatch.setattr(engine_mod._Runner, "_compact", slow)
        engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=4))
        engine.generate(random_prompts(4, seed=2), sp)
        stats.append(engine.last_stats)
        monkeypatch.setattr(engine_mod._Runner, "_compact", compact)
    fast, slowed = stats
    assert fast.syncs == slowed.syncs >= 5 and 0 < fast.sync_host_s < fast.decode_s
    # each sleep lies inside a counted stretch: at least 20 ms a sync (a bound the fast run's own noise, e.g.
    # other processes on the CPU, cannot break, as a difference of the two could)
    assert slowed.sync_host_s >= 0.02 * slowed.syncs and slowed.sync_host_s > fast.sync_host_s


@pytest.mark.parametrize("slots,sync_every,top_k", [(27, 3, -1), (7, 5, -1), (18, 1, 5)])
def test_async_retire_gives_the_same_completions_as_syncing_retires(monkeypatch, slots, sync_every, top_k):
    """``MEGATRON_RL_ASYNC_RETIRE``: retires read a snapshot of the device state taken ``_AHEAD`` steps
    earlier while those steps run. Through stop tokens, compaction (27, 18 slots), continuous batching with
    waiting sequences (7 slots) and prompt sharing, greedy tokens equal HF's and every completion (tokens,
    finish reasons) equals the syncing engine's, log-probs (and top-k's truncated ones) to 1e-5; most
    retires did not wait for the device (blocking ones remain near the cap)."""
    from megatron_rl.rollout import engine as engine_mod

    monkeypatch.setattr(engine_mod, "_SYNC_EVERY", sync_every)
    hf, spec, params, prompts, full, stop, greedy, sampled = _stop_workload(top_k)
    for sp in (greedy, sampled):
        runs = {}
        for on in (False, True):
            monkeypatch.setattr(engine_mod, "ASYNC_RETIRE", on)
            engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=slots))
            runs[on] = (engine.generate(prompts, sp), engine.last_stats)
        (out, stats), (want, plain) = runs[True], runs[False]
        assert [(c.response_ids, c.finish_reason) for c in out] == [
            (c.response_ids, c.finish_reason) for c in want
        ]
        for a, b in zip(
            out, want
        ):  # compaction at other steps: other batch shapes, last-bit matmul differences
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
            for c in (
                a,
                b,
            ):  # arrays from the snapshot's retire (a) and the syncing one (b): the lists' values
                assert c.arrays[0].tolist() == c.response_ids and c.arrays[1].tolist() == c.logprobs
            assert (
                len(a.truncated_logprobs)
                == len(b.truncated_logprobs)
                == (len(a.logprobs) if sp.top_k > 0 else 0)
            )
            assert torch.allclose(
                torch.tensor(a.truncated_logprobs), torch.tensor(b.truncated_logprobs), atol=1e-5
            )
        assert len({len(c.response_ids) for c in out}) >= 3 and {c.finish_reason for c in out} == {
            "stop",
            "length",
        }
        assert plain.async_retires == 0 and stats.async_retires > 0 and stats.new_tokens == plain.new_tokens
        # blocking: near the cap (20 tokens here), and with fewer slots than sequences where the cap is hit
        # at every admission wave; with every sequence admitted at once they are fewer
        assert stats.syncs < plain.syncs if slots > len(prompts) * sp.n // 2 else stats.syncs <= plain.syncs
        if sp.n == 1:
            for c, ref in zip(out, full):
                cut = next((i + 1 for i, t in enumerate(ref) if t in stop), len(ref))
                assert c.response_ids == ref[:cut]
    # a snapshot larger than the bound (long responses) keeps the syncing retire
    monkeypatch.setattr(engine_mod, "_SNAPSHOT_MAX_CELLS", 8)
    engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=slots))
    engine.generate(prompts, greedy)
    assert engine.last_stats.async_retires == 0 and engine.last_stats.syncs > 0
