"""Ctrl-C or SIGTERM during training saves a checkpoint and prints the command that continues the run; it does."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.exceptions import SIGTERMException

from callbacks.interrupt_checkpoint import InterruptCheckpoint
from tests.conftest import ROOT, TINY, subprocess_env
from tests.ddp_support import RUN_TIMEOUT

RESUME = re.compile(r"^\s*(python train\.py ckpt_path=\S+)\s*$", re.MULTILINE)


def _interrupted_run(tmp_path: Path, signum: signal.Signals) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / "run"
    # 48 subjects: epochs of about 18 batches, long enough that a signal sent just after the first epoch's checkpoint
    # lands inside the second epoch's training.
    command = [sys.executable, str(ROOT / "train.py"), *TINY, "dataset.num_subjects=48", "trainer.max_epochs=3",
               "callbacks.volume_slices=null", f"hydra.run.dir={run_dir}"]
    env = subprocess_env(OMP_NUM_THREADS="1")
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + RUN_TIMEOUT
    while not list((run_dir / "checkpoints").glob("epoch000-*.ckpt")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)
    time.sleep(0.5)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=RUN_TIMEOUT)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), run_dir


# Two train.py processes, ~40 s.
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_run_prints_the_command_that_continues_it(tmp_path, signum):
    stopped, run_dir = _interrupted_run(tmp_path, signum)
    output = stopped.stdout + stopped.stderr
    (command,) = RESUME.findall(output)
    checkpoint = Path(shlex.split(command)[-1].removeprefix("ckpt_path="))
    assert checkpoint == run_dir / "checkpoints" / "interrupted.ckpt" and checkpoint.is_file(), output
    stopped_at = torch.load(checkpoint, weights_only=False)
    assert stopped_at["epoch"] == 1 and (run_dir / "train.log").read_text().count(command) == 1

    # The printed command as it stands, nothing added: it continues the same run to its 3 epochs.
    resumed = subprocess.run([sys.executable, str(ROOT / "train.py"), *shlex.split(command)[2:]], cwd=tmp_path,
                             env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                             timeout=RUN_TIMEOUT)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    epochs = [int(e) for e in re.findall(r"\] - epoch (\d+)/2 \|", resumed.stdout)]
    assert epochs and epochs[0] == stopped_at["epoch"] and epochs[-1] == 2, resumed.stdout[-3000:]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["epoch"] == 2


class _Trainer(SimpleNamespace):
    def save_checkpoint(self, path: Path) -> None:
        self.saved.append(Path(path))


def _trainer(**settings: Any) -> _Trainer:
    fields: dict[str, Any] = {"saved": [], "world_size": 1, "is_global_zero": True, "current_epoch": 2,
                              "global_step": 7, "state": SimpleNamespace(fn="fit"), "slurm_requeue": False}
    return _Trainer(**{**fields, **settings})


def test_only_a_stop_of_training_saves(tmp_path, monkeypatch):
    callback = InterruptCheckpoint(str(tmp_path))
    monkeypatch.setattr(InterruptCheckpoint, "requeued_by_slurm", staticmethod(lambda trainer: trainer.slurm_requeue))
    for exception, settings, saved in [
        (KeyboardInterrupt(), {}, True),
        (SIGTERMException(), {}, True),
        (RuntimeError("a bug"), {}, False),
        (KeyboardInterrupt(), {"state": SimpleNamespace(fn="test")}, False),
        # SLURM's own requeue (Lightning's hpc checkpoint and `scontrol requeue`) is left as it is.
        (SIGTERMException(), {"slurm_requeue": True}, False),
        # Ctrl-C reaches several ranks at different points: no collective save, the last epoch's checkpoint instead.
        (KeyboardInterrupt(), {"world_size": 2}, False),
    ]:
        trainer = _trainer(**settings)
        callback.on_exception(trainer, None, exception)  # type: ignore[arg-type]
        assert trainer.saved == ([tmp_path / "interrupted.ckpt"] if saved else []), (exception, settings)


def test_a_slurm_job_is_told_from_its_environment(monkeypatch):
    assert not InterruptCheckpoint.requeued_by_slurm(pl.Trainer(accelerator="cpu", logger=False))
    for name, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "42",
                        "SLURM_NODELIST": "node1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                        "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(name, value)
    assert InterruptCheckpoint.requeued_by_slurm(pl.Trainer(accelerator="cpu", logger=False))
