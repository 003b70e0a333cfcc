"""``rollout.exact_logprobs`` end to end in one process (TP=1, CPU, torch reference kernels; TP=2 and TP=4
under torchrun: ``tests/distributed/test_exact_logprobs_dist.py``): the engine's continuous-batched rollout
log-probs equal the trainer's recompute bit for bit (forward-only and the update's forward with backward),
the mismatch metric reads 0 with the mode on and not with it off, and the exact model's logits are as close
to transformers as the default model's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "workers"))
from rollout_common import random_prompts, spec_of, tiny_hf  # noqa: E402

from megatron_rl.algos.rollout_correction import rollout_gap_metrics  # noqa: E402
from megatron_rl.config.schema import ActorConfig  # noqa: E402
from megatron_rl.distributed.runtime import destroy_distributed, init_distributed  # noqa: E402
from megatron_rl.kernels import batch_invariant as bi  # noqa: E402
from megatron_rl.models.builder import build_model  # noqa: E402
from megatron_rl.models.pipeline import run_micro_batches  # noqa: E402
from megatron_rl.models.weights import load_hf_weights  # noqa: E402
from megatron_rl.rollout.batch import build_batch  # noqa: E402
from megatron_rl.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402
from megatron_rl.rollout.sampling import SamplingParams  # noqa: E402
from megatron_rl.trainer.workers import PolicyWorker, response_log_probs  # noqa: E402

T, R = 0.8, 8  # sampling temperature, max new tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    init_distributed(1, 1, seed=0)
    hf = tiny_hf("qwen2")  # qkv bias, tied embeddings
    out = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(out, safe_serialization=True)
    args = spec_of(hf)
    models = {}
    for exact in (True, False):
        for dtype in (torch.float32, torch.bfloat16):
            model = build_model(args, "actor", dtype, backend="local", exact=exact)
            load_hf_weights(model, out, args)
            models[exact, dtype] = model.to(dtype)
    yield hf, args, models
    destroy_distributed()


def _rollout(model, args, exact: bool, prompts: int = 5, uneven: int = 3):
    prompts = random_prompts(prompts, seed=3)
    cfg = EngineConfig(max_num_seqs=3, max_prefill_tokens=40, exact_logprobs=exact)
    stops = tuple(range(100, 130))  # ~9% of the vocabulary: responses end at uneven lengths
    sp = SamplingParams(
        temperature=T, top_k=40, top_p=0.9, n=2, max_new_tokens=R, seed=5, stop_token_ids=stops
    )
    done = RolloutEngine(model, args, cfg).generate(prompts, sp)  # 10 sequences through 3 slots
    assert len({len(c.response_ids) for c in done}) >= uneven, [len(c.response_ids) for c in done]
    return build_batch(done, [None] * len(prompts), 0, R, 0, torch.device("cpu"))


def _worker(model, args, exact, **layout):
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=2, **layout)
    return PolicyWorker(
        model, cfg, T, args.vocab_size, 1, R, trainable=False, exact=exact, truncation=(40, 0.9)
    )


def _check_and_clear_grads(model) -> None:
    """Every parameter got a finite gradient, some non-zero; then they are cleared for the next test."""
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(
        g.abs().sum() > 0 for g in grads
    )
    model.zero_grad(set_to_none=True)


def _update_forward_log_probs(model, args, batch) -> torch.Tensor:
    """The exact log-probs of the update's forward (train mode, with backward); checks and clears the
    gradients it leaves."""
    model.train()

    def loss_fn(mb, logits):
        lp, _ = response_log_probs(logits, mb, T, args.vocab_size, with_entropy=False, exact=True)
        return (lp * mb.response_mask).sum(), {"lp": lp.detach()}

    out = run_micro_batches(model, [batch], loss_fn, forward_only=False, response_logits=True)[0]
    model.eval()
    _check_and_clear_grads(model)
    return out["lp"]


@pytest.mark.parametrize("exact", [True, False])
def test_rollout_logprobs_equal_the_training_recompute_exactly(setup, exact):
    """Forward-only recompute in micro-batches of 2, then (exact) the update's forward of the whole batch in
    train mode with backward, whose log-probs GRPO on-policy reads as the old ones; the top-k/top-p
    renormalised log-prob of each sampled token likewise."""
    _, args, models = setup
    model = models[exact, torch.float32]
    batch = _rollout(model, args, exact)
    mask = batch.response_mask.bool()
    worker = _worker(model, args, exact)
    recomputed = worker.log_probs(batch)  # [B, R]
    gap = rollout_gap_metrics(batch.rollout_log_probs, recomputed, batch.response_mask)
    model.train(exact)

    def loss_fn(mb, logits):
        lp, _ = response_log_probs(logits, mb, T, args.vocab_size, with_entropy=True, exact=exact)
        return (lp * mb.response_mask).sum(), {"lp": lp.detach(), **worker.truncated_gap(logits, mb)}

    out = run_micro_batches(model, [batch], loss_fn, forward_only=not exact, response_logits=True)[0]
    model.eval()
    if not exact:  # fp32 on CPU: close, not equal (what the metrics are for)
        assert gap["rollout_logprob_abs_diff"] < 1e-5 and gap["rollout_logprob_mismatch_frac"] > 0
        assert out["rollout_truncated_logprob_abs_diff"] < 1e-5
        assert out["rollout_truncated_logprob_mismatch_frac"] > 0
        return
    assert torch.equal(batch.rollout_log_probs[mask], recomputed[mask])
    assert gap["rollout_logprob_mismatch_frac"] == 0 and gap["rollout_logprob_abs_diff"] == 0
    assert torch.equal(out["lp"][mask], batch.rollout_log_probs[mask])
    assert out["rollout_truncated_logprob_mismatch_frac"] == 0
    # renormalised over the kept tokens: strictly above the full-softmax log-prob where anything was cut
    assert (batch.rollout_truncated_log_probs[mask] >= batch.rollout_log_probs[mask]).all()
    assert (batch.rollout_truncated_log_probs[mask] > batch.rollout_log_probs[mask]).any()
    _check_and_clear_grads(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fixed_rows_library_gemm_keeps_rollout_and_training_logprobs_equal(setup, dtype, monkeypatch):
    """The CUDA default for the exact matmul (the BLAS in calls of a fixed row count, each weight after
    its invariance trial), here on the CPU's BLAS: it serves every linear layer and the LM head, and the
    rollout's log-probs still equal the recompute and the update's forward bit for bit."""
    _, args, models = setup
    monkeypatch.setattr(bi, "FIXED_ROWS_ON_CPU", True)
    monkeypatch.setattr(bi, "_FIXED_ROWS", {})
    model = models[True, dtype]
    batch = _rollout(model, args, True)
    mask = batch.response_mask.bool()
    recomputed = _worker(model, args, True).log_probs(batch)
    served = bi._FIXED_ROWS
    assert len(served) >= 5 and all(served.values()), served  # qkv, proj, fc1, fc2, LM head
    assert torch.equal(batch.rollout_log_probs[mask], recomputed[mask])
    assert torch.equal(_update_forward_log_probs(model, args, batch)[mask], batch.rollout_log_probs[mask])


def test_the_fused_exact_rope_kernel_keeps_rollout_and_training_logprobs_equal(setup, monkeypatch):
    """The exact decode step with its fused RoPE + KV-write kernel (on by default on CUDA; interpreted
    here, bf16): the kernel runs and the rollout's log-probs still equal the trainer's recompute."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import decode_fused

    _, args, models = setup
    monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)
    calls = []
    original = decode_fused.rope_kv_write
    monkeypatch.setattr(
        decode_fused, "rope_kv_write", lambda *a, **k: calls.append(k.get("exact")) or original(*a, **k)
    )
    model = models[True, torch.bfloat16]
    batch = _rollout(model, args, True)
    mask = batch.response_mask.bool()
    assert calls and all(calls)  # the exact variant, every decode step
    assert torch.equal(batch.rollout_log_probs[mask], _worker(model, args, True).log_probs(batch)[mask])


