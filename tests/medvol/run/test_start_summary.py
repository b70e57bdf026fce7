"""A quiet start: a short summary of the run before the first step; the whole config only with `print_config=true`."""

from __future__ import annotations

import logging

from datamodules.sources.example_data import write_brats
from medvol.run.start_summary import split_sizes, start_summary
from medvol.run.training import run
from medvol.run.world import World
from tests.conftest import TINY_COMMON, compose_cfg

HEADINGS = ("model", "data", "trainer", "monitor", "output")


def _start(caplog, capsys, cfg) -> tuple[list[str], str]:
    """The medvol lines logged before the first epoch, and what went straight to stdout."""
    with caplog.at_level(logging.INFO, logger="medvol"):
        run(cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "medvol"]
    first_epoch = next(i for i, line in enumerate(lines) if line.startswith("epoch 0"))
    return lines[:first_epoch], capsys.readouterr().out


def test_the_start_is_a_short_summary_of_the_run(tiny_cfg, tmp_path, caplog, capsys):
    cfg = tiny_cfg("callbacks.volume_slices=null")
    assert cfg.print_config is False
    start, out = _start(caplog, capsys, cfg)
    assert len(start) < 20, start
    summary = {line.split()[0]: line for line in start if line.split()[0] in HEADINGS}
    assert set(summary) == set(HEADINGS), start
    assert "VQGAN" in summary["model"] and "seed 42" in summary["model"]
    # 8 subjects, 1/8 each for validation and test.
    assert "8 subjects" in summary["data"] and "train 6, val 1, test 1" in summary["data"]
    assert "1 epoch" in summary["trainer"] and "32-true" in summary["trainer"] and "1 cpu" in summary["trainer"]
    assert "val/psnr (max)" in summary["monitor"]
    assert str(tmp_path) in summary["output"]
    # No config tree: its group column (`paths     root_dir: ...`) is not printed.
    assert "root_dir:" not in out and "_target_" not in out


def test_print_config_true_prints_the_whole_tree(tmp_path, caplog, capsys):
    cfg = compose_cfg(tmp_path, ["callbacks.volume_slices=null", "print_config=true"])
    _, out = _start(caplog, capsys, cfg)
    assert "root_dir:" in out and "_target_: lightning_modules.vqgan.vqgan.VQGAN" in out


def test_the_summary_names_the_plan_of_a_planned_run(tmp_path, caplog, capsys):
    write_brats(tmp_path / "brats", 8, year=2021, size=24)
    cfg = compose_cfg(tmp_path, [*(o for o in TINY_COMMON if not o.startswith("dataset.")), "model=segmentation",
                                 "dataset=brats", "dataset.label_regions=[WT,TC,ET]",
                                 f"dataset.root={tmp_path / 'brats'}",
                                 "model.plan.base_features=4", "model.plan.memory_budget_mib=64",
                                 "trainer.limit_train_batches=1", "trainer.limit_val_batches=1",
                                 "callbacks.volume_slices=null"], tiny=False)
    start, _ = _start(caplog, capsys, cfg)
    assert len(start) < 20, start
    summary = {line.split()[0]: line for line in start}
    assert set(HEADINGS) <= set(summary), start
    assert "Segmenter" in summary["model"] and "8 subjects" in summary["data"]
    assert any(line.startswith("plan: patch") for line in start), start


def test_the_summary_of_a_two_node_resume(tmp_path):
    cfg = compose_cfg(tmp_path, ["strategy=ddp", "trainer.precision=bf16-mixed", "dataset.fold=1"])
    cfg.ckpt_path = str(tmp_path / "checkpoints" / "last.ckpt")
    lines = start_summary(cfg, World("gpu", 4, 2), {"train": 5, "val": 2}, ["plan: patch 8x8x8"])
    assert len(lines) < 20 and "plan: patch 8x8x8" in lines
    summary = {line.split()[0]: line for line in lines}
    assert "7 subjects, train 5, val 2 (fold 1 of 5)" in summary["data"]
    assert "precision bf16-mixed, 4 gpu devices x 2 nodes, strategy DDPStrategy" in summary["trainer"]
    assert summary["resume"].endswith("last.ckpt")
    assert split_sizes(object()) == {}
