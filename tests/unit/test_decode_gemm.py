"""The decode-step GEMMs with fused neighbours (``kernels.decode_gemm``) against the ops they replace:
F.linear then SwiGLU, F.linear then add + RMSNorm. Run under Triton's interpreter on CPU."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.kernels import compile as compile_trials
from megatron_rl.kernels import decode_fused, decode_gemm

pytestmark = pytest.mark.skipif(not decode_gemm.HAVE_TRITON, reason="triton is part of torch's CUDA builds")


def _data(rows, k, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g).to(dtype), (torch.randn(n, k, generator=g) / k**0.5).to(dtype)


@pytest.mark.parametrize("rows,bn,bk", [(1, 64, 64), (5, 32, 64), (19, 64, 32), (70, 32, 64)])
def test_swiglu_gemm_equals_linear_then_swiglu(rows, bn, bk):
    # K 80 is not a multiple of the K tile, F 72 not of the column tile, rows past one 64-row tile at 70
    x, w = _data(rows, 80, 2 * 72)
    got = decode_gemm.swiglu_gemm(x, w, bn=bn, bk=bk)
    want = decode_fused.swiglu_reference(F.linear(x, w))
    assert got.shape == (rows, 72)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the up half matters: swapping the halves changes the result
    swapped = torch.cat((w[72:], w[:72]))
    assert not torch.allclose(decode_gemm.swiglu_gemm(x, swapped, bn=bn, bk=bk), want, atol=1e-3)


def test_swiglu_gemm_half_rounds_each_half_as_the_gemm_output():
    # fp16: Triton's interpreter gets tl.dot on bf16 wrong (numpy has no bf16); the GPU runs bf16 after a
    # trial against these references (``decode_gemm.usable``)
    x, w = _data(9, 64, 2 * 64, torch.float16, seed=1)
    got = decode_gemm.swiglu_gemm(x, w, bn=32, bk=32)
    want = decode_fused.swiglu_reference(F.linear(x.float(), w.float()).half())  # the GEMM output rounded
    assert got.dtype == torch.float16
    # each half rounded to fp16 before SwiGLU, as the unfused path: without that rounding it differs by ~2e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("splits", [1, 3, 4, 9])
def test_splitk_partials_sum_to_the_product(splits):
    # K 200 in 64-wide tiles: with 9 splits the later slices are past K and must write zeros
    x, w = _data(6, 200, 48, seed=2)
    parts = decode_gemm.splitk_gemm(x, w, splits, bn=32, bk=64)
    assert parts.shape == (splits, 6, 48) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), x @ w.t(), rtol=1e-5, atol=1e-5)
    if splits == 9:
        assert torch.all(parts[4:] == 0) and not torch.all(parts[:4] == 0)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_cublas_splitk_partials_are_the_k_slices_products(splits):
    x, w = _data(6, 200, 48, torch.float16, seed=5)
    parts = decode_gemm.partials(x, w, {"splits": splits, "cublas": 1})
    assert parts.shape == (splits, 6, 48) and parts.dtype == torch.float32
    k = 200 // splits
    for i in range(splits):  # slice i of K against float64: not another slice's terms
        want = x[:, i * k : (i + 1) * k].double() @ w[:, i * k : (i + 1) * k].double().t()
        torch.testing.assert_close(parts[i].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.sum(0).double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="splits 3 does not divide K = 200"):
        decode_gemm.partials(x, w, {"splits": 3, "cublas": 1})


def test_cublas_splitk_on_a_gpu_tensor_asks_bmm_for_fp32_out():
    """The branch the GPU takes (``bmm(..., out_dtype=float32)`` on bf16 slices), on the meta device: its shapes,
    dtype and the slices' layouts as cuBLAS gets them."""
    x, w = (
        torch.empty(6, 200, dtype=torch.bfloat16, device="meta"),
        torch.empty(48, 200, dtype=torch.bfloat16, device="meta"),
    )
    parts = decode_gemm.splitk_cublas(x, w, 4)
    assert parts.shape == (4, 6, 48) and parts.dtype == torch.float32 and parts.device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_parts_equals_linear_then_add_rms_norm(dtype):
    x, w = _data(7, 96, 40, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    resid = torch.randn(7, 40, generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(40, generator=g)).to(dtype)
    parts = decode_gemm.splitk_gemm(x, w, 3, bn=32, bk=32)
    got_x, got_h = decode_gemm.add_rms_norm_parts(resid, parts, norm_w, 1e-6)
    y = F.linear(x.float(), w.float()).to(dtype)  # the GEMM's output, rounded once
    want_x, want_h = decode_fused.add_rms_norm_reference(resid, y, norm_w, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-6  # fp16: the sum rounded as the GEMM's output, then the add
    torch.testing.assert_close(got_x.float(), want_x.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_h.float(), want_h.float(), rtol=tol, atol=tol)
    assert got_x.dtype == dtype and got_h.dtype == dtype


def _parts(**parts):
    return {"device": "any", "parts": {k: {"weight": w, "rows": r} for k, (w, r) in parts.items()}}


def test_table_parsing_and_row_lookup(tmp_path, monkeypatch):
    good = _parts(
        fc1=([96, 64], {"32": {"bn": 64, "bk": 64}, "128": None}),
        fc2=(None, {"64": {"bn": 32, "bk": 64, "splits": 4}}),
    )
    path = tmp_path / "table.json"
    path.write_text(json.dumps(good))
    monkeypatch.setenv(decode_gemm.TABLE_ENV, str(path))
    monkeypatch.setattr(decode_gemm, "_LOADED", [])
    monkeypatch.setattr(decode_gemm, "_FROM_ENV", [])
    monkeypatch.setattr(decode_gemm, "_UNMATCHED", set())
    ok = {"bn": 64, "bk": 64}
    assert decode_gemm.setting("fc1", 32, (96, 64)) == {"bn": 64, "bk": 64}
    with pytest.warns(
        UserWarning, match=r"fc1 entries were measured at weights \[\(96, 64\)\], not \(96, 128\)"
    ):
        assert decode_gemm.setting("fc1", 32, (96, 128)) is None  # measured at another weight shape: cuBLAS
    assert decode_gemm.setting("fc1", 32, (96, 128)) is None  # told once
    # the built-in table: another model's shape keeps cuBLAS without a warning
    assert decode_gemm._FROM_ENV == [True]
    builtin = {"fc2": [{"weight": (7, 9), "rows": {64: {"splits": 2, "cublas": 1}}}]}
    monkeypatch.setattr(decode_gemm, "_LOADED", [builtin])
    monkeypatch.setattr(decode_gemm, "_FROM_ENV", [])  # as table() leaves it without the variable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode_gemm.setting("fc2", 32, (7, 10)) is None
    assert decode_gemm.setting("fc2", 32, (7, 9)) == {"splits": 2, "cublas": 1}
    monkeypatch.setattr(
        decode_gemm, "_LOADED", [decode_gemm.parse_table(good, "F")]
    )  # the file's table again
    monkeypatch.setattr(decode_gemm, "_FROM_ENV", [True])
    assert decode_gemm.setting("fc1", 33, (96, 64)) is None  # the 128-row entry says cuBLAS
    assert decode_gemm.setting("fc1", 129, (96, 64)) is None and decode_gemm.setting("proj", 8) is None
    assert decode_gemm.setting("fc2", 64, (7, 9)) == {"bn": 32, "bk": 64, "splits": 4}  # any weight
    # a list: one entry per weight shape (two model sizes, or TP degrees), else the shapeless entry
    entries = [{"weight": [8, 4], "rows": {"16": {"bn": 16, "bk": 16}}}, {"weight": None, "rows": {"16": ok}}]
    two = decode_gemm.parse_table({"device": "x", "parts": {"qkv": entries}}, "F")
    monkeypatch.setattr(decode_gemm, "_LOADED", [two])
    assert decode_gemm.setting("qkv", 9, (8, 4)) == {"bn": 16, "bk": 16}
    assert decode_gemm.setting("qkv", 9, (8, 8)) == ok
    for bad, words in [
        ({"fc1": {}}, "expected"),
        (_parts(fc3=(None, {})), "part 'fc3' is not one of"),
        (_parts(fc1=([1, 2, 3], {})), r"weight \[1, 2, 3\] is not \[N, K\]"),
        (_parts(fc1=(None, {"x": None})), "'x' is not a positive integer"),
        (_parts(fc1=(None, {"\u00b2": None})), "is not a positive integer"),
        (_parts(fc1=(None, {"8": {"bn": 48, "bk": 64}})), "powers of two >= 16"),
        (_parts(fc1=(None, {"8": {"bn": 64}})), "bn and bk are required"),
        (_parts(fc1=(None, {"8": {**ok, "num_warps": True}})), "positive integer"),
        (_parts(fc1=(None, {"8": {**ok, "num_warps": 3}})), "num_warps must be"),
        (
            _parts(fc1=(None, {"8": {**ok, "splits": 2}})),
            "splits is required for fc2 / proj and taken by them only",
        ),
        (_parts(qkv=(None, {"8": {**ok, "splits": 2}})), "taken by them only"),
        (_parts(fc2=(None, {"8": ok})), "splits is required"),
        (_parts(fc1=(None, {"8": {"cublas": 1}})), '"cublas": 1 is for fc2 / proj only'),
        (_parts(qkv=(None, {"8": {"cublas": 1, "splits": 2}})), '"cublas": 1 is for fc2 / proj only'),
        (
            _parts(fc2=([896, 4864], {"8": {"cublas": 1, "splits": 3}})),
            "splits 3 does not divide the weight's K = 4864",
        ),
        (_parts(fc2=(None, {"8": {"cublas": 1, "splits": 2, "bn": 32}})), "no other key"),
        (_parts(proj=(None, {"8": {"cublas": 2, "splits": 2}})), '"cublas": 1 is for'),
        (_parts(proj=(None, {"8": {**ok, "splits": 2, "evil": "os.system"}})), "keys among"),
        ({"parts": {"fc1": [{"weight": [1, 2], "rows": {}}, {"weight": [1, 2], "rows": {}}]}}, "two entries"),
    ]:
        with pytest.raises(ValueError, match=words) as e:
            decode_gemm.parse_table(bad, "FILE")
        assert "FILE" in str(e.value)


@pytest.mark.parametrize(
    "text,words",
    [
        ("{not json", "JSONDecodeError"),
        ('{"parts": {}, "parts": {}}', "a key repeats"),
        (None, "No such file"),
    ],
)
def test_a_table_file_that_cannot_be_read_names_the_variable(tmp_path, monkeypatch, text, words):
    path = tmp_path / "table.json"
    if text is not None:
        path.write_text(text)
    monkeypatch.setenv(decode_gemm.TABLE_ENV, str(path))
    monkeypatch.setattr(decode_gemm, "_LOADED", [])
    monkeypatch.setattr(decode_gemm, "_FROM_ENV", [])
    with pytest.raises(ValueError, match=words) as e:
        decode_gemm.table()
    assert f"{decode_gemm.TABLE_ENV}={path}" in str(e.value)
    # the engine reads it when it is built, before any generation
    from megatron_rl.rollout.engine import RolloutEngine

    with pytest.raises(ValueError, match=decode_gemm.TABLE_ENV):
        RolloutEngine({}, None)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_engine_with_the_fused_decode_gemms_equals_hf(monkeypatch, arch):
    """The decode step with ``decode_gemm``'s kernels for every part at every row count (interpreted on CPU):
    they run (qkv + RoPE not with qwen3's qk-norm between them), passed their trials, greedy equals HF token
    for token and sampled log-probs equal the HF forward."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "workers"))
    from rollout_common import hf_greedy, hf_logprobs, hf_to_mcore, random_prompts, spec_of, tiny_hf

    from megatron_rl.rollout.engine import EngineConfig, RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    hf = tiny_hf(arch)
    spec = spec_of(hf)
    params = hf_to_mcore(hf, spec, 1, 0, 1, 0)
    monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)
    table = {
        "qkv": [{"weight": None, "rows": {64: {"bn": 16, "bk": 16}}}],
        "fc1": [
            {"weight": None, "rows": {2: {"bn": 32, "bk": 32}, 64: {"bn": 16, "bk": 16, "num_stages": 2}}}
        ],
        "fc2": [
            {"weight": None, "rows": {64: {"splits": 2, "cublas": 1}}}
        ],  # cuBLAS's partials (CPU: fp32 bmm)
        "proj": [{"weight": None, "rows": {64: {"bn": 32, "bk": 16, "splits": 2}}}],
    }
    monkeypatch.setattr(decode_gemm, "_LOADED", [table])
    monkeypatch.setattr(compile_trials, "_PROBED", set())  # the trials of this test's kernels run here
    monkeypatch.setattr(compile_trials, "_FAILED", {})
    calls = []
    for name in ("qkv_rope", "swiglu_gemm", "splitk_gemm", "splitk_cublas", "add_rms_norm_parts"):
        original = getattr(decode_gemm, name)
        monkeypatch.setattr(
            decode_gemm, name, lambda *a, _n=name, _f=original, **k: calls.append(_n) or _f(*a, **k)
        )
    prompts = random_prompts(3, seed=6)
    engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=3))
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=5))
    assert set(calls) == {"swiglu_gemm", "splitk_gemm", "splitk_cublas", "add_rms_norm_parts"} | (
        {"qkv_rope"} if arch == "qwen2" else set()
    )
    assert not compile_trials._FAILED and any("decode GEMM" in k for k in compile_trials._PROBED)
    assert [c.response_ids for c in out] == [hf_greedy(hf, p, 5) for p in prompts]
    for c in engine.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=5, seed=1)):
        assert (
            torch.tensor(c.logprobs) - hf_logprobs(hf, c.prompt_ids, c.response_ids, 0.9)
        ).abs().max() < 1e-5


def test_a_setting_that_fails_its_trial_warns_once_and_cublas_serves(monkeypatch):
    monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)
    monkeypatch.setattr(
        decode_gemm, "_LOADED", [{"fc1": [{"weight": None, "rows": {8: {"bn": 32, "bk": 32}}}]}]
    )
    monkeypatch.setattr(compile_trials, "_PROBED", set())  # the trials of this test's kernels run here
    monkeypatch.setattr(compile_trials, "_FAILED", {})
    monkeypatch.setattr(
        decode_gemm, "swiglu_gemm", lambda x, w, **s: torch.zeros(x.shape[0], w.shape[0] // 2)
    )
    x, w = _data(4, 32, 64)
    with pytest.warns(UserWarning, match="fc1 .* failed its trial at 4 rows; cuBLAS"):
        assert decode_gemm.usable("fc1", x, w) is None
    assert decode_gemm.usable("fc1", x, w) is None  # remembered: no second trial, no second warning
    assert decode_gemm.usable("fc1", torch.zeros(9, 32), w) is None  # past the table: cuBLAS, no trial
    assert len(compile_trials._FAILED) == 1 and "decode GEMM fc1" in next(iter(compile_trials._FAILED))


def test_a_cublas_split_that_does_not_divide_k_fails_its_trial_by_name(monkeypatch):
    """A table entry without a weight shape cannot be checked when it is read: the trial refuses it, naming the
    split and K, and cuBLAS's whole-K GEMM serves."""
    monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)
    monkeypatch.setattr(
        decode_gemm, "_LOADED", [{"fc2": [{"weight": None, "rows": {8: {"splits": 3, "cublas": 1}}}]}]
    )
    monkeypatch.setattr(compile_trials, "_PROBED", set())
    monkeypatch.setattr(compile_trials, "_FAILED", {})
    x, w = _data(4, 64, 16)
    with pytest.warns(UserWarning, match="fc2 .* failed its trial at 4 rows; cuBLAS"):
        assert decode_gemm.usable("fc2", x, w) is None
    assert "splits 3 does not divide K = 64" in str(next(iter(compile_trials._FAILED.values())))


def _rope_inputs(rows, groups, rep, dim, dtype, seed, bias=True, t=12):
    g = torch.Generator().manual_seed(seed)
    hidden = 48
    x, w = _data(rows, hidden, groups * (rep + 2) * dim, dtype, seed)
    b = torch.randn(groups * (rep + 2) * dim, generator=g).to(dtype) if bias else None
    pos = torch.randint(0, t, (rows,), generator=g)
    angles = torch.rand(rows, dim // 2, generator=g) * 6
    sign = torch.cat((-torch.ones(dim // 2), torch.ones(dim // 2)))
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = (torch.cat((angles, angles), -1).sin() * sign).to(dtype)
    caches = [torch.randn(rows, groups, t, dim, generator=g).to(dtype) for _ in range(2)]
    return x, w, b, cos, sin, pos, caches


@pytest.mark.parametrize(
    "rows,groups,rep,dim,bn,dtype,bias",
    [(1, 2, 3, 32, 32, torch.float32, True), (5, 1, 2, 32, 16, torch.float32, False),
     (70, 2, 1, 64, 16, torch.float32, True), (9, 2, 3, 32, 32, torch.float16, True)],
)  # fmt: skip
def test_qkv_rope_equals_linear_then_rope_kv_write(rows, groups, rep, dim, bn, dtype, bias):
    x, w, b, cos, sin, pos, (kc, vc) = _rope_inputs(rows, groups, rep, dim, dtype, rows, bias)
    ref_k, ref_v = kc.clone(), vc.clone()
    qkv = F.linear(x.float(), w.float(), None if b is None else b.float()).to(
        dtype
    )  # the GEMM's output, rounded
    want = decode_fused.rope_kv_write_reference(
        qkv.view(rows, groups, rep + 2, dim), cos, sin, pos, ref_k, ref_v
    )
    got = decode_gemm.qkv_rope(x, w, b, cos, sin, pos, kc, vc, rep, dim, bn=bn, bk=16)
    tol = 1e-5 if dtype == torch.float32 else 1e-6  # fp16: the GEMM's output rounded before the rotation
    torch.testing.assert_close(got, want, rtol=0 if tol < 1e-5 else tol, atol=tol)
    torch.testing.assert_close(kc, ref_k, rtol=tol, atol=tol)
    torch.testing.assert_close(vc, ref_v, rtol=tol, atol=tol)
    assert not torch.equal(
        kc, _rope_inputs(rows, groups, rep, dim, dtype, rows, bias)[-1][0]
    )  # k was written
