"""Test-process set-up shared by all tests."""

import os

# The Triton decode-attention kernel runs on CPU under Triton's interpreter in tests; Triton reads this
# when it is first imported. Only tests that set kernels.decode_attention.RUN_ON_CPU use the kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # two pytest workers share the cores: one thread each in-process
    import torch

    torch.set_num_threads(1)


import pytest  # noqa: E402


def _patch_triton_language_once_per_launch() -> None:
    """Triton's interpreter (3.x) patches ``triton.language`` for a launch, then again on every call of a
    ``@triton.jit`` helper inside the kernel (``_patch_lang``: ``inspect.getmembers`` over the language
    modules, ~0.3 ms a call): over half the time of a kernel test whose programs call helpers. The re-patch
    installs wrappers that behave like the launch's (a patched member is no longer a builtin, so it is not
    wrapped twice), and the launch restores the originals at its end either way: the kernels run the same
    numpy ops. Here the helpers of a module the launch has patched for skip it."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    patch_lang, launch = getattr(ti, "_patch_lang", None), getattr(ti, "GridExecutor", None)
    if patch_lang is None or launch is None or getattr(patch_lang, "_once_per_launch", False):
        return
    patched: list[set[int]] = []  # per launch in progress: the globals of the functions patched for

    def once(fn):
        if patched and id(fn.__globals__) in patched[-1]:
            return ti._LangPatchScope()  # nothing to restore: the launch's scope restores the originals
        if patched:
            patched[-1].add(id(fn.__globals__))
        return patch_lang(fn)

    call = launch.__call__

    def launch_call(self, *args, **kwargs):
        patched.append(set())
        try:
            return call(self, *args, **kwargs)
        finally:
            patched.pop()

    once._once_per_launch = True
    ti._patch_lang, launch.__call__ = once, launch_call


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_language_once_per_launch()

_LAUNCH_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def _no_launch_variables_leak():
    """A test that leaves a rendezvous variable in os.environ sends every later child process (torchrun,
    the CLI) to a port an in-process group may still hold: fail the test that leaked it, by name."""
    before = {k: os.environ.get(k) for k in _LAUNCH_KEYS}
    yield
    leaked = {k: os.environ.get(k) for k in _LAUNCH_KEYS if os.environ.get(k) != before[k]}
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    assert not leaked, f"the test changed launch variables in os.environ: {leaked}"
