"""When to use ``torch.compile``, and a probe that turns a failing compile into a warning.

``MEGATRON_RL_COMPILE``: ``auto`` (default) compiles on CUDA only, where Triton fuses elementwise chains
and reductions into single kernels; ``1`` compiles on CPU too (tests run the compiled code that way);
``0`` never compiles. A compile that fails (no Triton, no C++ compiler) is reported once per kernel and
that kernel runs eagerly from then on: slower, same numbers.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

_FAILED: dict[str, str] = {}  # kernel name -> why its compile failed
_PROBED: set[str] = set()


def compile_enabled(device: torch.device | str) -> bool:
    flag = os.environ.get("MEGATRON_RL_COMPILE", "auto")
    if flag not in ("auto", "0", "1"):
        raise ValueError(f"MEGATRON_RL_COMPILE={flag!r}; use auto, 0 or 1")
    return flag == "1" or (flag == "auto" and torch.device(device).type == "cuda")


def env_switch(name: str, default: bool) -> bool:
    """An on/off environment switch of the kernels: on by default unless set to 0/false/off/no, or off by
    default unless set to 1/true/on/yes (any other value keeps the default)."""
    value = os.environ.get(name, "1" if default else "0").strip().lower()
    return value not in ("0", "false", "off", "no") if default else value in ("1", "true", "on", "yes")


def compile_rows_dynamic(fn: Callable) -> Callable:
    """``torch.compile(fn)`` whose tensor arguments are dynamic in dim 0 only.

    Rows (tokens) vary between micro-batches; the inner sizes (hidden, FFN, vocab, head dim) do not. With
    every size symbolic (``dynamic=True``) Triton's index arithmetic divides by runtime values and loses
    vectorised loads: the SwiGLU backward ran 2.3x slower on an H200. Inner sizes are marked static, so a
    call with other inner sizes (a probe on a small input, another TP size) compiles its own kernel instead
    of turning them dynamic. ``torch.compile`` is only called at the first call (module import stays free
    of torch._dynamo)."""
    compiled = []

    def run(*args, **kwargs):
        if not compiled:
            compiled.append(torch.compile(fn))
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
                for d in range(1, a.dim()):
                    torch._dynamo.mark_static(a, d)
        return compiled[0](*args, **kwargs)

    return run


def probe(name: str, device: torch.device | str, trial: Callable[[], object]) -> bool:
    """True when ``name`` should run compiled on ``device``: compiling is enabled and ``trial`` (which
    runs the compiled kernel once on a small input) succeeded, now or at an earlier probe."""
    if not compile_enabled(device):
        return False
    why = (
        f"torch.compile of {name} failed; it runs eagerly (slower, same results). Set "
        "MEGATRON_RL_COMPILE=0 to skip the attempt."
    )
    return trial_once(name, trial, why)


def trial_passed(name: str) -> bool:
    """Whether ``trial_once`` already ran kernel ``name``'s trial and it succeeded (no trial runs here: for
    callers that must not start one, e.g. inside a CUDA-graph capture)."""
    return name in _PROBED


def trial_once(name: str, trial: Callable[[], object], fallback: str) -> bool:
    """True when ``trial`` of kernel ``name`` succeeded, now or at an earlier call; a failure (any
    exception) warns once with ``fallback`` (what runs instead) and its cause, and is remembered."""
    if name in _FAILED:
        return False
    if name in _PROBED:
        return True
    try:
        trial()
    except Exception as exc:  # noqa: BLE001 - any compile failure: fall back, loudly
        _FAILED[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        warnings.warn(f"{fallback} Cause: {_FAILED[name]}", stacklevel=3)
        return False
    _PROBED.add(name)
    return True
