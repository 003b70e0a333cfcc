"""LoRA adapters on megatron-core's tensor-parallel linear layers (``actor.lora`` / ``critic.lora``).

``y = W x + (alpha / r) * B A dropout(x)`` with the adapters sharded like the layer they adapt, so that
every rank computes its part of the update with local tensors only (Megatron-Bridge's layout):

- column-parallel (``linear_qkv``, ``linear_fc1``; W split on its output): A [r, in] replicated, B
  [out/tp, r] split like W's rows. B's rows follow W's packing: per query group q heads, k, v for qkv;
  ``cat(gate_i, up_i)`` at TP rank i for fc1, so B maps onto HF PEFT's per-projection ``lora_B`` exactly
  as W maps onto the HF weights (``hf_mapping``), with A shared by q/k/v (gate/up).
- row-parallel (``linear_proj``, ``linear_fc2``; W split on its input): A [r, in/tp] split like W's
  columns, B [out, r] replicated.

Collectives: column-parallel all-reduces the gradient of ``A x`` over TP in backward (each rank's B rows
contribute part of it), so A's gradient is whole on every rank; under sequence parallelism its input is
all-gathered (the gradient split back, not summed, since it is already whole). Row-parallel all-reduces
``A x`` over TP in forward (reduce-scatters it under sequence parallelism, where B then sees this rank's
tokens only and its gradient is summed over TP like a sequence-parallel norm's: ``sequence_parallel``).

A and B are created by the layer's constructor (the ModuleSpec passes ``lora``) and initialised by
``init_adapters`` from a seed per global layer and module, on the full [r, in] tensor before slicing, so
the initial adapters do not depend on the TP/PP layout. The base weights keep their names and
megatron-core's sharding; ``sharded_state_dict`` adds the adapters with theirs.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel as tpl
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import (
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_rl.config.schema import LoRAConfig

LORA_SEED = 20261201


def _kaiming_uniform(a: torch.Tensor, gen: torch.Generator) -> None:
    """PEFT's default: ``kaiming_uniform_(a=sqrt(5))`` on [r, in], i.e. U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(a.shape[1])
    a.uniform_(-bound, bound, generator=gen)


def _gaussian(a: torch.Tensor, gen: torch.Generator) -> None:
    """PEFT's ``init_lora_weights='gaussian'``: N(0, 1/r)."""
    a.normal_(0.0, 1.0 / a.shape[0], generator=gen)


LORA_INITS: dict[str, Callable[[torch.Tensor, torch.Generator], None]] = {
    "kaiming_uniform": _kaiming_uniform,
    "gaussian": _gaussian,
}
# target name -> (layer kind); column-parallel modules split W's output dim, row-parallel its input dim
TARGETS = {"linear_qkv": "column", "linear_proj": "row", "linear_fc1": "column", "linear_fc2": "row"}


class _LoRAMixin:
    """Adapter parameters and switches shared by the column- and row-parallel variants."""

    lora_A: torch.nn.Parameter
    lora_B: torch.nn.Parameter

    def _add_adapters(self, cfg: LoRAConfig, a_shape, b_shape, a_split: int | None, b_split: int | None):
        dtype, dev = self.weight.dtype, self.weight.device
        self.lora_A = torch.nn.Parameter(torch.zeros(a_shape, dtype=dtype, device=dev))  # [r, in(/tp)]
        self.lora_B = torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=dev))  # [out(/tp), r]
        for p, dim in ((self.lora_A, a_split), (self.lora_B, b_split)):
            tpl.set_tensor_model_parallel_attributes(p, is_parallel=dim is not None, dim=dim or 0, stride=1)
        self.lora_scale = cfg.alpha / cfg.rank
        self.lora_dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout else torch.nn.Identity()
        self.lora_enabled = True
        self._lora_splits = {"lora_A": a_split, "lora_B": b_split}

    def _sharded_with_adapters(self, base_axes: dict, prefix, sharded_offsets, metadata) -> dict:
        axes = base_axes | {k: d for k, d in self._lora_splits.items() if d is not None}
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )  # fmt: skip

    def merged_weight(self) -> torch.Tensor:
        """A new tensor ``W + scale * B A`` of this rank's shard (W itself is not touched)."""
        with torch.no_grad():
            delta = self.lora_B.float() @ self.lora_A.float()  # [out(/tp), in(/tp)]
            return (self.weight.float() + self.lora_scale * delta).to(self.weight.dtype)


