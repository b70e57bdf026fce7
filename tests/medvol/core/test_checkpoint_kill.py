"""`kill -9` at any moment, inside a checkpoint write included, leaves a `last.ckpt` that resumes exactly.

A real `train.py` run is killed with SIGKILL several times (inside a write of `last.ckpt`
while an older one exists, inside any checkpoint write, right after the final epoch's
`last.ckpt`), resumed from
`last.ckpt` each time, and finally left to finish; its weights, optimizer state and step
must equal those of a run that was never interrupted. Checkpoint writes are slowed down by
`tests/slow_checkpoint_writes.py` so that the kills can land inside them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TINY, subprocess_env

pytestmark = pytest.mark.slow

COMMON = [
    "seed=11",
    "trainer.deterministic=true",
    "trainer.max_epochs=4",
    "logger=csv",
    "callbacks.volume_slices=null",
]
# A run that outlives this is a hang.
RUN_TIMEOUT = 240.0


def start(run_dir: Path, marker: Path, log: Path) -> subprocess.Popen:
    """`train.py` with slow checkpoint writes, resuming from the run's `last.ckpt` when there is one."""
    last = run_dir / "checkpoints" / "last.ckpt"
    resume = [f"ckpt_path={last}"] if last.exists() else []
    env = subprocess_env(OMP_NUM_THREADS="1", MEDVOL_TEST_WRITE_MARKER=str(marker))
    command = [sys.executable, str(ROOT / "tests" / "slow_checkpoint_writes.py"), str(ROOT / "train.py"),
               *TINY, *COMMON, f"hydra.run.dir={run_dir}", *resume]
    with log.open("a") as handle:
        handle.write(f"\n$ {' '.join(command)}\n")
        handle.flush()
        return subprocess.Popen(command, cwd=run_dir.parent, env=env, stdout=handle, stderr=subprocess.STDOUT)


def kill_when(process: subprocess.Popen, moment: Callable[[], bool]) -> bool:
    """SIGKILL `process` as soon as `moment()` holds; False when it finished first."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while process.poll() is None:
        if moment():
            process.send_signal(signal.SIGKILL)
            process.wait()
            return True
        assert time.monotonic() < deadline, "the run hung"
        time.sleep(0.01)
    return False


def loadable_last(run_dir: Path) -> dict | None:
    """The run's `last.ckpt` (it must load whenever it exists), or None before the first one."""
    last = run_dir / "checkpoints" / "last.ckpt"
    return torch.load(last, map_location="cpu", weights_only=True) if last.exists() else None


def test_sigkill_inside_checkpoint_writes_and_after_the_last_one_resumes_exactly(tmp_path):
    # The reference run goes the same way as the killed ones (the same script, one thread): an
    # in-process run with another thread count sums in another order and is not bit-identical.
    straight = tmp_path / "straight"
    reference = start(straight, tmp_path / "straight-writing", tmp_path / "straight.log")
    assert reference.wait(timeout=RUN_TIMEOUT) == 0, (tmp_path / "straight.log").read_text()[-5000:]
    expected = torch.load(straight / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)

    run_dir, marker, log = tmp_path / "killed", tmp_path / "writing", tmp_path / "killed.log"
    last = run_dir / "checkpoints" / "last.ckpt"
    def final_epoch_saved() -> bool:
        try:
            return last.exists() and torch.load(last, map_location="cpu", weights_only=True)["epoch"] == 3
        except (OSError, RuntimeError, EOFError, KeyError):
            return False

    moments: list[tuple[str, Callable[[], bool]]] = [
        # Replacing an existing last.ckpt: the case an in-place write loses.
        ("inside a write of last.ckpt",
         lambda: last.exists() and marker.exists() and "last.ckpt" in marker.read_text()),
        ("inside any checkpoint write", marker.exists),
        ("right after the final epoch's last.ckpt", final_epoch_saved),
    ]
    kills = []
    for what, moment in moments:
        marker.unlink(missing_ok=True)
        before = loadable_last(run_dir)
        process = start(run_dir, marker, log)
        if kill_when(process, moment):
            after = loadable_last(run_dir)
            kills.append(f"{what}: epoch {None if before is None else before['epoch']} -> "
                         f"{None if after is None else after['epoch']}")
    process = start(run_dir, marker, log)
    assert process.wait(timeout=RUN_TIMEOUT) == 0, log.read_text()[-5000:]
    assert len(kills) == 3, f"not every kill landed: {kills}"

    resumed = loadable_last(run_dir)
    assert (resumed["epoch"], resumed["global_step"]) == (expected["epoch"], expected["global_step"]), kills
    for key, value in expected["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), f"{key} differs after the kills {kills}"
    for opt_a, opt_b in zip(expected["optimizer_states"], resumed["optimizer_states"], strict=True):
        for state_a, state_b in zip(opt_a["state"].values(), opt_b["state"].values(), strict=True):
            assert all(torch.equal(state_a[k], state_b[k]) for k in state_a), kills
    assert not list((run_dir / "checkpoints").glob(".*")), "partial files left behind"
