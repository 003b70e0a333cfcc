"""Batch invariance of ``kernels.batch_invariant``: a row's output is the same bits whatever the batch size
and the row's place in it, on the torch reference path and on the Triton path (Triton's interpreter on
CPU); decode attention for query t equals the training attention's row t; every op is close to the plain
torch op."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.kernels import batch_invariant as bi

TRITON = pytest.mark.skipif(not bi.tri.HAVE_TRITON, reason="triton is in the dev extras")
PATHS = ["reference", pytest.param("triton", marks=TRITON)]
# Triton's interpreter computes bf16 tl.dot wrongly: bf16 runs on the reference path here (and on the GPU)
PATH_DTYPES = [("reference", torch.float32), ("reference", torch.bfloat16),
               pytest.param("triton", torch.float32, marks=TRITON)]  # fmt: skip


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setattr(bi, "RUN_ON_CPU", request.param == "triton")
    return request.param


def _use(monkeypatch, path):
    monkeypatch.setattr(bi, "RUN_ON_CPU", path == "triton")


def _each_batch(op, pool: torch.Tensor, sizes, check_rows=(0, 3)):
    """For every batch size n, rows ``check_rows`` of ``pool`` placed at the front, in the middle and at
    the back of a batch of n rows (the others random rows of ``pool``): op's row must equal the full-pool
    result bit for bit."""
    full = op(pool)
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        for i in check_rows:
            for place in {0, n // 2, n - 1}:
                idx = torch.randint(0, pool.shape[0], (n,), generator=gen)
                idx[place] = i
                out = op(pool[idx])
                assert torch.equal(out[place], full[i]), (n, i, place)


@pytest.mark.parametrize("path,dtype", PATH_DTYPES)
def test_matmul_rows_do_not_depend_on_the_batch(monkeypatch, path, dtype):
    _use(monkeypatch, path)
    torch.manual_seed(0)
    sizes = [1, 2, 9] if path == "reference" else [1, 130]  # 130: rows in two Triton tiles
    pool = torch.randn(140 if path == "triton" else 12, 72).to(dtype)  # K=72: a partial K block
    w, b = torch.randn(40, 72).to(dtype), torch.randn(40).to(dtype)
    _each_batch(lambda x: bi.matmul(x, w, b), pool, sizes)
    got = bi.matmul(pool[:8], w, b).float()
    want = torch.nn.functional.linear(pool[:8].double(), w.double(), b.double()).float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_do_not_depend_on_the_batch(path, dtype):
    torch.manual_seed(0)
    pool, w = torch.randn(20, 96).to(dtype), torch.rand(96).to(dtype) + 0.5
    _each_batch(lambda x: bi.rms_norm(x, w, 1e-6), pool, [1, 2, 7, 20])
    want = torch.nn.functional.rms_norm(pool.float(), (96,), w.float(), 1e-6)
    torch.testing.assert_close(bi.rms_norm(pool, w, 1e-6).float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_is_the_add_then_rms_norm_bit_for_bit(path, dtype, monkeypatch):
    """The exact decode step's residual add + RMSNorm (one kernel on the Triton path, after its trial): the
    sum rounded as the eager add, and the norm the bits of ``rms_norm`` of it (which the trainer runs)."""
    monkeypatch.setattr(bi, "_ADD_NORM", {})
    launches = []
    original = bi.tri.add_rms_norm
    monkeypatch.setattr(bi.tri, "add_rms_norm", lambda *a: launches.append(a[0].shape) or original(*a))
    g = torch.Generator().manual_seed(4)
    x, y = ((3 * torch.randn(9, 1, 96, generator=g)).to(dtype) for _ in range(2))
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    s, out = bi.add_rms_norm(x, y, w, 1e-6)
    assert s.shape == out.shape == x.shape
    assert torch.equal(s, x + y) and torch.equal(out, bi.rms_norm(x + y, w, 1e-6))
    if path == "triton":  # the trial (37 rows) and the call (9): the fused kernel served
        assert list(bi._ADD_NORM.values()) == [True] and [r[0] for r in launches] == [37, 9]
    else:
        assert launches == [] and not bi._ADD_NORM


@pytest.mark.skipif(not bi.tri.HAVE_TRITON, reason="triton is in the dev extras")
def test_a_fused_add_rms_norm_that_fails_its_trial_warns_and_the_two_ops_serve(monkeypatch):
    """A fused add + RMSNorm whose trial does not give the unfused bits (forced) is reported once and never
    serves at that device, dtype and width: the add and ``rms_norm`` apart are returned."""
    monkeypatch.setattr(bi, "RUN_ON_CPU", True)
    monkeypatch.setattr(bi, "_ADD_NORM", {})
    original = bi.tri.add_rms_norm
    launches = []

    def off_by_one(*a):
        launches.append(a[0].shape[0])
        s, out = original(*a)
        return s, out + 1

    monkeypatch.setattr(bi.tri, "add_rms_norm", off_by_one)
    x, y, w = torch.randn(5, 1, 32), torch.randn(5, 1, 32), torch.rand(32) + 0.5
    with pytest.warns(UserWarning, match="fused add \\+ RMSNorm did not give the unfused bits"):
        s, out = bi.add_rms_norm(x, y, w, 1e-6)
    assert torch.equal(s, x + y) and torch.equal(out, bi.rms_norm(x + y, w, 1e-6))
    assert list(bi._ADD_NORM.values()) == [False] and launches == [37]
    bi.add_rms_norm(x, y, w, 1e-6)
    assert launches == [37]  # no second trial, no fused launch


def test_log_softmax_rows_do_not_depend_on_the_batch(path):
    torch.manual_seed(0)
    vocab, valid = 2100, 2050  # three vocab blocks, padding columns excluded
    pool = torch.randn(6, vocab) * 4
    tokens = torch.randint(0, valid, (6,))
    _each_batch(lambda x: bi.token_logprobs(x[:, :vocab], x[:, vocab].long(), 0.7, valid),
                torch.cat((pool, tokens[:, None].float()), 1), [1, 6])  # fmt: skip
    want = torch.log_softmax(pool[:, :valid].double() / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(
        bi.token_logprobs(pool, tokens, 0.7, valid).double(), want, rtol=1e-5, atol=1e-5
    )
    # the engine's logits are the true vocab only: same bits as the padded training logits
    assert torch.equal(
        bi.token_logprobs(pool[:, :valid], tokens, 0.7), bi.token_logprobs(pool, tokens, 0.7, valid)
    )


@TRITON
def test_exact_decode_attention_reads_each_prompt_from_its_lead_slot(monkeypatch):
    """``prefix`` (rollout.prompt_kv_sharing) in the exact kernel: keys before plen from the lead slot; with
    the members' prompt copies replaced by noise the output is the intact unshared one, bit for bit."""
    _use(monkeypatch, "triton")
    g = torch.Generator().manual_seed(3)
    b, groups, rep, dim, t = 5, 2, 3, 16, 90
    cache = torch.randn(2, b, groups, t, dim, generator=g)
    lead, plen = torch.tensor([0, 0, 2, 2, 4]), torch.tensor([70, 70, 40, 40, 0])
    for slot in range(b):
        cache[:, slot, :, : plen[slot]] = cache[:, lead[slot], :, : plen[slot]]
    q = torch.randn(b, groups, rep, dim, generator=g)
    pos = torch.tensor([69, 85, 39, 64, 20])
    want = bi.decode_attention(q, cache[0], cache[1], pos, dim**-0.5)
    assert torch.equal(bi.decode_attention(q, cache[0], cache[1], pos, dim**-0.5, (lead, plen)), want)
    noisy = cache.clone()
    for slot in (1, 3):
        noisy[:, slot, :, : plen[slot]] = torch.randn(2, groups, int(plen[slot]), dim, generator=g)
    assert torch.equal(bi.decode_attention(q, noisy[0], noisy[1], pos, dim**-0.5, (lead, plen)), want)
    assert not torch.equal(bi.decode_attention(q, noisy[0], noisy[1], pos, dim**-0.5), want)