class LoRAColumnParallelLinear(_LoRAMixin, ColumnParallelLinear):
    """ColumnParallelLinear plus a LoRA adapter: A [r, in] replicated, B [out/tp, r] split like W."""

    def __init__(self, input_size: int, output_size: int, *, lora: LoRAConfig, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        out_local = self.weight.shape[0]
        self._add_adapters(lora, (lora.rank, input_size), (out_local, lora.rank), None, 0)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        """input_ [T, B, in] ([T/tp, B, in] with sequence parallelism) -> ([T, B, out/tp], bias)."""
        out, bias = super().forward(input_, weight, runtime_gather_output)
        if not self.lora_enabled:
            return out, bias
        x = self.lora_dropout(input_)
        if self.sequence_parallel:  # [T/tp, B, in] -> [T, B, in]; its gradient is whole: split, not summed
            x = tpl.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=False, group=self.tp_group
            )
        u = F.linear(x, self.lora_A)  # [T, B, r], the same on every TP rank
        u = tpl.copy_to_tensor_model_parallel_region(u, group=self.tp_group)  # backward: sum over TP
        delta = F.linear(u, self.lora_B) * self.lora_scale  # [T, B, out/tp]
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            delta = tpl.gather_from_tensor_model_parallel_region(delta, group=self.tp_group)  # [T, B, out]
        return out + delta, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._sharded_with_adapters({"weight": 0, "bias": 0}, prefix, sharded_offsets, metadata)


class LoRARowParallelLinear(_LoRAMixin, RowParallelLinear):
    """RowParallelLinear plus a LoRA adapter: A [r, in/tp] split like W, B [out, r] replicated."""

    def __init__(self, input_size: int, output_size: int, *, lora: LoRAConfig, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        in_local = self.weight.shape[1]
        self._add_adapters(lora, (lora.rank, in_local), (output_size, lora.rank), 1, None)
        # under sequence parallelism B sees only this rank's tokens: its gradient is summed over TP
        self.lora_B.sequence_parallel = self.sequence_parallel

    def forward(self, input_):
        """input_ [T, B, in/tp] -> ([T, B, out] or [T/tp, B, out] with sequence parallelism, bias)."""
        out, bias = super().forward(input_)
        if not self.lora_enabled:
            return out, bias
        x = (
            input_
            if self.input_is_parallel
            else tpl.scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        )
        u = F.linear(self.lora_dropout(x), self.lora_A)  # [T, B, r], partial sums over TP
        if self.sequence_parallel:
            u = tpl.reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)  # [T/tp, B, r]
        else:
            u = tpl.reduce_from_tensor_model_parallel_region(u, group=self.tp_group)  # [T, B, r]
        return out + F.linear(u, self.lora_B) * self.lora_scale, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._sharded_with_adapters({"weight": 1}, prefix, sharded_offsets, metadata)


LORA_CLASSES = {"column": LoRAColumnParallelLinear, "row": LoRARowParallelLinear}
LORA_MODULES = tuple(LORA_CLASSES.values())


def apply_to_layer_spec(spec: ModuleSpec, cfg: LoRAConfig) -> ModuleSpec:
    """Swap the local spec's target linear layers for their LoRA variants (in place; returns ``spec``)."""
    subs = {
        "linear_qkv": spec.submodules.self_attention.submodules,
        "linear_proj": spec.submodules.self_attention.submodules,
        "linear_fc1": spec.submodules.mlp.submodules,
        "linear_fc2": spec.submodules.mlp.submodules,
    }
    for name in cfg.target_modules:
        setattr(subs[name], name, ModuleSpec(module=LORA_CLASSES[TARGETS[name]], params={"lora": cfg}))
    return spec


def lora_modules(model: torch.nn.Module) -> Iterator[tuple[str, _LoRAMixin]]:
    """(name, module) of every LoRA layer, names as in ``model.named_modules()``."""
    for name, mod in model.named_modules():
        if isinstance(mod, LORA_MODULES):
            yield name, mod


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's."""
    return name.endswith((".lora_A", ".lora_B"))


