"""Fused kernels written as torch functions and compiled with ``torch.compile`` where it works.

- ``compile``: the one switch (``MEGATRON_RL_COMPILE``) and the probe that falls back to eager.
- ``rope``: rotary embedding in one fused kernel per direction, for megatron-core's fused-RoPE slot.
- ``mcore``: which megatron-core fusion flags the model config turns on without TE/apex.
"""
