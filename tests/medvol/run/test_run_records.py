"""Nothing a run wrote is overwritten by a later command; debug runs stay apart and save no checkpoints."""

from __future__ import annotations

import json
import subprocess

from medvol.run.training import run
from tests.conftest import ROOT


def test_a_test_only_run_keeps_the_training_summary(tiny_cfg, tmp_path):
    run(tiny_cfg("trainer.max_epochs=1"))
    trained = (tmp_path / "summary.json").read_text()
    assert "val/psnr" in json.loads(trained)["metrics"]
    run(tiny_cfg("train=false", "test=true", f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}"))
    assert (tmp_path / "summary.json").read_text() == trained
    (test_summary,) = tmp_path.glob("summary-test-*.json")
    assert "test/psnr" in json.loads(test_summary.read_text())["metrics"]


def test_debug_fast_runs_apart_and_writes_no_checkpoint(tiny_cfg, tmp_path):
    cfg = tiny_cfg("debug=fast")
    assert "/debug/runs/" in cfg.hydra.run.dir
    run(cfg)
    assert (tmp_path / "summary.json").exists()
    assert not list(tmp_path.rglob("*.ckpt"))


def test_make_help_lists_the_targets():
    shown = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0
    for target in ("setup", "train", "test", "test-slow", "lint", "clean"):
        assert f"make {target} " in shown.stdout
