"""The one step axis of a run: scalars, images and checkpoint names all use it.

It is the step Lightning's loggers put on every scalar (`fit_loop.epoch_loop._batches_that_stepped`):
the training batches completed before the current one, counting only batches after which the
optimizers step under automatic optimization with gradient accumulation. For the VQ-GAN (manual
optimization) it counts batches: the generator's optimizer steps when nothing is accumulated.
`trainer.global_step` is not used: it counts every optimizer's steps, so it runs twice as fast
once a GAN's discriminator starts. The step is saved in checkpoints; a resumed run continues it.
"""

from __future__ import annotations

import pytorch_lightning as pl


def logging_step(trainer: pl.Trainer) -> int:
    """The step at which Lightning logs scalars right now."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def epoch_end_step(trainer: pl.Trainer) -> int:
    """In `on_train_epoch_end`: the step of the epoch's last training batch, where Lightning puts the epoch's
    `*_epoch` values and its validation (the counter has already moved past that batch)."""
    return max(0, logging_step(trainer) - 1)
