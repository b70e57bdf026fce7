"""Checkpoint writes are atomic and durable: a failed write leaves the previous file, every run uses them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.strategies import DDPStrategy

import medvol.core.atomic_checkpoint as atomic_checkpoint
from medvol.core.atomic_checkpoint import AtomicCheckpointIO, checkpoint_io_plugins, partial_path
from medvol.run.training import run


class Unpicklable:
    """Fails while the checkpoint is being serialised, as a full disk or a bad callback state would."""

    def __reduce__(self):
        raise OSError("injected failure while writing")


def _checkpoint(step: int) -> dict:
    return {"global_step": step, "state_dict": {"weight": torch.full((64, 64), float(step))}}


def test_failed_write_leaves_the_previous_last_checkpoint_intact(tmp_path):
    target = tmp_path / "checkpoints" / "last.ckpt"
    writer = AtomicCheckpointIO()
    writer.save_checkpoint(_checkpoint(1), target)
    with pytest.raises(OSError, match="injected"):
        writer.save_checkpoint({**_checkpoint(2), "callbacks": Unpicklable()}, target)
    kept = torch.load(target, weights_only=True)
    assert kept["global_step"] == 1 and torch.equal(kept["state_dict"]["weight"], torch.ones(64, 64))
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"], "the partial file was left behind"
    writer.save_checkpoint(_checkpoint(3), target)
    assert torch.load(target, weights_only=True)["global_step"] == 3


def test_write_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        kind = "folder" if stat.S_ISDIR(os.fstat(descriptor).st_mode) else "file"
        synced.append(f"{kind}, target present: {target.exists()}")
        real_fsync(descriptor)

    monkeypatch.setattr(atomic_checkpoint.os, "fsync", recording_fsync)
    AtomicCheckpointIO().save_checkpoint(_checkpoint(1), target)
    assert synced == ["file, target present: False", "folder, target present: True"]


def test_partial_file_left_by_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "last.ckpt"
    stale = partial_path(tmp_path / "epoch000-step000004.ckpt")
    stale.write_bytes(b"PK\x03\x04 truncated")
    AtomicCheckpointIO().save_checkpoint(_checkpoint(1), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_strategy_with_its_own_checkpoint_io_keeps_it():
    assert [type(p) for p in checkpoint_io_plugins("auto")] == [AtomicCheckpointIO]
    assert [type(p) for p in checkpoint_io_plugins(DDPStrategy())] == [AtomicCheckpointIO]
    assert checkpoint_io_plugins(DDPStrategy(checkpoint_io=TorchCheckpointIO())) == []


def test_every_run_writes_its_checkpoints_atomically(tiny_cfg, tmp_path, monkeypatch):
    written: list[str] = []
    real_save = atomic_checkpoint.atomic_torch_save

    def recording_save(checkpoint: dict, target: Path) -> None:
        written.append(target.name)
        real_save(checkpoint, target)

    monkeypatch.setattr(atomic_checkpoint, "atomic_torch_save", recording_save)
    run(tiny_cfg("trainer.max_epochs=1", "trainer.limit_train_batches=1", "trainer.limit_val_batches=1",
                 "callbacks.volume_slices=null"))
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "last.ckpt" in files and sorted(written) == files
