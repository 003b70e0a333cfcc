"""The bias add of megatron-core's local column-parallel linear (``linear_qkv`` of models with a query-key-value
bias: Qwen2 / Qwen2.5) as one compiled kernel each way, for ``models.spec.QKVLinear`` (full fine-tuning's
trainable layers).

megatron-core's local linear multiplies and then adds the bias as its own op, ``output + bias`` on
[S, B, N] against [N]: a broadcast that torch runs in its generic (unvectorised) elementwise kernel, and
backward sums the gradient over the rows in a reduction kernel. Measured in the 0.5B GRPO update (session 30's
profile, H100, 34,816 rows x 1,152): 122.7 us a forward call, as long as the qkv GEMM itself, where the bytes
(read and write 80 MB) take ~48 us. Compiled with the rows dynamic, both directions are inductor kernels
(the forward vectorised, the bias gradient a split reduction): measured in session 31's profile, 56 us a
forward call and 31 us for the gradient's reduction. The sum is the same; the gradient's
reduction order differs (rounding-level differences). CUDA only by default (``MEGATRON_RL_COMPILE``);
``MEGATRON_RL_COMPILED_BIAS=0`` keeps megatron-core's add.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.kernels.compile import compile_rows_dynamic, env_switch, probe

ON = env_switch("MEGATRON_RL_COMPILED_BIAS", True)


def _add(x: Tensor, bias: Tensor) -> Tensor:
    return x + bias


_COMPILED = compile_rows_dynamic(_add)


# Rows of the trial on CUDA: inductor benchmarks a pointwise kernel's candidate configs at its first launch (the
# trial's) and keeps the winner for every size; the trial's rows also set the size hints the candidates come from
# (at 33 rows XBLOCK 512 / 256, at 8,192 the pair a 34,816-row compile gets). At 33 rows (sessions 31-32) the
# kept config ran the 0.5B update's 34,816 x 1,152 add in 96 us a call in session 32's profiles against 56 us
# in session 31's (same code). Not yet measured on a GPU at 8,192 (session 32 ran out of device time). On CPU
# inductor does not autotune: 33 rows there.
TRIAL_ROWS = 8192
CHECKED_ROWS = 64  # the rows compared against float64 (the autotune needs the size, the check does not)


def _trial(device: torch.device, dtype: torch.dtype, n: int) -> None:
    """The compiled add and its backward on ``TRIAL_ROWS`` rows (33 on CPU) of width ``n`` against eager ops in
    float64 on their first ``CHECKED_ROWS`` rows. Runs with gradients on and outside inference mode: the first
    call may come inside a no-grad pass (old log-probs, a critic's values) or ``torch.inference_mode``."""
    rows = TRIAL_ROWS if torch.device(device).type == "cuda" else 33
    with torch.inference_mode(False), torch.enable_grad():
        # not the global generator: the trial runs mid-training
        g = torch.Generator(device=device).manual_seed(0)
        x, grad = (torch.randn(rows, n, generator=g, device=device).to(dtype) for _ in range(2))
        b = torch.randn(1, n, generator=g, device=device).to(dtype).requires_grad_(True)
        out = _COMPILED(x, b)
        (db,) = torch.autograd.grad(out, b, grad)
    k = min(rows, CHECKED_ROWS)
    want = x[:k].double() + b.detach().double()
    sums = grad.sum(0, keepdim=True, dtype=torch.float64)  # no float64 copy of all the rows
    gap = max(
        float((out[:k].detach().double() - want).abs().max() / want.abs().max()),
        float((db.double() - sums).abs().max() / grad.abs().sum(0, dtype=torch.float64).max()),
    )
    if not gap <= (1e-5 if dtype == torch.float32 else 1e-2):  # nan fails too
        raise RuntimeError(f"largest gap to float64 {gap:.3g}")


def add_bias(x: Tensor, bias: Tensor) -> Tensor:
    """x [..., N] + bias [N]: compiled where ``ON``, compiling is enabled on x's device and its trial passed
    (a failure warns once and the eager add serves)."""
    n = x.shape[-1]
    if not (ON and probe(f"the bias add ({x.dtype}, N={n})", x.device, lambda: _trial(x.device, x.dtype, n))):
        return x + bias
    return _COMPILED(x.reshape(-1, n), bias.view(1, n)).view(x.shape)
