"""The run's one step axis: optimizer steps of automatic optimization, counted as Lightning logs them."""

from __future__ import annotations

import pytorch_lightning as pl

from medvol.core.step import epoch_end_step, logging_step
from tests.tiny_trainer import TinyRegression, loader, tiny_trainer


class StepRecorder(pl.Callback):
    def __init__(self) -> None:
        self.at_batches: list[int] = []
        self.at_epoch_ends: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.at_batches.append(logging_step(trainer))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.at_epoch_ends.append(epoch_end_step(trainer))


def test_the_step_counts_optimizer_steps_under_gradient_accumulation(tmp_path):
    recorder = StepRecorder()
    # 6 batches an epoch, accumulated in pairs: the optimizer steps after batches 2, 4 and 6.
    trainer = tiny_trainer(tmp_path, max_epochs=2, accumulate_grad_batches=2, callbacks=[recorder])
    trainer.fit(TinyRegression(), loader(count=12, batch_size=2))
    assert recorder.at_batches == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_the_epoch_end_step_is_the_step_of_the_epochs_last_batch(tmp_path):
    recorder = StepRecorder()
    trainer = tiny_trainer(tmp_path, max_epochs=2, accumulate_grad_batches=2, callbacks=[recorder])
    trainer.fit(TinyRegression(), loader(count=12, batch_size=2))
    # Last batches of the epochs ran at steps 2 and 5 (see above); the counter has moved on to 3 and 6.
    assert recorder.at_epoch_ends == [2, 5]


def test_the_epoch_end_step_never_goes_below_zero(tmp_path):
    trainer = tiny_trainer(tmp_path)
    assert logging_step(trainer) == 0
    assert epoch_end_step(trainer) == 0
