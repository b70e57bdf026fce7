"""Training draws whose random transforms are seeded from (seed, epoch, rank, position in the epoch).

A transform's own generator (MONAI's `R`) seeded once, when the dataset is built, goes on from where the previous
epoch left it: a resumed run builds the dataset again and would draw epoch 0's augmentation in the epoch it resumes
in. Loader workers reseeded from the loader's generator start over the same way, and spread the draws over the
workers by their number. Seeding every draw from where it stands in the run makes epoch k's augmentation the same
after a resume, with any number of workers, persistent or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
from monai.data import Dataset as TransformDataset
from monai.transforms import apply_transform
from torch.utils.data import Dataset, DistributedSampler, Sampler

from datamodules.pipeline.augmentation import FOREGROUND_KEY


class Draw(NamedTuple):
    """One training item: its index, whether it is forced onto the foreground (None: the crop decides) and the seed
    of its random transforms."""

    index: int
    forced: bool | None
    seed: int


class SeededDraws(DistributedSampler):
    """`sampler`'s indices (or `(index, forced)` pairs) as `Draw`s, the n-th of epoch e on `rank` seeded from
    `np.random.SeedSequence([seed, e, rank])`'s n-th state.

    A `DistributedSampler` (over draws that already are this rank's) so Lightning does not wrap it again; its epoch
    reaches `sampler` too.

    Args:
        dataset: this rank's training dataset.
        sampler: the draws' order (it gives this rank's share).
        seed: base seed.
        rank: this process's rank.
    """

    def __init__(self, dataset: Dataset, sampler: Sampler, seed: int = 0, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=False, seed=seed)
        self.sampler, self.draw_rank = sampler, int(rank)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Draw]:
        keys = list(self.sampler)
        seeds = np.random.SeedSequence([self.seed, self.epoch, self.draw_rank]).generate_state(len(keys))
        for key, seed in zip(keys, seeds.tolist(), strict=True):
            index, forced = key if isinstance(key, tuple) else (key, None)
            yield Draw(int(index), forced, int(seed))

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


class DrawDataset(TransformDataset):
    """MONAI's `Dataset` over cached items with the random transforms, also taking `(index, forced)` pairs and
    `Draw`s: `forced` goes into the item as `FOREGROUND_KEY` before the random transforms run, a draw's seed seeds
    them."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, Draw):
            if self.transform is not None:
                self.transform.set_random_state(seed=key.seed)
            key = (key.index, key.forced)
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], bool | None):
            index, forced = key
            item = dict(self.data[index])
            if forced is not None:
                item[FOREGROUND_KEY] = forced
            return apply_transform(self.transform, item) if self.transform is not None else item
        return super().__getitem__(key)
