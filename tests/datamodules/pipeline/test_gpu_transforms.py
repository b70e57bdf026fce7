"""Where `dataset.gpu_transforms=true` sends items, decided without a GPU: the device of the transform, not of a
tensor.

The tests in `tests/test_gpu.py` and `tests/datamodules/pipeline/test_data_cache.py` fetch real batches on a CUDA
machine; these check the same decision on any machine, from a stand-in Trainer whose root device is a GPU.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from monai.transforms import ToDeviced

from datamodules.sources.example_data import write_nifti_folder
from datamodules.sources.nifti import NiftiDataModule
from datamodules.sources.synthetic import SyntheticDataModule


def _trainer_on(device: str) -> SimpleNamespace:
    """The parts of a one-device Trainer a datamodule reads while it builds its datasets."""
    return SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device(device)), world_size=1, global_rank=0,
        is_global_zero=True, num_devices=1, callbacks=[],
    )


def _moves(dataset: object) -> list[torch.device]:
    """The devices of every `ToDeviced` step in a dataset's transform chain (datasets wrap datasets)."""
    found: list[torch.device] = []
    while dataset is not None:
        chain = getattr(getattr(dataset, "transform", None), "transforms", ())
        found += [torch.device(t.converter.device) for t in chain if isinstance(t, ToDeviced)]
        dataset = getattr(dataset, "data", None)
    return found


def _synthetic(gpu_transforms: bool = True) -> SyntheticDataModule:
    return SyntheticDataModule(num_subjects=8, size=8, gpu_transforms=gpu_transforms, val_fraction=0.25,
                               test_fraction=0.25)


def _nifti(root: Path) -> NiftiDataModule:
    return NiftiDataModule(root=str(root), image_modalities=["ct"], gpu_transforms=True, num_workers=0,
                           transforms={"spatial_size": [8, 8, 8], "flip_prob": 0.5})


@pytest.mark.parametrize("source", ["synthetic", "nifti"])
def test_gpu_transforms_move_every_split_to_the_trainers_device(tmp_path, source):
    datamodule = _synthetic() if source == "synthetic" else _nifti(write_nifti_folder(tmp_path / "ct", 6, 8,
                                                                                      label=False))
    datamodule.trainer = _trainer_on("cuda:1")
    datamodule.setup("fit")
    for split, dataset in datamodule.datasets.items():
        assert _moves(dataset) == [torch.device("cuda", 1)], split


def test_outside_a_trainer_the_device_is_the_current_gpu_with_its_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    datamodule = _synthetic()
    # `cuda` and `cuda:0` are the same GPU, but torch.device("cuda") != torch.device("cuda:0").
    assert datamodule.device() == torch.device("cuda:0")
    datamodule.setup("fit")
    assert _moves(datamodule.datasets["train"]) == [torch.device("cuda:0")]
    # A Trainer whose strategy reports `cuda` without an index gets the same normalisation.
    datamodule.trainer = _trainer_on("cuda")
    assert datamodule.device() == torch.device("cuda:0")


def test_without_gpu_transforms_items_stay_where_the_loader_makes_them():
    datamodule = _synthetic(gpu_transforms=False)
    datamodule.trainer = _trainer_on("cuda:0")
    datamodule.setup("fit")
    assert all(_moves(dataset) == [] for dataset in datamodule.datasets.values())
    assert datamodule.train_dataloader().__class__.__name__ == "DataLoader"
