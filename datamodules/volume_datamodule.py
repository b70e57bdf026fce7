"""The LightningDataModule that every medvol dataset builds on: split, samplers and loaders."""

from __future__ import annotations

import os
from abc import abstractmethod
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from monai.data import DistributedSampler as EvaluationSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from datamodules.split import load_split, make_split, save_split
from medvol.errors import MedvolError

Record = dict[str, Any]


class VolumeDataModule(pl.LightningDataModule):
    """Subjects -> split -> datasets -> loaders, the same for every dataset.

    Subclasses list their subjects as records (`{"subject": id, ...}`) and turn a list of
    records into a Dataset whose items are batch dicts (`image`, `label`, `cond`, `time`,
    `event`, `subject`, `affine`, ...).

    Training uses a seeded `DistributedSampler` with `drop_last`, so every rank takes the
    same number of steps and the data order depends only on the seed and the epoch (which is
    what makes a resumed run identical to an uninterrupted one). Validation and testing
    partition the subjects without padding, so no subject is counted twice in a metric.

    Args:
        batch_size: per-device training batch size.
        val_batch_size: per-device evaluation batch size (defaults to `batch_size`).
        num_workers: DataLoader worker processes per device.
        pin_memory: pin host memory for faster copies to the GPU.
        persistent_workers: keep workers alive between epochs.
        val_fraction: share of subjects held out for validation.
        test_fraction: share of subjects held out for testing.
        split_seed: seed of the subject split.
        split_file: where the split is recorded; an existing file is reused, never rewritten.
        max_subjects: use only the first N subjects (quick runs).
        shuffle_seed: seed of the training order.
    """

    def __init__(
        self,
        batch_size: int = 1,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        split_seed: int = 0,
        split_file: str | None = None,
        max_subjects: int | None = None,
        shuffle_seed: int | None = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise MedvolError(f"`dataset.batch_size` must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.split_file = Path(split_file) if split_file else None
        self.max_subjects = max_subjects
        self.shuffle_seed = shuffle_seed or 0
        self.split: dict[str, list[str]] | None = None
        self.datasets: dict[str, Dataset] = {}

    @abstractmethod
    def subjects(self) -> list[Record]:
        """Every subject of the dataset, one record each, with a unique `subject` id."""

    @abstractmethod
    def build_dataset(self, records: list[Record], stage: str) -> Dataset:
        """A dataset over `records` for `stage` (train, val, test)."""

    def preflight(self) -> None:
        """Cheap checks of the data that run before the Trainer is built; file-based datasets override it."""

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is not None:
            return trainer.world_size, trainer.global_rank
        return 1, 0

    def _is_global_zero(self) -> bool:
        if self.trainer is not None:
            return self.trainer.is_global_zero
        return int(os.environ.get("RANK", "0")) == 0

    def setup(self, stage: str | None = None) -> None:
        if self.split is not None:
            return
        records = self.subjects()
        if self.max_subjects:
            records = records[: self.max_subjects]
        if not records:
            raise MedvolError("the dataset has no subjects; check `dataset.root` and the file pattern")
        ids = [str(r["subject"]) for r in records]
        if self.split_file is not None and self.split_file.is_file():
            self.split = load_split(self.split_file, ids)
        else:
            self.split = make_split(ids, self.val_fraction, self.test_fraction, self.split_seed)
            if self.split_file is not None and self._is_global_zero():
                save_split(self.split_file, self.split, self.split_seed)
        by_id = {str(r["subject"]): r for r in records}
        for name, members in self.split.items():
            self.datasets[name] = self.build_dataset([by_id[s] for s in members], name)

    def _loader(self, dataset: Dataset, batch_size: int, sampler: Any) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
            # An own generator keeps loader creation from consuming the global RNG (exact resume).
            generator=torch.Generator().manual_seed(self.shuffle_seed),
        )

    def train_dataloader(self) -> DataLoader:
        dataset = self.datasets["train"]
        world, rank = self._world()
        if len(dataset) < world * self.batch_size:
            raise MedvolError(
                f"the training split has {len(dataset)} subjects, fewer than one batch per device "
                f"({world} devices x batch_size {self.batch_size}); add data or lower `dataset.batch_size`"
            )
        sampler = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=self.shuffle_seed, drop_last=True
        )
        return self._loader(dataset, self.batch_size, sampler)

    def _evaluation_loader(self, stage: str) -> DataLoader:
        dataset = self.datasets[stage]
        if len(dataset) == 0:
            raise MedvolError(f"the {stage} split is empty; raise `dataset.{stage}_fraction` or add subjects")
        world, rank = self._world()
        sampler = EvaluationSampler(dataset, even_divisible=False, num_replicas=world, rank=rank, shuffle=False)
        return self._loader(dataset, self.val_batch_size, sampler)

    def val_dataloader(self) -> DataLoader:
        return self._evaluation_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._evaluation_loader("test")
