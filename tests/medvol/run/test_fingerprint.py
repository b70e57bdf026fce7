"""`RecordFingerprint`: a run's module holds its datamodule's record of the training data, once the split is known, on
rank 0, in fit only; a resumed run keeps the record of its first start (under a real `pl.Trainer`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_modules.base import DATA_KEY, MedvolModule
from medvol.run.fingerprint import RecordFingerprint
from tests.tiny_trainer import TinyRegression, loader, tiny_trainer


class TinyMedvol(MedvolModule, TinyRegression):
    """The one-weight regression as a medvol model family (its checkpoints carry `training_data`)."""


class RecordedData(pl.LightningDataModule):
    """Eight regression samples whose `fingerprint()` names the datamodule and counts its calls."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.calls = name, 0

    def fingerprint(self) -> dict[str, Any]:
        self.calls += 1
        return {"dataset": self.name, "intensity": {"low": -1000.0, "high": 1000.0, "range": [-1.0, 1.0]}}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return loader()

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return loader()


def _setup(datamodule: object, module: pl.LightningModule, stage: str = "fit", rank_zero: bool = True) -> None:
    trainer = SimpleNamespace(datamodule=datamodule, is_global_zero=rank_zero)
    RecordFingerprint().setup(trainer, module, stage)


def test_a_fit_on_rank_zero_records_the_datamodules_fingerprint():
    module, data = TinyMedvol(), RecordedData("brats")
    _setup(data, module)
    intensity = {"low": -1000.0, "high": 1000.0, "range": [-1.0, 1.0]}
    assert module.training_data == {"dataset": "brats", "intensity": intensity}
    assert data.calls == 1


def test_other_ranks_and_other_stages_leave_the_record_and_never_read_the_data():
    for stage, rank_zero in (("fit", False), ("validate", True), ("test", True), ("predict", True)):
        module, data = TinyMedvol(), RecordedData("brats")
        _setup(data, module, stage, rank_zero)
        assert module.training_data is None, (stage, rank_zero)
        assert data.calls == 0, (stage, rank_zero)


def test_a_datamodule_without_a_fingerprint_or_a_module_of_no_family_is_left_alone():
    module = TinyMedvol()
    _setup(SimpleNamespace(), module)
    assert module.training_data is None
    plain, data = TinyRegression(), RecordedData("brats")
    _setup(data, plain)
    assert not hasattr(plain, "training_data") and data.calls == 0


def test_the_record_is_saved_in_the_checkpoint_and_a_resumed_run_keeps_its_first_starts(tmp_path):
    first = tiny_trainer(tmp_path, callbacks=[RecordFingerprint()])
    first.fit(TinyMedvol(), datamodule=RecordedData("first start"))
    checkpoint = tmp_path / "first.ckpt"
    first.save_checkpoint(checkpoint)
    assert torch.load(checkpoint, weights_only=True)[DATA_KEY]["dataset"] == "first start"
    resumed = TinyMedvol()
    tiny_trainer(tmp_path, max_epochs=2, callbacks=[RecordFingerprint()]).fit(
        resumed, datamodule=RecordedData("data of the resume"), ckpt_path=str(checkpoint)
    )
    assert resumed.training_data["dataset"] == "first start"
    fresh = TinyMedvol()
    tiny_trainer(tmp_path, callbacks=[RecordFingerprint()]).fit(fresh, datamodule=RecordedData("fresh run"))
    assert fresh.training_data["dataset"] == "fresh run"
