"""kernels/logprob.py (run by Triton's interpreter on CPU) against the eager passes of algos.vocab_parallel:
the row statistics over several blocks and vocab splits, their combination over parts of a row (as over TP
shards), and the fused log-prob / entropy function's values and gradients with the kernels on and off."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is in the dev extras")

from megatron_rl.algos import vocab_parallel as vp  # noqa: E402
from megatron_rl.kernels import logprob as kernel  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    from megatron_rl.kernels import compile as kc

    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kc, "_FAILED", {})
    monkeypatch.setenv("MEGATRON_RL_COMPILE", "0")  # the other path: the eager passes


def _reference_stats(x, temperature, valid):
    z = x[:, :valid].double() / temperature
    m = z.amax(-1)
    e = (z - m[:, None]).exp()
    return m, e.sum(-1), (e * (z - m[:, None])).sum(-1)


@pytest.mark.parametrize(
    "rows,width,valid,block,splits",
    [(3, 1000, 1000, 64, None), (5, 777, 700, 128, None), (1, 300, 300, 32, None), (4, 1000, 990, 64, 1),
     (2, 1000, 1000, 32, 4)],
)  # fmt: skip
def test_row_stats_over_blocks_and_splits_equal_the_softmax_sums(
    monkeypatch, rows, width, valid, block, splits
):
    """Rows split over several programs (splits_for's choice, or forced: one program looping over 16 blocks,
    four over 8 each, so the running max moves inside a program), a ragged last block and padding columns
    (>= valid) left out; rows of rising and falling logits move the max at every block or never. Both passes:
    one exp per element (the block's max as every lane's base) and two (a running max per lane); temperature 1
    skips the division."""
    torch.manual_seed(rows)
    x = 5 * torch.randn(rows, width)
    x[0] = torch.linspace(-20, 20, width)
    x[-1] = torch.linspace(20, -20, width)
    x[:, valid:] = 1e4  # padding: must not count
    if splits is not None:
        monkeypatch.setattr(kernel, "splits_for", lambda r: splits)
    for temperature in (1.0, 0.7):
        want = _reference_stats(x, temperature, valid)
        for one_exp in (True, False):
            m, s, t = kernel.row_stats(x, temperature, valid, block=block, one_exp=one_exp)
            for got, ref in zip((m, s, t), want):
                torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_combining_shards_gives_the_whole_rows_statistics():
    """Statistics of two vocab halves, each relative to its own max, combined at the global max: the whole
    row's (what the TP all-reduce does with them)."""
    torch.manual_seed(0)
    x = 4 * torch.randn(6, 512)
    x[0, :256] = -1e9  # one shard far below the other: its scale underflows to 0 without a nan
    parts = [kernel.row_stats(h.contiguous(), 0.9, 256, block=64) for h in x.split(256, -1)]
    m, s, t = (torch.stack(v, -1) for v in zip(*parts))
    top = m.amax(-1)
    s_all, t_all = kernel.combine(m, s, t, top)
    want = _reference_stats(x, 0.9, 512)
    torch.testing.assert_close(top.double(), want[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(s_all.double(), want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t_all.double(), want[2], rtol=1e-5, atol=1e-5)
    empty = kernel.combine(torch.tensor([[float("-inf"), 1.0]]), torch.tensor([[0.0, 2.0]]),
                           torch.tensor([[0.0, -0.5]]), torch.tensor([1.0]))  # fmt: skip
    assert torch.equal(empty[0], torch.tensor([2.0])) and torch.equal(empty[1], torch.tensor([-0.5]))


@pytest.mark.parametrize(
    "dtype,temperature", [(torch.float32, 0.8), (torch.bfloat16, 0.8), (torch.bfloat16, 1.0)]
)
def test_fused_log_probs_entropy_and_gradients_equal_the_eager_passes(monkeypatch, dtype, temperature):
    """The autograd function with the kernels and without them (eager passes): log-probs, entropy and the
    gradient of a weighted sum of both, with vocab padding; a target id in the padding columns is where
    the eager path reads it too. At temperature 1 the kernels skip their divisions."""
    torch.manual_seed(1)
    logits = (3 * torch.randn(2, 19, 300)).to(dtype)
    targets = torch.randint(0, 290, (2, 19))
    targets[1, 3] = 295  # an id in the padding columns
    g_lp, g_ent = torch.randn(2, 19), torch.randn(2, 19)
    results = []
    for on in (True, False):
        monkeypatch.setattr(kernel, "RUN_ON_CPU", on)
        x = logits.clone().requires_grad_(True)
        lp, ent = vp.vocab_parallel_log_probs_and_entropy(x, targets, temperature=temperature, vocab_size=290)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        results.append((lp, ent, x.grad))
    (lp1, ent1, g1), (lp0, ent0, g0) = results
    assert lp1.dtype == torch.float32 and g1.dtype == dtype
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-4}
    torch.testing.assert_close(g1.float(), g0.float(), **tol)
    pad = g1[..., 290:].clone()
    pad[1, 3, 5] = 0  # the padding target's one-hot term, as the eager passes put it
    assert torch.all(pad == 0) and g1.abs().sum() > 0
    real = targets < 290
    want = torch.log_softmax(logits[..., :290].float() / temperature, -1).gather(
        -1, targets.clamp(max=289)[..., None]
    )[..., 0]
    torch.testing.assert_close(lp1[real], want[real], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    x = logits.clone().requires_grad_(True)
    lp, _ = vp.vocab_parallel_log_probs_and_entropy(x, targets, temperature=temperature, vocab_size=290)
    (lp * g_lp).sum().backward()  # entropy unused: its gradient is None
    assert x.grad.abs().sum() > 0
    x = logits[:, :0].clone().requires_grad_(True)  # no rows
    lp, ent = vp.vocab_parallel_log_probs_and_entropy(x, targets[:, :0], vocab_size=290)
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == (2, 0) and x.grad.shape == x.shape


def test_kernels_that_fail_their_trial_warn_once_and_the_passes_serve(monkeypatch):
    """A Triton compile error (another GPU, another Triton) is met at the trial on a small input: a warning
    naming the cause, then the compiled (here eager) passes with the same results; no second trial."""
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(kernel, "row_stats", broken)
    logits = torch.randn(1, 6, 40, requires_grad=True)
    target = torch.randint(0, 40, (1, 6))
    with pytest.warns(UserWarning, match="no kernel for this GPU"):
        lp, _ = vp.vocab_parallel_log_probs_and_entropy(logits, target)
    lp.sum().backward()
    want = torch.log_softmax(logits.detach(), -1).gather(-1, target[..., None])[..., 0]
    torch.testing.assert_close(lp, want)
    assert not kernel.usable(logits[0].detach()) and calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("part", ["m", "s", "t"])
def test_a_kernel_off_by_a_percent_fails_its_trial(monkeypatch, dtype, part):
    """The trial checks values, not only that the kernels run: statistics 1% off (a miscompile, say) fail it
    in every dtype, with a warning, and the passes serve."""
    real = kernel.row_stats

    def off(*a, **k):
        stats = list(real(*a, **k))
        i = "mst".index(part)
        stats[i] = stats[i] * 1.01 + (0.01 if part != "s" else 0.0)  # t and m may be 0 somewhere
        return tuple(stats)

    monkeypatch.setattr(kernel, "row_stats", off)
    x = torch.randn(3, 64).to(dtype)
    with pytest.warns(UserWarning, match="relative gap to float64"):
        assert not kernel.usable(x)
