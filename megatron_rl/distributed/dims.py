"""Parallel layout sizes, validated before any process group or GPU work exists."""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout or batch setting that cannot work; the message names the key and a fix."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """world = TP x PP x DP. DP is derived: it is what the world size leaves after TP and PP.

    Construct with ``ParallelDims.build(world_size, tp, pp, num_layers=...)`` to validate.
    """

    world_size: int
    tp: int
    pp: int
    dp: int

    @classmethod
    def build(cls, world_size: int, tp: int, pp: int, num_layers: int | None = None) -> ParallelDims:
        for key, value in (
            ("parallel.tensor_model_parallel_size", tp),
            ("parallel.pipeline_model_parallel_size", pp),
        ):
            if value < 1:
                raise LayoutError(f"{key}={value} must be >= 1.")
        if num_layers is not None and pp > num_layers:
            raise LayoutError(
                f"parallel.pipeline_model_parallel_size={pp} is larger than the model's {num_layers} "
                f"layers (model.num_layers / the HF config's num_hidden_layers): every pipeline stage "
                f"needs at least one layer. Use parallel.pipeline_model_parallel_size <= {num_layers}."
            )
        if num_layers is not None and num_layers % pp != 0:
            raise LayoutError(
                f"The model's {num_layers} layers do not split evenly over "
                f"parallel.pipeline_model_parallel_size={pp} stages. Use a PP size that divides "
                f"{num_layers}: {', '.join(map(str, divisors(num_layers)))}."
            )
        if world_size % (tp * pp) != 0:
            valid = [(t, p) for t in divisors(world_size) for p in divisors(world_size // t)]
            hint = ", ".join(f"TP={t} x PP={p}" for t, p in valid[:6])
            raise LayoutError(
                f"parallel.tensor_model_parallel_size={tp} x parallel.pipeline_model_parallel_size={pp} "
                f"= {tp * pp} does not divide the world size {world_size} (number of processes). "
                f"Choose sizes whose product divides {world_size}, for example {hint}, or launch a "
                f"multiple of {tp * pp} processes (torchrun --nproc-per-node)."
            )
        return cls(world_size=world_size, tp=tp, pp=pp, dp=world_size // (tp * pp))

    def describe(self) -> str:
        return f"world={self.world_size} = TP {self.tp} x PP {self.pp} x DP {self.dp}"
