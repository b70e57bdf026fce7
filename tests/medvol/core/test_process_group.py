"""A successful run has its process group destroyed at exit, before interpreter finalization (where gloo aborts)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

import medvol.core.process_group as process_group
from medvol.run.training import run

# One DDP rank still initialises a (gloo) process group, in this process.
ONE_RANK_DDP = ["strategy=ddp", "trainer.devices=1", "trainer.max_epochs=1", "trainer.limit_train_batches=1",
                "trainer.limit_val_batches=1", "callbacks.volume_slices=null"]


@pytest.fixture
def environment_restored():
    """A DDP run in this process leaves Lightning's rank variables (LOCAL_RANK, ...) in `os.environ`; tests after it
    would take this process for a rank a launcher started."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_successful_ddp_run_destroys_its_process_group_at_exit(tiny_cfg, monkeypatch, environment_restored):
    handlers = []
    monkeypatch.setattr(process_group.atexit, "register", handlers.append)
    monkeypatch.setitem(process_group._state, "registered", False)
    run(tiny_cfg(*ONE_RANK_DDP))
    # Kept for the next job of a sweep in the same processes (torchrun, srun) ...
    assert dist.is_initialized()
    assert process_group._release_if_succeeded in handlers, "nothing destroys the group at exit"
    # ... and destroyed by the exit handler, which Python runs before finalization.
    process_group._release_if_succeeded()
    assert not dist.is_initialized(), "the exit handler left the group to interpreter finalization"


def test_the_group_of_a_failed_run_is_left_alone_at_exit(monkeypatch):
    released = []
    monkeypatch.setattr(process_group, "release_process_group", lambda: released.append(True))
    monkeypatch.setitem(process_group._state, "registered", True)
    process_group.release_at_exit()
    process_group.run_started()  # a second job starts and fails: no release_at_exit
    process_group._release_if_succeeded()
    assert released == []
    process_group.release_at_exit()
    process_group._release_if_succeeded()
    assert released == [True]
