"""Training layout -> generation layout, in place: gather only what this rank lacks.

Training layout: TP_t x PP_t x DP (megatron-core ``parallel_state``). Generation layout: TP_g divides TP_t
and PP is folded into DP. With ``m = TP_t / TP_g``:

- the "micro-DP" group is ``m`` consecutive TP ranks; they all-gather their shards, and the merge is the
  generation shard ``tp_rank // m`` of size TP_g (consecutive shards concatenate into one shard);
- the generation TP group is the TP_g ranks with the same ``tp_rank % m`` (stride ``m``);
- each rank receives the other PP stages' layers for its TP shard (broadcast in the PP group);
- a DP rank's prompts are split over its ``PP_t * m`` generation replicas and the results all-gathered
  back over the model-parallel group, so every TP/PP rank of the replica ends with the full list.

With TP_g == TP_t the generation weights of this rank's own stage *are* the actor's parameter tensors;
only other stages' layers are new buffers (``GenWeights.owned``), freed when generation ends. With
TP_g < TP_t the merged shards are new tensors (the merge needs contiguous storage).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.rollout.decoder import GenWeights

if TYPE_CHECKING:
    from megatron_rl.models.args import ModelArgs

# generation key -> megatron-core local-spec suffix (TE-spec fused-norm fallback second)
LAYER_NAMES = {
    "ln1": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    "qkv_w": ("self_attention.linear_qkv.weight",),
    "qkv_b": ("self_attention.linear_qkv.bias",),
    "q_norm": ("self_attention.q_layernorm.weight",),
    "k_norm": ("self_attention.k_layernorm.weight",),
    "proj": ("self_attention.linear_proj.weight",),
    "ln2": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    "fc1": ("mlp.linear_fc1.weight",),
    "fc2": ("mlp.linear_fc2.weight",),
}
EMBED = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
_CAT_DIM0 = {"qkv_w", "qkv_b", "embed", "output"}  # column-parallel: whole query groups / vocab rows
_CAT_DIM1 = {"proj", "fc2"}  # row-parallel


@dataclass(frozen=True)
class GenLayout:
    """Where this rank sits in the training and generation layouts (all sizes 1 without torch.distributed)."""

    tp_t: int = 1
    pp_t: int = 1
    tp_g: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    gen_group: dist.ProcessGroup | None = None  # TP_g ranks that generate together
    gen_src: int = 0  # global rank of generation-TP rank 0 (samples and broadcasts)
    micro_group: dist.ProcessGroup | None = None  # m consecutive TP ranks whose shards merge
    pp_group: dist.ProcessGroup | None = None
    pp_ranks: tuple[int, ...] = (0,)
    mp_group: dist.ProcessGroup | None = None  # TP_t x PP_t ranks of one DP replica

    @property
    def m(self) -> int:
        return self.tp_t // self.tp_g

    @property
    def gen_tp_rank(self) -> int:
        return self.tp_rank // self.m

    @property
    def num_replicas(self) -> int:
        return self.pp_t * self.m

    @property
    def replica(self) -> int:
        return self.pp_rank * self.m + self.tp_rank % self.m


def check_tp_sizes(tp_g: int, tp_t: int) -> None:
    if tp_g < 1 or tp_t % tp_g != 0:
        raise ValueError(
            f"rollout.tensor_model_parallel_size={tp_g} must divide parallel.tensor_model_parallel_size="
            f"{tp_t} (generation shards are merged training shards). Use one of "
            f"{[d for d in range(1, tp_t + 1) if tp_t % d == 0]}."
        )


_GROUP_CACHE: dict[tuple, dict[tuple[int, ...], dist.ProcessGroup]] = {}


def _groups_for(all_tp: list[tuple[int, ...]], tp_g: int) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """Create (once, in the same order on every rank) the generation-TP and micro-DP groups."""
    key = (tuple(all_tp), tp_g)
    if key not in _GROUP_CACHE:
        m = len(all_tp[0]) // tp_g
        wanted = []
        for ranks in all_tp:
            wanted += [tuple(ranks[r * m + j] for r in range(tp_g)) for j in range(m)]
            wanted += [tuple(ranks[r * m : (r + 1) * m]) for r in range(tp_g)]
        _GROUP_CACHE[key] = {g: dist.new_group(list(g)) for g in wanted if len(g) > 1}
    return _GROUP_CACHE[key]


def build_layout(tp_g: int | None = None) -> GenLayout:
    """The generation layout on megatron-core's current ``parallel_state`` (collective on first use)."""
    if not dist.is_initialized():
        check_tp_sizes(tp_g or 1, 1)
        return GenLayout()
    from megatron.core import parallel_state as ps

    tp_t = ps.get_tensor_model_parallel_world_size()
    tp_g = tp_t if tp_g is None else tp_g
    check_tp_sizes(tp_g, tp_t)
    tp_ranks = tuple(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, tp_ranks)
    groups = _groups_for(sorted(set(every)), tp_g)
    tp_rank, m = ps.get_tensor_model_parallel_rank(), tp_t // tp_g
    gen_ranks = tuple(tp_ranks[r * m + tp_rank % m] for r in range(tp_g))
    micro_ranks = tuple(tp_ranks[(tp_rank // m) * m : (tp_rank // m + 1) * m])
    pp_group = ps.get_pipeline_model_parallel_group()
    return GenLayout(
        tp_t=tp_t,
        pp_t=ps.get_pipeline_model_parallel_world_size(),
        tp_g=tp_g,
        tp_rank=tp_rank,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        gen_group=groups.get(gen_ranks),
        gen_src=gen_ranks[0],
        micro_group=groups.get(micro_ranks),
        pp_group=pp_group,
        pp_ranks=tuple(dist.get_process_group_ranks(pp_group)),
        mp_group=ps.get_model_parallel_group(),
    )


def model_params(model) -> dict[str, torch.Tensor]:
    """Parameter tensors of a (possibly DDP/Float16Module-wrapped) GPTModel by local-spec name."""
    out = {}
    for name, p in model.named_parameters():
        while name.startswith("module."):
            name = name[len("module.") :]
        out[name] = p
    return out


def _layer_keys(spec: ModelArgs) -> list[str]:
    keys = ["ln1", "qkv_w", "proj", "ln2", "fc1", "fc2"]
    keys += ["qkv_b"] if spec.qkv_bias else []
    return keys + (["q_norm", "k_norm"] if spec.qk_norm else [])


def _lookup(params: dict[str, torch.Tensor], local: int, key: str) -> torch.Tensor:
    for suffix in LAYER_NAMES[key]:
        name = f"decoder.layers.{local}.{suffix}"
        if name in params:
            return params[name]
    raise KeyError(f"parameter decoder.layers.{local}.{LAYER_NAMES[key][0]} not found in the actor model")


def _from_stage(own: torch.Tensor | None, like: torch.Tensor, stage: int, lay: GenLayout) -> torch.Tensor:
    """This rank's tensor if it lives on our PP stage, else a buffer broadcast from that stage."""
    src = own if stage == lay.pp_rank else torch.empty_like(like)
    if lay.pp_t > 1:
        dist.broadcast(src.detach(), src=lay.pp_ranks[stage], group=lay.pp_group)
    return src.detach()


def _merge(key: str, shard: torch.Tensor, lay: GenLayout) -> torch.Tensor:
    """All-gather the micro-DP group's shards of one tensor and merge them into the generation shard."""
    if key not in _CAT_DIM0 | _CAT_DIM1 | {"fc1"}:
        return shard  # replicated norms
    parts = [torch.empty_like(shard) for _ in range(lay.m)]
    dist.all_gather(parts, shard.contiguous(), group=lay.micro_group)
    if key == "fc1":  # each shard is cat(gate_i, up_i): merge gates and ups separately
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=1 if key in _CAT_DIM1 else 0)


def gather_weights(params: dict[str, torch.Tensor], spec: ModelArgs, lay: GenLayout) -> GenWeights:
    """Assemble this rank's generation shard of the full model from the actor's own parameters.

    ``params`` are this rank's training-layout parameters by local-spec name (``model_params``). Runs
    collectives in the PP and micro-DP groups; every rank of a model-parallel group must call it.
    """
    per_stage = spec.num_layers // lay.pp_t
    first_stage = lay.pp_rank == 0
    like_layer = {k: _lookup(params, 0, k) for k in _layer_keys(spec)}
    dtype = like_layer["qkv_w"].dtype
    device = like_layer["qkv_w"].device
    vocab_rows = torch.empty(spec.padded_vocab_size // lay.tp_t, spec.hidden_size, dtype=dtype, device=device)
    norm_like = like_layer["ln1"]

    named: dict[str, torch.Tensor] = {}
    named["embed"] = _from_stage(params.get(EMBED) if first_stage else None, vocab_rows, 0, lay)
    layers = []
    for gl in range(spec.num_layers):
        stage, local = divmod(gl, per_stage)
        own = {k: _lookup(params, local, k) for k in like_layer} if stage == lay.pp_rank else {}
        layers.append({k: _from_stage(own.get(k), like_layer[k], stage, lay) for k in like_layer})
    last = lay.pp_t - 1
    on_last = lay.pp_rank == last
    named["final_norm"] = _from_stage(params.get(FINAL_NORM) if on_last else None, norm_like, last, lay)
    if not spec.tie_word_embeddings:
        named["output"] = _from_stage(params.get(OUTPUT) if on_last else None, vocab_rows, last, lay)

    if lay.m > 1:
        layers = [{k: _merge(k, t, lay) for k, t in layer.items()} for layer in layers]
        named = {k: _merge(k, t, lay) for k, t in named.items()}
    actor_storage = {p.data_ptr() for p in params.values()}
    owned = {t.data_ptr(): t for t in [*named.values(), *(t for layer in layers for t in layer.values())]}
    return GenWeights(
        embed=named["embed"],
        layers=layers,
        final_norm=named["final_norm"],
        output=named.get("output", named["embed"]),
        tp=lay.tp_g,
        tp_rank=lay.gen_tp_rank,
        group=lay.gen_group,
        owned=[t for ptr, t in owned.items() if ptr not in actor_storage],
    )


def split_range(num_items: int, parts: int, index: int) -> range:
    """Contiguous, balanced share ``index`` of ``num_items`` split into ``parts``."""
    base, extra = divmod(num_items, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def gather_results(local: list, lay: GenLayout) -> list:
    """All-gather each replica's results over the model-parallel group, in replica order. Completions travel
    without their ``arrays`` (a second copy of the lists' values: the pickle would carry both; without them
    ``build_batch`` reads the lists)."""
    if lay.mp_group is None or dist.get_world_size(lay.mp_group) == 1:
        return list(local)
    local = [replace(c, arrays=None) if getattr(c, "arrays", None) is not None else c for c in local]
    every: list = [None] * dist.get_world_size(lay.mp_group)
    dist.all_gather_object(every, (lay.replica, lay.gen_tp_rank, local), group=lay.mp_group)
    by_replica = {rep: items for rep, gen_rank, items in every if gen_rank == 0}
    return [item for rep in range(lay.num_replicas) for item in by_replica[rep]]
