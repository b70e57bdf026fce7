"""Learning rates logged as `lr/<optimizer name>` at the start of each training epoch, at the shared step."""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_only

from medvol.core.step import logging_step


def learning_rates(pl_module: pl.LightningModule, optimizers: list) -> dict[str, float]:
    """`lr/<name>` per optimizer (`lr/<name>/<group>` where it has several parameter groups).

    Names come from the module's `optimizer_names` (e.g. ("generator", "discriminator")),
    else `optimizer` / `optimizer_<i>`; a parameter group's `name` key names the group.
    """
    names = list(getattr(pl_module, "optimizer_names", ()))
    if len(names) != len(optimizers):
        names = ["optimizer"] if len(optimizers) == 1 else [f"optimizer_{i}" for i in range(len(optimizers))]
    rates = {}
    for name, optimizer in zip(names, optimizers, strict=True):
        groups = optimizer.param_groups
        for g, group in enumerate(groups):
            key = f"lr/{name}" if len(groups) == 1 else f"lr/{name}/{group.get('name', g)}"
            rates[key] = float(group["lr"])
    return rates


class LearningRates(pl.Callback):
    """Replaces Lightning's `LearningRateMonitor`, whose names (`lr-Adam`, `lr-Adam-1`) say nothing of the role.

    Only runs with a learning-rate schedule get the charts: a constant rate is a flat line, and
    it is in the HPARAMS tab already.
    """

    @rank_zero_only
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.lr_scheduler_configs:
            return
        rates = learning_rates(pl_module, trainer.optimizers)
        for logger in trainer.loggers:
            logger.log_metrics(rates, step=logging_step(trainer))
