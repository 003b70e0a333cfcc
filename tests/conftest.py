"""Test-process set-up shared by all tests."""

import os

# The Triton decode-attention kernel runs on CPU under Triton's interpreter in tests; Triton reads this
# when it is first imported. Only tests that set kernels.decode_attention.RUN_ON_CPU use the kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # two pytest workers share the cores: one thread each in-process
    import torch

    torch.set_num_threads(1)


import pytest  # noqa: E402

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