@pytest.mark.parametrize("path,dtype", PATH_DTYPES)
def test_decode_attention_equals_training_attention_row(monkeypatch, path, dtype):
    """Training attention over whole sequences (several batch sizes, GQA) against decode attention of one
    query at position t over a longer cache buffer, with the sequence in different slots of the batch."""
    _use(monkeypatch, path)
    torch.manual_seed(0)
    heads, groups, dim, t_len = 4, 2, 16, 66  # 66 keys: two key blocks, the second partial
    rep = heads // groups
    q = torch.randn(3, heads, t_len, dim).to(dtype)
    k, v = (torch.randn(3, groups, t_len, dim).to(dtype) for _ in range(2))
    train = bi.causal_attention(q, k, v, dim**-0.5)  # [3, H, T, D]
    single = bi.causal_attention(q[1:2], k[1:2], v[1:2], dim**-0.5)
    assert torch.equal(single[0], train[1])
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(train.float(), want, rtol=tol, atol=tol)
    cache_k, cache_v = (torch.randn(4, groups, 96, dim).to(dtype) for _ in range(2))  # 4 slots, Tmax 96
    for slot, seq in ((0, 1), (3, 2)):
        cache_k[slot, :, :t_len], cache_v[slot, :, :t_len] = k[seq], v[seq]
        for t in (5, 64, t_len - 1):
            positions = torch.full((4,), t)
            qd = torch.randn(4, groups, rep, dim).to(dtype)
            qd[slot] = q[seq, :, t].view(groups, rep, dim)
            out = bi.decode_attention(qd, cache_k, cache_v, positions, dim**-0.5)  # [4, G, rep, D]
            if path == "reference":
                assert torch.equal(out[slot].reshape(heads, dim), train[seq, :, t]), (slot, t)
            else:  # numpy under Triton's interpreter rounds a tile row by its place (see the README)
                torch.testing.assert_close(out[slot].reshape(heads, dim), train[seq, :, t], rtol=0, atol=1e-6)


