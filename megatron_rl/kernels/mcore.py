"""The fused kernels our megatron-core model configs turn on without transformer-engine or apex.

- RoPE: with ``apply_rope_fusion`` megatron-core calls ``rope_utils.fused_apply_rotary_pos_emb`` (and
  ``fused_apply_rotary_pos_emb_thd`` for packed sequences), slots it fills from TE; without TE they are
  empty and we fill them with ``kernels.rope``.
- SwiGLU: with ``use_te_activation_func`` (megatron-core's name; no TE involved) its MLP hands the whole
  fc1 output to the spec's activation module, ``kernels.swiglu.SwiGLU`` (wired in ``models.spec``).
  megatron-core's own ``bias_activation_fusion`` SwiGLU is ``torch.compile`` with default settings: once
  it has seen a second FFN width (a small probe, another TP size) every size turns dynamic, and on an
  H200 its backward then took 0.91 ms per [16k, 9728] call; ours keeps inner sizes static
  (``compile_rows_dynamic``). Alone, at one width, the two are alike (0.52 vs 0.55 ms forward+backward).

Used for the local (non-TE) layers only where ``kernels.compile`` allows compiling (CUDA by default) and
a probe compiles and runs both on the model's device; otherwise megatron-core's unfused paths stay.
"""

from __future__ import annotations

import torch

from megatron_rl.kernels.compile import probe
from megatron_rl.kernels.rope import compiled_rope, fused_apply_rotary_pos_emb, fused_apply_rotary_pos_emb_thd
from megatron_rl.kernels.swiglu import swiglu


def _trial(device: torch.device) -> None:
    x = torch.randn(4, 2, 2, 8, device=device, requires_grad=True)
    freqs = torch.randn(4, 1, 1, 8, device=device)
    y = torch.randn(4, 2, 16, device=device, requires_grad=True)
    (compiled_rope(x, freqs).sum() + swiglu(y).sum()).backward()


def fusion_flags(device: torch.device | str, te_layers: bool) -> dict[str, bool]:
    """TransformerConfig overrides for a model on ``device``: the two fusions for local layers, or {}
    (TE layers, or where they do not compile). Fills megatron-core's fused-RoPE slot when TE left it
    empty."""
    device = torch.device(device)
    if te_layers or not probe("RoPE/SwiGLU fusions", device, lambda: _trial(device)):
        return {}
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:  # packed sequences (rollout.packing)
        rope_utils.fused_apply_rotary_pos_emb_thd = fused_apply_rotary_pos_emb_thd
    return {"apply_rope_fusion": True, "use_te_activation_func": True}
