"""Lightning's Rich progress bar where stdout is a terminal, none where it is a file or a pipe."""

from __future__ import annotations

import sys

import pytorch_lightning as pl
from pytorch_lightning.callbacks import RichProgressBar


class TerminalProgressBar(RichProgressBar):
    """`RichProgressBar` (same arguments) that turns itself off when stdout is not a terminal (SLURM, nohup, a pipe).

    Rich draws only its last frame into a file; there the per-epoch lines (`callbacks/epoch_progress.py`) report
    progress. Being the run's progress bar callback, it also keeps Lightning from adding its TQDM bar.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not sys.stdout.isatty():
            self.disable()
        super().setup(trainer, pl_module, stage)