def test_tree_sum_is_a_fixed_pairwise_order():
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0, 0.5]])
    # ((1e8 + 1) + (-1e8 + 1)) + ((0.5 + 0) + 0): each 1e8 + 1 rounds back to 1e8 in fp32
    assert bi.tree_sum(x).item() == 0.5


@pytest.mark.parametrize("path,dtype", PATH_DTYPES)
def test_packed_and_shared_prompt_attention_equal_the_unpacked_rows(monkeypatch, path, dtype):
    """THD rows (``packed_attention``): one prompt of 70 tokens (a partial second key block) stored once and
    three responses of 5, 66 and 1 tokens whose keys are the prompt's then their own, and, without
    ``kv_index``, two whole sequences back to back: every row equals that token's row of the unpacked
    sequence through ``causal_attention`` (GQA, bit for bit on the reference path)."""
    _use(monkeypatch, path)
    torch.manual_seed(1)
    heads, groups, dim, p_len, r_lens = 4, 2, 16, 70, (5, 66, 1)

    def qkv(n):
        return torch.randn(n, heads, dim).to(dtype), *(
            torch.randn(n, groups, dim).to(dtype) for _ in range(2)
        )

    def unpacked(q, k, v):  # [T, H, D], [T, G, D] x2 -> [T, H, D]
        return bi.causal_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   dim**-0.5)[0].transpose(0, 1)  # fmt: skip

    def same(got, want):
        if path == "reference":
            assert torch.equal(got, want)
        else:  # numpy under Triton's interpreter rounds a tile row by its place (see the README)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    prompt, resps = qkv(p_len), [qkv(r) for r in r_lens]
    q, k, v = (torch.cat([prompt[i], *(r[i] for r in resps)]) for i in range(3))  # [S, *, D]
    cu_q = torch.tensor([0, p_len, *(p_len + s for s in torch.tensor(r_lens).cumsum(0).tolist())])
    kv_index, starts = [torch.arange(p_len)], p_len
    for r in r_lens:
        kv_index += [torch.arange(p_len), torch.arange(starts, starts + r)]
        starts += r
    kv_index = torch.cat(kv_index)
    cu_k = torch.tensor(
        [0, p_len, *(p_len * (i + 2) + s for i, s in enumerate(torch.tensor(r_lens).cumsum(0).tolist()))]
    )
    out = bi.packed_attention(q, k, v, cu_q, dim**-0.5, kv_index=kv_index, cu_k=cu_k)
    for i, r in enumerate(resps):
        want = unpacked(*(torch.cat([prompt[j], r[j]]) for j in range(3)))  # [P + R, H, D]
        same(out[:p_len], want[:p_len])
        same(out[cu_q[i + 1] : cu_q[i + 2]], want[p_len:])
    a, b = qkv(30), qkv(67)
    q, k, v = (torch.cat([a[i], b[i]]) for i in range(3))
    out = bi.packed_attention(q, k, v, torch.tensor([0, 30, 97]), dim**-0.5)
    same(out[:30], unpacked(*a))
    same(out[30:], unpacked(*b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ordered_sum_adds_tp_partials_in_rank_order_whatever_the_row_count(dtype):
    """Row-parallel partials [P] x [M, N]: the fp32 sum in rank order rounded once to the dtype, each row
    the same bits whether reduced alone or among others. What it rules out gives other bits: in fp32
    another order, in bf16 a rounding after every add (a bf16 all-reduce)."""
    torch.manual_seed(0)
    parts = [(torch.randn(9, 40) * 10 ** torch.randn(9, 40)).to(dtype) for _ in range(4)]
    got = bi.ordered_sum(parts, dtype)
    want = (((parts[0].float() + parts[1].float()) + parts[2].float()) + parts[3].float()).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    for rows in (slice(0, 1), slice(3, 7), slice(8, 9)):
        assert torch.equal(bi.ordered_sum([p[rows] for p in parts], dtype), got[rows])
    if dtype == torch.float32:
        other = ((parts[3] + parts[1]) + parts[2]) + parts[0]
    else:
        other = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert not torch.equal(other, got)


def test_log_softmax_split_at_tp_shards_equals_the_shards_combined(path):
    """``token_logprobs(row, shard=W)`` (the engine's gathered row) == the trainer's per-shard pieces:
    the max of the shard maxes, each shard's exp-sum in its own blocks, the sums added in rank order;
    the padded vocab's last shards hold 64 real columns and none. Batch-invariant and close to float64."""
    torch.manual_seed(0)
    width, tp, vocab = 600, 4, 1864  # padded vocab 2400: shard 3 is padding only, shard 2 part padding
    padded = torch.randn(16, width * tp) * 4
    tokens = torch.randint(0, vocab, (16,))
    got = bi.token_logprobs(padded[:, :vocab], tokens, 0.7, shard=width)
    shards = [padded[:, r * width : (r + 1) * width] for r in range(tp)]
    valid = [min(max(vocab - r * width, 0), width) for r in range(tp)]
    zmax = torch.stack([bi.shard_max(s, 0.7, v) for s, v in zip(shards, valid)]).amax(0)
    sums = torch.stack([bi.shard_exp_sum(s, 0.7, v, zmax) for s, v in zip(shards, valid)])  # [tp, N]
    picked = padded.gather(-1, tokens[:, None])[:, 0] / 0.7
    assert torch.equal(got, picked - zmax - bi.combine_exp_sums(sums))
    # the split matters: the whole row's blocks sum the same exps in another order
    whole = bi.shard_exp_sum(padded[:, :vocab], 0.7, vocab, zmax)
    assert not torch.equal(bi.ordered_sum(list(sums), torch.float32), whole)
    want = torch.log_softmax(padded[:, :vocab].double() / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    _each_batch(lambda x: bi.token_logprobs(x[:, :vocab], x[:, -1].long(), 0.7, shard=width),
                torch.cat((padded, tokens[:, None].float()), 1), [1, 5])  # fmt: skip


@TRITON
def test_matmul_with_another_tile_config_is_batch_invariant_too(monkeypatch):
    """``tri.matmul(..., config)`` (what benchmarks/bench_exact_matmul.py sweeps on the GPU, where it
    checks each tile's bit-exact batch invariance): another tile computes the same product (close to
    float64; under Triton's interpreter numpy rounds a tile row by its place, so rows are compared to
    1e-5 here); the bench's layer shapes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_exact_matmul import linear_shapes

    _use(monkeypatch, "triton")
    torch.manual_seed(0)
    pool, w = torch.randn(40, 72), torch.randn(24, 72)  # K=72: a partial K block
    cfg = (16, 16, 32, 4, 1)
    full = bi.tri.matmul(pool, w, None, cfg)
    torch.testing.assert_close(bi.tri.matmul(pool[5:22], w, None, cfg), full[5:22], rtol=0, atol=1e-5)
    want = pool.double() @ w.double().t()
    torch.testing.assert_close(bi.tri.matmul(pool, w, None, cfg).double(), want, rtol=1e-5, atol=1e-4)
    assert linear_shapes("qwen2.5-0.5b") == {"qkv": (1152, 896), "proj": (896, 896), "fc1": (9728, 896),
                                              "fc2": (896, 4864), "lm_head": (151936, 896)}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fixed_rows_matmul_rows_do_not_depend_on_the_call(dtype, bias):
    """Library GEMM calls of one fixed row count: any row is the same bits alone, inside a part-filled
    call and at a shifted position across calls (the trial passes), and the product is the matmul."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype) if bias else None
    x = torch.randn(300, 24, generator=g).to(dtype)
    assert bi.fixed_rows_invariant(w, b, rows=64)
    full = bi.fixed_rows_matmul(x, w, b, rows=64)
    assert full.shape == (300, 40) and full.dtype == dtype
    assert torch.equal(bi.fixed_rows_matmul(x[130:131], w, b, rows=64)[0], full[130])
    assert torch.equal(bi.fixed_rows_matmul(x[3:200], w, b, rows=64), full[3:200])
    want = x.float() @ w.float().t() + (b.float() if bias else 0)
    tol = 1e-5 if dtype == torch.float32 else 0.1
    assert torch.allclose(full.float(), want, atol=tol, rtol=tol)


def _separate_calls(x, w, b, rows=64):
    """The calls one by one, the tail padded: what a batched call must equal."""
    pad = torch.nn.functional.pad(x, (0, 0, 0, -len(x) % rows))
    parts = [c @ w.t() if b is None else torch.addmm(b, c, w.t()) for c in pad.split(rows)]
    return torch.cat(parts)[: len(x)]


def test_fixed_rows_whole_calls_run_batched_only_after_trials_gave_the_separate_calls_bits(monkeypatch):
    """An input of several whole calls (a training micro-batch): the first BATCHED_TRIALS_NEEDED inputs
    of each call count run one strided-batched call, then the separate calls compared with it, and return
    theirs; where all matched (the CPU's BLAS here), later inputs of that count take the batched call
    alone and give the separate calls' bits; a batched call that differed (forced here) leaves that count
    on the separate calls, its wrong rows never returned."""
    monkeypatch.setattr(bi, "_BATCHED", {})
    monkeypatch.setattr(bi, "_BATCHED_TRIALS", {})
    assert bi.BATCHED_TRIALS_NEEDED == 2
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    launches = []
    original = bi._batched_gemm
    monkeypatch.setattr(bi, "_batched_gemm", lambda *a: launches.append(a[-1]) or original(*a))
    x = torch.empty(3 * 64 + 5, 24, dtype=torch.bfloat16)  # one buffer: one address (alignment) class
    for trial in (1, 2):
        x.copy_(torch.randn(x.shape, generator=g))
        assert torch.equal(bi.fixed_rows_matmul(x, w, rows=64), _separate_calls(x, w, None))
        assert launches == [3] * trial and list(bi._BATCHED_TRIALS.values()) == [[trial, 0]]
        assert list(bi._BATCHED.values()) == ([] if trial == 1 else [True])  # serves after the second
    x.copy_(torch.randn(x.shape, generator=g))
    assert torch.equal(bi.fixed_rows_matmul(x, w, rows=64), _separate_calls(x, w, None))
    assert launches == [3, 3, 3] and list(bi._BATCHED_TRIALS.values()) == [[2, 0]]  # served, no trial
    assert torch.equal(bi.fixed_rows_matmul(x[:64], w, rows=64), _separate_calls(x[:64], w, None))
    assert launches == [3, 3, 3]  # one whole call: nothing to batch
    x4 = torch.randn(4 * 64, 24, generator=g).to(torch.bfloat16)
    assert torch.equal(bi.fixed_rows_matmul(x4, w, rows=64), _separate_calls(x4, w, None))  # agreed once
    monkeypatch.setattr(
        bi, "_batched_gemm", lambda *a: launches.append(-a[-1]) or original(*a) or a[2].add_(1)
    )
    x4.copy_(x4.flip(0))  # the second trial differs: the trial's (wrong) result is not what it returns
    assert torch.equal(bi.fixed_rows_matmul(x4, w, rows=64), _separate_calls(x4, w, None))
    assert launches[-2:] == [4, -4] and [v for k, v in bi._BATCHED.items() if k[-2] == 4] == [False]
    x4.copy_(x4.flip(1))
    assert torch.equal(bi.fixed_rows_matmul(x4, w, rows=64), _separate_calls(x4, w, None))
    assert launches.count(-4) == 1  # no third try: the separate calls served

    def raising(*a):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(bi, "_batched_gemm", raising)
    x5 = torch.randn(5 * 64, 24, generator=g).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="one batched GEMM of 5 x 64 rows failed"):
        assert torch.equal(bi.fixed_rows_matmul(x5, w, rows=64), _separate_calls(x5, w, None))
    assert [v for k, v in bi._BATCHED.items() if k[-2] == 5] == [False]
    assert torch.equal(bi.fixed_rows_matmul(x5, w, rows=64), _separate_calls(x5, w, None))  # no second try


def test_fixed_rows_weight_with_bias_runs_batched_only_where_enabled_and_as_its_trials_decide(monkeypatch):
    """A weight with a bias (qkv) takes the separate addmm calls off CUDA (here) in every batching mode;
    where batching a bias is enabled (forced onto the CPU here) its batched call is the fp32-result bmm
    plus the bias rounded once, tried like any other: until its trials agreed fixed_rows_matmul returns the
    separate calls' bits, after they agreed the batched call's (which the CPU's BLAS may round otherwise
    than its addmm: the trials gate it, as on CUDA), after one differed the separate calls' again (fp32
    inputs are never batched with a bias)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    b = torch.randn(40, generator=g).to(torch.bfloat16)
    launches = []
    original = bi._batched_gemm
    monkeypatch.setattr(bi, "_batched_gemm", lambda *a: launches.append(a[-1]) or original(*a))
    assert bi.BIAS_BATCHED_ON == ("cuda",)
    for mode in bi.EXACT_BATCHED_CHOICES:
        monkeypatch.setattr(bi, "EXACT_BATCHED", mode)
        monkeypatch.setattr(bi, "_BATCHED", {})
        for calls in (2, 3, 2, 2, 3):
            x = torch.randn(calls * 64 + 7, 24, generator=g).to(torch.bfloat16)
            assert torch.equal(bi.fixed_rows_matmul(x, w, b, rows=64), _separate_calls(x, w, b))
        assert not bi._BATCHED
    assert launches == []
    monkeypatch.setattr(bi, "BIAS_BATCHED_ON", ("cpu",))
    monkeypatch.setattr(bi, "EXACT_BATCHED", "trial")
    monkeypatch.setattr(bi, "_BATCHED", {})
    monkeypatch.setattr(bi, "_BATCHED_TRIALS", {})
    x = torch.empty(3 * 64 + 7, 24, dtype=torch.bfloat16)  # one buffer: one address (alignment) class
    for _ in range(8):
        x.copy_(torch.randn(x.shape, generator=g))
        serves = list(bi._BATCHED.values()) == [True]  # decided by the trials of the inputs before
        separate = _separate_calls(x, w, b)
        batched = separate.clone()  # the tail (7 rows) runs as its own addmm either way
        original(x[: 3 * 64], w.t(), batched[: 3 * 64], b, 3)
        want = batched if serves else separate
        assert torch.equal(bi.fixed_rows_matmul(x, w, b, rows=64), want)
    assert launches and set(launches) == {3} and len(bi._BATCHED_TRIALS) == 1
    ((agreed, differed),) = bi._BATCHED_TRIALS.values()
    assert agreed + differed <= bi.BATCHED_TRIALS_NEEDED and list(bi._BATCHED.values()) == [differed == 0]
    x = torch.randn(2 * 64, 24, generator=g)
    assert torch.equal(
        bi.fixed_rows_matmul(x, w.float(), b.float(), rows=64), _separate_calls(x, w.float(), b.float())
    )
    assert set(launches) == {3}  # fp32 with a bias: the separate calls


def test_batched_gemm_with_a_bias_rounds_the_fp32_sum_once():
    """The batched call of a weight with a bias: each row is fp32(x @ w^T) + fp32(bias), rounded once to
    bf16, i.e. within half a bf16 ulp of the exact value, and never the double rounding of a bf16 product
    plus a bf16 bias (checked here to differ on this input)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2 * 64, 24, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    b = (torch.randn(40, generator=g) * 100).to(torch.bfloat16)
    out = torch.empty(len(x), 40, dtype=torch.bfloat16)
    bi._batched_gemm(x, w.t(), out, b, 2)
    exact = x.double() @ w.double().t() + b.double()
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-30).all()
    twice = (x @ w.t()).float().add(b.float()).to(torch.bfloat16)
    assert not torch.equal(twice, out)
