"""`logger=wandb` writes an offline run into the run directory (skipped where wandb is not installed)."""

from __future__ import annotations

import pytest

from medvol.run.training import run


def test_wandb_logger_writes_an_offline_run(tiny_cfg, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install -e '.[wandb]'")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run(tiny_cfg("logger=wandb", "trainer.fast_dev_run=true"))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
