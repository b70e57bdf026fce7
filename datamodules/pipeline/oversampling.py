"""nnU-Net's training epoch: a fixed number of batches, each of subjects drawn with replacement, the last 33% of
every batch forced onto the foreground (nnunetv2 2.8.1: `nnUNetDataLoader`, `_oversample_last_XX_percent`,
`num_iterations_per_epoch`).

The sampler yields `(index, forced)` pairs; `datamodules.pipeline.draws.DrawDataset` hands `forced` to the item
(`FOREGROUND_KEY`), where `datamodules.pipeline.augmentation.ForegroundPatchd` reads it. The loader's batching keeps
the sampler's order, so the position of a pair in the batch is its position in the sampler's run of `batch_size`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler


def forced_positions(batch_size: int, foreground_ratio: float) -> list[bool]:
    """Per position in a batch, whether nnU-Net forces it onto the foreground: the last round(ratio x B) (its rule
    `not i < round(B * (1 - ratio))`, which gives 1 of 2 at 0.33)."""
    return [not i < round(batch_size * (1 - foreground_ratio)) for i in range(batch_size)]


class OversamplingSampler(DistributedSampler):
    """`iterations` batches of `batch_size` subjects drawn uniformly with replacement from this rank's dataset, as
    `(index, forced)` pairs (the forced positions per `forced_positions`); reseeded every epoch from `seed`, the
    epoch and the rank, so a resumed run draws what the uninterrupted one drew.

    A `DistributedSampler` (over the rank's own draws) so Lightning does not wrap it again.

    Args:
        dataset: this rank's training dataset.
        batch_size: samples per batch.
        iterations: batches per epoch.
        foreground_ratio: share of each batch forced onto the foreground.
        seed: base seed.
        rank: this process's rank.
    """

    def __init__(
        self, dataset: Dataset, batch_size: int, iterations: int, foreground_ratio: float, seed: int = 0,
        rank: int = 0,
    ) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
        self.batch_size, self.iterations = int(batch_size), int(iterations)
        self.forced = forced_positions(self.batch_size, foreground_ratio)
        self.draw_rank = int(rank)
        self.num_samples = self.total_size = self.iterations * self.batch_size

    def __iter__(self) -> Iterator[tuple[int, bool]]:
        generator = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch + 7919 * self.draw_rank)
        indices = torch.randint(len(self.dataset), (self.num_samples,), generator=generator).tolist()  # type: ignore[arg-type]
        return iter((index, self.forced[i % self.batch_size]) for i, index in enumerate(indices))

    def __len__(self) -> int:
        return self.num_samples
