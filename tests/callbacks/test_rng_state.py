"""`RNGState`: Python, NumPy and torch generators saved in the checkpoint and restored bit for bit."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from callbacks.rng_state import RNGState
from tests.tiny_trainer import TinyRegression, loader, tiny_trainer


def draws() -> tuple[float, list[float], list[float]]:
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


def scramble() -> None:
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)


def test_loading_the_saved_state_replays_the_same_numbers_from_every_generator():
    callback = RNGState()
    state = callback.state_dict()
    expected = draws()
    scramble()
    assert draws() != expected
    callback.load_state_dict(state)
    assert draws() == expected


class NoisyRegression(TinyRegression):
    """Draws from every generator in each training step, as a diffusion model draws its noise and time steps."""

    def __init__(self) -> None:
        super().__init__()
        self.noise: dict[int, list[tuple[float, list[float], list[float]]]] = {}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.noise.setdefault(self.current_epoch, []).append(draws())
        return super().training_step(batch, batch_idx)


@pytest.fixture(scope="module")
def straight_and_resumed(tmp_path_factory) -> tuple[NoisyRegression, NoisyRegression]:
    """Two epochs in one go, and the same run resumed from its checkpoint after the first epoch."""
    root = tmp_path_factory.mktemp("rng")
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    straight = NoisyRegression()
    saving = ModelCheckpoint(dirpath=root / "checkpoints", filename="{epoch}", save_top_k=-1)
    tiny_trainer(root, max_epochs=2, enable_checkpointing=True, callbacks=[RNGState(), saving]).fit(straight, loader())
    scramble()
    resumed = NoisyRegression()
    # As medvol resumes (medvol/run/fitting.py): the NumPy state is not a plain tensor.
    tiny_trainer(root, max_epochs=2, callbacks=[RNGState()]).fit(
        resumed, loader(), ckpt_path=root / "checkpoints" / "epoch=0.ckpt", weights_only=True)
    return straight, resumed


def test_a_resumed_run_restores_the_rng_state_bit_for_bit(straight_and_resumed):
    straight, resumed = straight_and_resumed
    assert list(resumed.noise) == [1]
    # Python, NumPy and torch draws of the second epoch's steps, as in the run that never stopped.
    assert resumed.noise[1] == straight.noise[1]
