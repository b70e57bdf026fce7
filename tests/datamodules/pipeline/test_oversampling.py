"""nnU-Net's epoch (datamodules/pipeline/oversampling.py): a fixed number of batches drawn with replacement, the
last round(0.33 B) samples of every batch forced onto the foreground (nnunetv2's `_oversample_last_XX_percent`)."""

from __future__ import annotations

import torch
from monai.data import Dataset as TransformDataset
from torch.utils.data import DataLoader

from datamodules.pipeline.augmentation import FOREGROUND_KEY, ForegroundPatchd
from datamodules.pipeline.draws import DrawDataset
from datamodules.pipeline.oversampling import OversamplingSampler, forced_positions


def nnunet_forced(batch_size: int, percent: float = 0.33) -> list[bool]:
    """nnU-Net's rule as it reads (`nnUNetDataLoader._oversample_last_XX_percent`)."""
    return [not sample_idx < round(batch_size * (1 - percent)) for sample_idx in range(batch_size)]


def test_the_forced_positions_are_nnunets():
    for batch in range(1, 13):
        assert forced_positions(batch, 0.33) == nnunet_forced(batch)
    assert forced_positions(2, 0.33) == [False, True]  # one of two, not a third


def test_an_epoch_is_iterations_batches_drawn_with_replacement_and_reseeded_per_epoch():
    sampler = OversamplingSampler(list(range(5)), batch_size=3, iterations=7, foreground_ratio=0.33, seed=4)
    first = list(sampler)
    assert len(first) == len(sampler) == 21
    assert [forced for _, forced in first] == nnunet_forced(3) * 7
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
    counts = torch.bincount(torch.tensor([i for i, _ in first]), minlength=5)
    assert counts.sum() == 21 and counts.max() > 1  # with replacement


def test_every_batch_holds_its_forced_foreground_samples():
    """Through a real DataLoader: a subject whose foreground is one voxel far from the centre; the forced positions
    of every batch contain it, the others mostly not."""
    label = torch.zeros(1, 40, 40, 40, dtype=torch.int64)
    label[0, 3, 35, 30] = 1
    items = [{"image": torch.zeros(1, 40, 40, 40), "label": label} for _ in range(4)]
    crop = ForegroundPatchd(["image", "label"], "label", [8, 8, 8], [8, 8, 8], [[1]], 0.0, [0.0])
    dataset = DrawDataset(TransformDataset(items), crop)
    sampler = OversamplingSampler(dataset, batch_size=4, iterations=25, foreground_ratio=0.33, seed=0)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=True)
    expected = nnunet_forced(4)
    found = torch.zeros(4)
    for batch in loader:
        assert FOREGROUND_KEY not in batch
        found += (batch["label"].flatten(1) > 0).any(1).float()
    assert found.tolist()[expected.index(True):] == [25.0] * sum(expected)
    assert found[: expected.index(True)].max() < 5