def init_adapters(model: torch.nn.Module, init: str, seed: int = LORA_SEED) -> None:
    """A from ``LORA_INITS[init]`` on the full [r, in] tensor (seeded by the global layer number and the
    module's name, then this rank's input slice for row-parallel layers), B zero."""
    for layer in model.decoder.layers:
        for name, mod in lora_modules(layer):
            gen = torch.Generator().manual_seed(seed + zlib.crc32(f"{layer.layer_number}.{name}".encode()))
            full_in = mod.input_size
            a = torch.empty(mod.lora_A.shape[0], full_in)  # [r, in]
            LORA_INITS[init](a, gen)
            if mod._lora_splits["lora_A"] is not None:  # row-parallel: this rank's columns
                tp_rank, local = mod.tp_group.rank(), mod.lora_A.shape[1]
                a = a[:, tp_rank * local : (tp_rank + 1) * local]
            with torch.no_grad():
                mod.lora_A.copy_(a)
                mod.lora_B.zero_()


def _fold_frozen_forward_impl(input, weight, *args, **kwargs):
    """megatron-core's ``_forward_impl`` with a frozen weight's matmuls run as 2D GEMMs.

    ``torch.matmul([T, B, in], W.t())`` and the backward's ``grad_output.matmul(W)`` fold into one
    [T*B, in] GEMM only when W requires grad or when the leading dims' strides are exactly row-major
    (``stride[0] == stride[1] * B``, size-1 dims included); otherwise they run a bmm of T batches of
    [B, in] with W broadcast, i.e. T GEMVs of a frozen W. Frozen LoRA bases hit it on GPU where flash
    SDPA's output makes linear_proj's input non-contiguous, and GPTModel's [T, B] -> [B, T] logits
    transpose makes the LM head's output gradient strided: with the response-only head (input
    [B*R, 1, h]) that gradient is [B*R, 1, V] with strides (V, B*R*V, 1), which ``is_contiguous()``
    accepts (the size-1 dim's stride is ignored) but matmul does not fold: B*R GEMVs of [1, V] x [V, h].
    So the frozen path runs on [T*B, in] (``reshape``: a copy only where the input is not viewable) and
    views the result back; the view's backward hands LinearWithFrozenWeight a 2D gradient. Under
    sequence parallelism the all-gather / reduce-scatter along dim 0 of [T*B, in] is the one along T."""
    if weight.requires_grad:
        return linear_with_grad_accumulation_and_async_allreduce(input, weight, *args, **kwargs)
    lead = input.shape[1:-1]  # (B,)
    out = linear_with_frozen_weight(input.reshape(-1, input.shape[-1]), weight, *args, **kwargs)
    return out.view(-1, *lead, out.shape[-1])  # [T, B, out] (T the gathered length under SP)


def freeze_base(model: torch.nn.Module, trainable: tuple[str, ...] = ()) -> None:
    """requires_grad False for every parameter but the adapters (and names ending in ``trainable``); the
    tensor-parallel linear layers run their frozen weights as single GEMMs (``_fold_frozen_forward_impl``)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or name.endswith(trainable))
    fold_frozen_linears(model)


def fold_frozen_linears(model: torch.nn.Module) -> None:
    """Every tensor-parallel linear layer of ``model`` runs a frozen weight as 2D GEMMs
    (``_fold_frozen_forward_impl``; a trainable weight takes megatron-core's own path): a LoRA base, or
    the frozen reference model of full fine-tuning (not its batch-invariant ``exact`` layers)."""
    for mod in model.modules():
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            mod._forward_impl = _fold_frozen_forward_impl


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Run ``model`` as its base model (the reference policy of a LoRA actor)."""
    mods = [m for _, m in lora_modules(model)]
    for m in mods:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.lora_enabled = True


def merged_params(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` (by local-spec name, ``reshard.model_params``) with each LoRA layer's weight replaced by
    a new merged tensor ``W + scale * B A``: generation runs on the adapted model while the base weights
    stay bit-identical (nothing is merged into them, so nothing needs unmerging)."""
    out = dict(params)
    for name, mod in lora_modules(model):
        while name.startswith("module."):
            name = name[len("module.") :]
        if mod.lora_enabled:
            out[f"{name}.weight"] = mod.merged_weight()
    return out


def adapter_state(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """This rank's adapters (or with ``grads`` their gradients) by local-spec name (``...linear_qkv.lora_A``)."""
    out = {}
    for name, p in model.named_parameters():
        while name.startswith("module."):
            name = name[len("module.") :]
        if is_adapter(name):
            out[name] = (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad) if grads else p
    return out


def has_adapters(model: torch.nn.Module) -> bool:
    return next(lora_modules(model), None) is not None
