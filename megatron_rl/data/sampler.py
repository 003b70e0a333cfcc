"""Global prompt batches: seeded per-epoch shuffling, identical on every rank, and resumable.

Every rank builds the same sampler from the same seed, so every rank computes the same global batch
without communication; each data-parallel rank then keeps its contiguous share (``dp_share``). The
position is ``(epoch, offset)`` with ``0 <= offset < steps_per_epoch``: ``offset`` is the index in the
epoch of the next batch to hand out. Finishing an epoch's last batch moves the position to
``(epoch + 1, 0)``, so a checkpoint taken at an epoch boundary resumes into the next epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

import numpy as np

from megatron_rl.data.prompt_dataset import PromptDataset, PromptRow

T = TypeVar("T")


class PromptSampler:
    """Index batches of ``batch_size`` rows out of ``num_rows``; the last incomplete batch is dropped.

    Args:
        num_rows: dataset size.
        batch_size: ``data.train_batch_size``, prompts per global batch.
        shuffle: ``data.shuffle``; when false every epoch reads rows in file order.
        seed: ``data.seed``; epoch ``e`` uses the permutation seeded by ``(seed, e)``.
        total_epochs: stop iterating after this many epochs; ``None`` iterates forever.
    """

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        total_epochs: int | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"data.train_batch_size={batch_size} must be a positive number of prompts")
        if batch_size > num_rows:
            raise ValueError(
                f"data.train_batch_size={batch_size} is larger than the dataset ({num_rows} rows); "
                f"set data.train_batch_size <= {num_rows} or add more data"
            )
        if seed < 0:
            raise ValueError(f"data.seed={seed} must be a non-negative integer")
        if total_epochs is not None and total_epochs <= 0:
            raise ValueError(f"total_epochs={total_epochs} must be positive (or None to iterate forever)")
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.total_epochs = total_epochs
        self.steps_per_epoch = num_rows // batch_size
        self.epoch = 0
        self.offset = 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def step(self) -> int:
        """Number of batches handed out so far (the data step of the next batch)."""
        return self.epoch * self.steps_per_epoch + self.offset

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row order of ``epoch``: a permutation seeded by ``(seed, epoch)``, or ``arange`` unshuffled."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        else:
            order = np.arange(self.num_rows)
        self._order_cache = (epoch, order)
        return order

    def batch_indices(self, step: int) -> list[int]:
        """Row indices of the global batch at data step ``step`` (0-based, counted across epochs)."""
        if step < 0:
            raise ValueError(f"data step {step} is negative; steps count from 0")
        epoch, offset = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        return order[offset * self.batch_size : (offset + 1) * self.batch_size].tolist()

    def total_steps(self) -> int | None:
        """Steps in ``total_epochs`` epochs, or ``None`` when iterating forever."""
        return None if self.total_epochs is None else self.total_epochs * self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        """Yield index batches from the current position, advancing it as each batch is handed out."""
        total = self.total_steps()
        if total is not None and self.step >= total:
            raise RuntimeError(
                f"nothing left to sample: the position (epoch {self.epoch}, offset {self.offset}) is already "
                f"at the end of total_epochs={self.total_epochs}; raise total_epochs to train longer, or "
                "start from an earlier checkpoint"
            )
        while total is None or self.step < total:
            indices = self.batch_indices(self.step)
            self.epoch, self.offset = divmod(self.step + 1, self.steps_per_epoch)
            yield indices

    def state_dict(self) -> dict:
        """Position plus the settings it depends on (checked on load)."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; refuse when the data settings differ from the checkpoint's."""
        keys = {"seed": "data.seed", "shuffle": "data.shuffle", "batch_size": "data.train_batch_size"}
        keys["num_rows"] = "data.train_files (row count after filtering)"
        for name, key in keys.items():
            if name in state and state[name] != getattr(self, name):
                raise ValueError(
                    f"cannot resume the data position: the checkpoint has {name}={state[name]!r} but this run "
                    f"has {getattr(self, name)!r}; set {key} as in the checkpointed run, or start without "
                    "resuming the data position"
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or offset < 0:
            raise ValueError(f"data position in the checkpoint is negative: epoch={epoch}, offset={offset}")
        # A position saved as (e, steps_per_epoch) means "epoch e is finished": normalise to (e + 1, 0).
        self.epoch, self.offset = divmod(epoch * self.steps_per_epoch + offset, self.steps_per_epoch)


class PromptDataLoader:
    """Global batches of ``PromptRow`` from a ``PromptDataset``; the same batches on every rank.

    ``global_batch(step)`` is random access; iterating yields batches from the saved position on.
    ``state_dict`` / ``load_state_dict`` delegate to the sampler.
    """

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        total_epochs: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.sampler = PromptSampler(len(dataset), batch_size, shuffle, seed, total_epochs)

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def global_batch(self, step: int) -> list[PromptRow]:
        """The ``data.train_batch_size`` rows of data step ``step`` (0-based, across epochs)."""
        return [self.dataset[i] for i in self.sampler.batch_indices(step)]

    def __iter__(self) -> Iterator[list[PromptRow]]:
        for indices in self.sampler:
            yield [self.dataset[i] for i in indices]

    def __len__(self) -> int:
        """Steps per epoch."""
        return self.sampler.steps_per_epoch

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def dp_share(batch: Sequence[T], dp_rank: int, dp_size: int) -> list[T]:
    """The contiguous share of a global batch that data-parallel rank ``dp_rank`` of ``dp_size`` keeps.

    Rank r gets items ``[r * n, (r + 1) * n)`` with ``n = len(batch) // dp_size``.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
    if len(batch) % dp_size:
        raise ValueError(
            f"a global batch of {len(batch)} prompts does not split evenly over {dp_size} data-parallel "
            f"ranks; set data.train_batch_size to a multiple of {dp_size}"
        )
    n = len(batch) // dp_size
    return list(batch[dp_rank * n : (dp_rank + 1) * n])


def eval_batches(dataset: PromptDataset, batch_size: int) -> list[list[PromptRow]]:
    """Every row of ``dataset`` in file order, in batches of ``data.val_batch_size`` (the last may be
    smaller): validation scores every prompt exactly once, unlike training which drops the remainder."""
    if batch_size <= 0:
        raise ValueError(f"data.val_batch_size={batch_size} must be a positive number of prompts")
    rows = dataset.rows
    return [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
