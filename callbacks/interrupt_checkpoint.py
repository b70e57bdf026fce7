"""A stop (Ctrl-C, SIGTERM) during training saves where it stood and says how to go on."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import pytorch_lightning as pl
from lightning_fabric.plugins.environments import SLURMEnvironment
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import SIGTERMException

log = logging.getLogger("medvol")


class InterruptCheckpoint(pl.Callback):
    """On Ctrl-C (SIGINT) or SIGTERM during training, saves `<dirpath>/<filename>` and logs the command that
    continues the run: `python train.py ckpt_path=<run>/checkpoints/interrupted.ckpt` (a resume reads the run's own
    record, docs/reliability.md).

    SLURM's requeue is left as it is: Lightning saves its `hpc_ckpt_<n>.ckpt` on the requeue signal and the requeued
    job resumes from it (medvol.run.world.requeued_checkpoint). Ctrl-C reaches several ranks at different points, where
    a collective save could wait forever: there the command names the last epoch's checkpoint instead.

    Args:
        dirpath: the run's checkpoint folder.
        filename: the checkpoint's file name.
    """

    def __init__(self, dirpath: str, filename: str = "interrupted.ckpt") -> None:
        self.dirpath = Path(dirpath)
        self.filename = filename

    @staticmethod
    def requeued_by_slurm(trainer: pl.Trainer) -> bool:
        """The SIGTERM of a SLURM job that Lightning requeues (the test Lightning applies to its own handlers)."""
        environment = trainer._accelerator_connector.cluster_environment
        return isinstance(environment, SLURMEnvironment) and environment.auto_requeue

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.state.fn != TrainerFn.FITTING or not isinstance(exception, (KeyboardInterrupt, SIGTERMException)):
            return
        if isinstance(exception, SIGTERMException) and self.requeued_by_slurm(trainer):
            return
        path = self.dirpath / self.filename
        # Lightning stops every rank at the same batch on SIGTERM; one process has no one to wait for.
        if trainer.world_size == 1 or isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(path)
            saved = f"saved {path}"
        else:
            path = self.dirpath / "last.ckpt"
            saved = "the last epoch's checkpoint continues it"
        if not trainer.is_global_zero or (trainer.world_size > 1 and not path.is_file()):
            return
        stop = "Ctrl-C" if isinstance(exception, KeyboardInterrupt) else "SIGTERM"
        log.warning(
            "Stopped by %s in epoch %d (step %d); %s. To go on:\n  python train.py ckpt_path=%s",
            stop, trainer.current_epoch, trainer.global_step, saved, shlex.quote(str(path)),
        )
