"""Test-process set-up shared by all tests."""

import os

# The Triton decode-attention kernel runs on CPU under Triton's interpreter in tests; Triton reads this
# when it is first imported. Only tests that set kernels.decode_attention.RUN_ON_CPU use the kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")
