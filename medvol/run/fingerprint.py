"""Every run records in its checkpoints what its model saw of the training data, for `predict.py`."""

from __future__ import annotations

import pytorch_lightning as pl

from lightning_modules.base import MedvolModule


class RecordFingerprint(pl.Callback):
    """Sets the module's `training_data` from the datamodule's `fingerprint()` once the split is known.

    Lightning sets the datamodule up before the callbacks and restores a resumed checkpoint after
    them, so a resumed run keeps the record of its first start. Only rank 0 writes checkpoints, so
    only rank 0 reads the data for it.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        datamodule = trainer.datamodule
        if stage != "fit" or not trainer.is_global_zero or not isinstance(pl_module, MedvolModule):
            return
        if hasattr(datamodule, "fingerprint"):
            pl_module.training_data = datamodule.fingerprint()