def test_the_exact_swiglu_kernel_on_both_sides_keeps_rollout_and_recompute_equal(setup, monkeypatch):
    """The exact SwiGLU through the Triton kernel (interpreted; the CUDA path) in the engine's prefill and
    decode steps and in every layer of the trainer's exact MLP (``ExactSwiGLU``): log-probs equal bit for
    bit (bf16), recomputed from padded and from shared-prompt rows."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import decode_fused

    _, args, models = setup
    monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)
    calls = []
    original = decode_fused.swiglu
    monkeypatch.setattr(decode_fused, "swiglu", lambda y: calls.append(y.shape[0]) or original(y))
    model = models[True, torch.bfloat16]
    batch = _rollout(model, args, True)
    mask = batch.response_mask.bool()
    assert len(calls) >= args.num_layers * R  # every layer of every decode step (and the prefills)
    for layout in ({}, {"share_prompts": True}):
        calls.clear()
        recomputed = _worker(model, args, True, **layout).log_probs(batch)
        assert calls and len(calls) % args.num_layers == 0, (
            layout
        )  # the trainer's MLPs: each layer, micro-batch
        assert torch.equal(recomputed[mask], batch.rollout_log_probs[mask]), layout


def test_the_fused_add_norm_of_the_exact_decode_step_changes_no_bit(setup, monkeypatch):
    """The exact ops on their Triton path (interpreted; the CUDA path; fp32: the interpreter's bf16 dot is
    wrong): the engine's decode steps with each residual add fused with the RMSNorm after it
    (``batch_invariant.add_rms_norm``, what the GPU runs) give the same tokens and log-probs bit for bit as
    with the add and the norm apart (what the trainer runs)."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    _, args, models = setup
    monkeypatch.setattr(bi, "RUN_ON_CPU", True)
    monkeypatch.setattr(bi, "_ADD_NORM", {})
    calls = []
    original = bi.tri.add_rms_norm
    monkeypatch.setattr(bi.tri, "add_rms_norm", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    model = models[True, torch.float32]
    fused = _rollout(model, args, True, prompts=2, uneven=1)  # 4 sequences through 3 slots
    assert list(bi._ADD_NORM.values()) == [True]
    assert len(calls) >= 2 * args.num_layers * (R - 1)  # two per layer of every decode step
    calls.clear()
    monkeypatch.setattr(bi, "_add_norm_tried", lambda *a: False)
    apart = _rollout(model, args, True, prompts=2, uneven=1)
    assert calls == []
    assert torch.equal(fused.input_ids, apart.input_ids)
    assert torch.equal(fused.rollout_log_probs, apart.rollout_log_probs)


@pytest.mark.parametrize("layout", [{}, {"share_prompts": True}], ids=["padded", "shared"])
def test_the_training_exact_rope_kernel_keeps_rollout_and_recompute_equal(setup, monkeypatch, layout):
    """The trainer's RoPE in exact mode through its Triton kernel (``kernels.rope_exact``, interpreted; the
    CUDA path), on padded rows and on shared-prompt packed rows (one THD segment): it serves q and k of
    every layer and the recompute still equals the rollout's log-probs bit for bit (bf16)."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import rope_exact

    _, args, models = setup
    monkeypatch.setattr(rope_exact, "RUN_ON_CPU", True)
    monkeypatch.setattr(rope_exact, "_TRIED", {})
    calls = []
    original = rope_exact._ExactRope.apply
    monkeypatch.setattr(rope_exact._ExactRope, "apply", lambda *a: calls.append(a[0].dim()) or original(*a))
    model = models[True, torch.bfloat16]
    batch = _rollout(model, args, True)
    mask = batch.response_mask.bool()
    calls.clear()
    worker = _worker(model, args, True, **layout)
    recomputed = worker.log_probs(batch)
    assert all(rope_exact._TRIED.values()), rope_exact._TRIED
    assert len(calls) >= 2 * args.num_layers
    assert torch.equal(recomputed[mask], batch.rollout_log_probs[mask])


def test_fixed_rows_calls_batched_in_training_keep_rollout_and_training_logprobs_equal(setup, monkeypatch):
    """The fixed-rows GEMM at 8 rows a call (the CPU's BLAS), so that the prefill and the trainer's
    micro-batches are several whole calls run as one batched call once it gave the separate calls' bits,
    and the decode steps (3 slots) single calls: the log-probs still equal bit for bit (bf16), recompute
    and the update's forward."""
    _, args, models = setup
    monkeypatch.setattr(bi, "FIXED_ROWS_ON_CPU", True)
    monkeypatch.setattr(bi, "GEMM_ROWS", 8)
    monkeypatch.setattr(bi, "_FIXED_ROWS", {})
    monkeypatch.setattr(bi, "_BATCHED", {})
    monkeypatch.setattr(bi, "_BATCHED_TRIALS", {})
    batched = []
    original = bi._batched_gemm
    monkeypatch.setattr(bi, "_batched_gemm", lambda *a: batched.append(a[-1]) or original(*a))
    model = models[True, torch.bfloat16]
    batch = _rollout(model, args, True)
    mask = batch.response_mask.bool()
    recomputed = _worker(model, args, True).log_probs(batch)
    assert all(bi._FIXED_ROWS.values()) and bi._BATCHED and all(bi._BATCHED.values()), bi._BATCHED
    assert len(batched) > len(bi._BATCHED)  # served batched beyond the trials
    assert torch.equal(batch.rollout_log_probs[mask], recomputed[mask])
    assert torch.equal(_update_forward_log_probs(model, args, batch)[mask], batch.rollout_log_probs[mask])


def test_a_fixed_rows_trial_that_fails_keeps_that_weight_on_the_other_path(monkeypatch):
    """A weight whose trial fails is reported once and served by the Triton / reference matmul, whose
    result is then what ``matmul`` returns (the same for every row count)."""
    monkeypatch.setattr(bi, "FIXED_ROWS_ON_CPU", True)
    monkeypatch.setattr(bi, "_FIXED_ROWS", {})
    monkeypatch.setattr(bi, "fixed_rows_invariant", lambda w, bias=None: False)
    w, x = torch.randn(24, 16), torch.randn(7, 16)
    with pytest.warns(UserWarning, match="was not batch-invariant for a weight of shape"):
        got = bi.matmul(x, w)
    assert torch.equal(got, bi.matmul_reference(x, w))
    assert list(bi._FIXED_ROWS.values()) == [False]
    assert torch.equal(bi.matmul(x[2:3], w)[0], got[2])


def test_a_weight_off_a_256_byte_boundary_is_served_from_an_aligned_copy(monkeypatch):
    """The library may pick its kernel by operand alignment: a weight view off a 256-byte boundary (a flat
    buffer) goes to the fixed-rows GEMM as an aligned copy, so it runs the trial's kernel (one trial for
    both) and gives the aligned weight's bits."""
    monkeypatch.setattr(bi, "FIXED_ROWS_ON_CPU", True)
    monkeypatch.setattr(bi, "_FIXED_ROWS", {})
    tried = []
    original = bi.fixed_rows_invariant
    monkeypatch.setattr(
        bi, "fixed_rows_invariant", lambda w, bias=None: tried.append(bi._alignment(w)) or original(w, bias)
    )
    served = []
    original_mm = bi.fixed_rows_matmul
    monkeypatch.setattr(
        bi,
        "fixed_rows_matmul",
        lambda x, w, *a, **k: served.append(bi._alignment(w)) or original_mm(x, w, *a, **k),
    )
    w = torch.randn(24, 16, dtype=torch.bfloat16)

    def at(offset):  # a copy of w at ``offset`` elements past a 256-byte boundary
        flat = torch.empty(w.numel() + 256, dtype=torch.bfloat16)
        start = (-flat.data_ptr() % 256) // 2 + offset
        return flat[start : start + w.numel()].view(24, 16).copy_(w)

    aligned, odd = at(0), at(1)
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    assert torch.equal(bi.matmul(x, odd), bi.matmul(x, aligned))
    assert tried == [256] and set(served) == {256}  # one trial, every call on a 256-byte aligned weight


@pytest.mark.parametrize(
    "layout",
    [{"share_prompts": True}, {"pack_sequences": True, "share_prompts": False}],
    ids=["shared", "packed"],
)
def test_packed_and_shared_prompt_micro_batches_recompute_the_rollout_logprobs_exactly(setup, layout):
    """Micro-batches of one GRPO group each (n=2): each prompt once with both responses as segments
    (``share_prompts``), or the two sequences packed back to back (``pack_sequences``): the forward-only
    recompute and the update's forward (train mode, with backward) give the engine's log-probs bit for
    bit, as the padded rows do; the backward (the plain packed kernels) gives finite gradients."""
    _, args, models = setup
    model = models[True, torch.float32]
    batch = _rollout(model, args, True)
    mask = batch.response_mask.bool()
    worker = _worker(model, args, True, **layout)
    mbs, _ = worker._split(batch)
    assert all(mb.packed is not None for mb in mbs)
    if layout.get("share_prompts"):
        assert all(mb.packed.shared for mb in mbs)
    recomputed = worker.log_probs(batch)
    assert torch.equal(recomputed[mask], batch.rollout_log_probs[mask])
    model.train()

    def loss_fn(mb, logits):
        lp, _ = response_log_probs(logits, mb, T, args.vocab_size, with_entropy=False, exact=True)
        return (lp * mb.response_mask).sum(), {"lp": lp.detach()}

    outs = run_micro_batches(model, mbs, loss_fn, forward_only=False, response_logits=True)
    model.eval()
    start = 0  # fixed-size micro-batches keep the batch order
    for mb, out in zip(mbs, outs):
        m = mb.response_mask.bool()
        want = batch.rollout_log_probs[start : start + len(mb), : m.shape[1]]
        assert torch.equal(out["lp"][m], want[m])
        start += len(mb)
    assert start == len(batch)
    _check_and_clear_grads(model)


@pytest.mark.parametrize(
    "dtype,layout",
    [(torch.bfloat16, {"share_prompts": True, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 400}),
     (torch.float32, {"pack_sequences": True, "share_prompts": False, "ppo_micro_batch_size_per_gpu": 3})],
    ids=["bf16-shared-dynamic", "fp32-packed-fixed"],
)  # fmt: skip
def test_exact_packed_rows_across_key_blocks(setup, dtype, layout):
    """Prompts of 66-100 tokens and responses up to 80 (key segments over two 64-key blocks), n=3: shared
    prompts split by a token budget (bf16) and packed fixed micro-batches (fp32) recompute the engine's
    exact log-probs bit for bit."""
    _, args, models = setup
    model = models[True, dtype]
    prompts = [(p * 4)[: max(len(p), 70)] for p in random_prompts(4, seed=11, max_len=100)]
    assert min(map(len, prompts)) > 64
    cfg = EngineConfig(max_num_seqs=3, max_prefill_tokens=400, exact_logprobs=True)
    sp = SamplingParams(temperature=T, n=3, max_new_tokens=80, seed=5, stop_token_ids=(100,))
    batch = build_batch(
        RolloutEngine(model, args, cfg).generate(prompts, sp), [None] * 4, 0, 80, 0, torch.device("cpu")
    )
    mask = batch.response_mask.bool()
    worker = PolicyWorker(
        model, ActorConfig(**layout), T, args.vocab_size, 1, 80, trainable=False, exact=True
    )
    assert all(mb.packed is not None for mb in worker._split(batch)[0])
    assert torch.equal(worker.log_probs(batch)[mask], batch.rollout_log_probs[mask])


def test_exact_logits_are_as_close_to_transformers_as_the_default(setup):
    """A normal forward: bf16 logits of the exact model vs transformers in fp32 (mean |error| over every
    position and vocab entry), no worse than the default bf16 model's; fp32 within 1e-5."""
    hf, _, models = setup
    ids = torch.tensor(random_prompts(4, seed=9, max_len=24)[0] * 3)[None, :64]  # [1, T]
    with torch.no_grad():
        want = hf(ids).logits[0].double()  # [T, V]
        pos = torch.arange(ids.shape[1])[None]

        def err(exact, dtype):
            got = models[exact, dtype](ids, pos, attention_mask=None)[0, :, : want.shape[-1]]
            return (got.double() - want).abs().mean().item()

        assert err(True, torch.float32) < 1e-6
        assert err(True, torch.bfloat16) <= 1.1 * err(False, torch.bfloat16)


def test_exact_logprobs_takes_any_tp_with_the_rollout_tp_equal_to_the_training_tp():
    """TP>1 is allowed when the engine holds the trainer's shards (rollout TP unset or equal); a different
    rollout TP and sequence parallelism are refused, naming the keys (the TP=2 and TP=4 proof:
    ``tests/distributed/test_exact_logprobs_dist.py``)."""
    from megatron_rl.config import ConfigError, JobConfig, validate_job

    cfg = JobConfig()
    cfg.rollout.exact_logprobs = True
    assert validate_job(cfg, world_size=1, num_layers=2).tp == 1
    cfg.parallel.tensor_model_parallel_size = 2
    assert validate_job(cfg, world_size=2, num_layers=2).tp == 2
    cfg.rollout.tensor_model_parallel_size = 2
    assert validate_job(cfg, world_size=2, num_layers=2).tp == 2
    cfg.rollout.tensor_model_parallel_size = 1
    with pytest.raises(
        ConfigError,
        match=r"incompatible with rollout\.tensor_model_parallel_size=1 != parallel\.tensor_model_parallel_size=2",
    ):
        validate_job(cfg, world_size=2, num_layers=2)
    cfg.rollout.tensor_model_parallel_size = None
    cfg.parallel.sequence_parallel = True
    with pytest.raises(ConfigError, match=r"incompatible with parallel\.sequence_parallel=true"):
        validate_job(cfg, world_size=2, num_layers=2)


@pytest.mark.parametrize(
    "key,value",
    [
        ("actor.lora.rank", 4),
        ("rollout.multi_turn.enable", True),
    ],
    ids=["lora", "multi_turn"],
)
def test_exact_logprobs_refuses_lora_and_multi_turn_naming_the_key(key, value):
    """The exact layers carry no LoRA side path and a later turn's prefill (decoder.extend) is not
    batch-invariant: both are refused at start-up, naming the key."""
    from megatron_rl.config import ConfigError, JobConfig, validate_job

    cfg = JobConfig()
    cfg.rollout.exact_logprobs = True
    section, name = key.rsplit(".", 1)
    obj = cfg
    for part in section.split("."):
        obj = getattr(obj, part)
    setattr(obj, name, value)
    with pytest.raises(ConfigError, match="incompatible with " + re.escape(key) + "="):
        validate_job(cfg, world_size=1, num_layers=2)


def test_an_unknown_exact_gemm_choice_is_refused_at_start_up(monkeypatch):
    from megatron_rl.config import ConfigError, JobConfig, validate_job

    cfg = JobConfig()
    cfg.rollout.exact_logprobs = True
    monkeypatch.setenv("MEGATRON_RL_EXACT_GEMM", "cublas")
    with pytest.raises(ConfigError, match="MEGATRON_RL_EXACT_GEMM='cublas'.*fixed_rows.*triton"):
        validate_job(cfg, world_size=1, num_layers=2)
