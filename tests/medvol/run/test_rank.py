"""The entry point of ranks 1..N-1: run the saved config, one error line and exit 2, stop when rank 0 is gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

import medvol.run.rank as rank
from medvol.core.errors import MedvolError
from tests.conftest import ROOT, subprocess_env


@pytest.fixture
def saved_config(tmp_path, monkeypatch):
    """A config file as rank 0 saves it, and no parent watcher (the test process is its own parent)."""
    monkeypatch.setattr(rank, "_exit_with_parent", lambda parent_pid: None)
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create({"seed": 7, "model": {"name": "vqgan"}}), path)
    return path


def test_the_rank_runs_the_config_rank_zero_saved_and_exits_zero(saved_config, monkeypatch):
    received = []
    monkeypatch.setattr(rank, "run", lambda cfg, settled=False: received.append((cfg, settled)))
    assert rank.main([str(saved_config), str(os.getppid())]) == 0
    # Settled: rank 0 planned it (and chose hardware.fit's batch); this rank neither plans nor fits again.
    assert [(OmegaConf.to_container(cfg), settled) for cfg, settled in received] == [
        ({"seed": 7, "model": {"name": "vqgan"}}, True)]


def test_a_medvol_error_is_one_stderr_line_and_exit_code_two(saved_config, monkeypatch, capsys):
    def refuse(cfg, settled=False):
        raise MedvolError("`dataset.root` has no images")

    monkeypatch.setattr(rank, "run", refuse)
    assert rank.main([str(saved_config), "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "medvol: error: `dataset.root` has no images\n"
    assert captured.out == ""


# A real orphaned rank process (~10 s): the slow suite.
@pytest.mark.slow
def test_a_rank_whose_parent_is_gone_stops_with_one_line():
    # The child is told its rank 0 has a pid that is not its parent's, as after rank 0 died.
    gone = os.getpid() + 1_000_000
    script = f"import time, medvol.run.rank as r; r._exit_with_parent({gone}); time.sleep(30)"
    env = subprocess_env(RANK="1")
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert f"medvol: error: rank 0 (pid {gone}) is gone; rank 1 stops" in result.stderr
