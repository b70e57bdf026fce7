"""A quiet, ordered console; train.log records every INFO line and the error that ended a run."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from rich.console import Console
from torch.utils.data import default_collate

from datamodules.sources.nifti import NiftiDataModule
from medvol.core.console import ConsoleFilter, print_config_tree, quiet_console
from medvol.volumes.prediction_writer import PredictionWriter
from tests.conftest import ROOT, TINY, compose_cfg, subprocess_env
from tests.medvol.run.test_predict_dicom import write_phantom_series


def _record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 0, message, None, None)


def test_console_filter_drops_library_chatter_and_keeps_what_matters():
    keep = ConsoleFilter().filter
    assert not keep(_record("pytorch_lightning.utilities.rank_zero", logging.INFO, "💡 Tip: try installing litlogger"))
    assert not keep(_record("pytorch_lightning.utilities.rank_zero", logging.INFO, "GPU available: False, used: False"))
    assert not keep(_record("py.warnings", logging.WARNING, "/x/site-packages/lightning/a.py:1: deprecated"))
    assert not keep(_record("monai.data.nvimgcodec_pydicom_plugin", logging.WARNING,
                            "nvImageCodec is not available; skipping pydicom decoder plugin registration."))
    assert keep(_record("py.warnings", logging.WARNING, "/work/medvol/train.py:1: UserWarning: mine"))
    assert keep(_record("pytorch_lightning.utilities.rank_zero", logging.INFO, "`Trainer.fit` stopped: `max_epochs=1`"))
    assert keep(_record("medvol", logging.INFO, "batch: 2 per device"))
    assert keep(_record("hydra.core.utils", logging.INFO, "Launching 2 jobs locally"))
    assert keep(_record("highdicom.base", logging.WARNING, "a warning is still shown"))


def test_other_libraries_info_lines_stay_off_the_console_and_in_the_log(tmp_path):
    """Issue 49 item 14: `output_format=dicom` printed nine highdicom INFO lines per DICOM-SEG written."""
    console, log = io.StringIO(), tmp_path / "predict.log"
    root = logging.getLogger()
    handlers = [logging.StreamHandler(console), logging.FileHandler(log)]
    level = root.level
    root.setLevel(logging.INFO)
    for handler in handlers:
        root.addHandler(handler)
    try:
        quiet_console()
        write_phantom_series(tmp_path / "scans" / "anon04" / "image", 16)
        datamodule = NiftiDataModule(root=str(tmp_path / "scans"), pattern="{subject}/{modality}",
                                     transforms={"orientation": "RAS", "intensity": "none", "spatial_size": None})
        batch = default_collate([datamodule.build_dataset(datamodule.subjects(), "test")[0]])
        outputs = {"volumes": {"seg": (batch["image"] > 300).long()}, "segments": {"brain": [1]}}
        PredictionWriter(tmp_path / "out", output_format="dicom").write(outputs, batch)
        logging.getLogger("medvol").info("predicted 1 subject")
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    assert (tmp_path / "out" / "anon04_seg.dcm").is_file()
    assert console.getvalue() == "predicted 1 subject\n"
    assert "copy attributes of module" in log.read_text() and "nvImageCodec is not available" in log.read_text()


def test_config_tree_shows_the_groups_resolved():
    console = Console(record=True, width=100)
    print_config_tree(OmegaConf.create({"model": {"lr": "${seed}"}, "seed": 3, "hydra": {"x": 1}}), console)
    text = console.export_text()
    assert "model" in text and "lr: 3" in text and "hydra" not in text


def _blocks(text: str) -> dict[str, str]:
    """Printed config -> {group: the group's lines without the name column}."""
    blocks: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.startswith(" "):
            name = line.split()[0]
            blocks[name] = []
            column = len(line) - len(line[len(name):].lstrip())
        blocks[name].append(line[column:])
    return {name: " ".join(lines) for name, lines in blocks.items()}


def test_the_default_config_print_is_compact_and_reads_back_as_the_composed_config(tmp_path):
    cfg = compose_cfg(tmp_path, tiny=False)
    console = Console(record=True, width=100)
    print_config_tree(cfg, console)
    text = console.export_text()
    # 67 lines since the hardware group holds `fit` (issue 60): one screen still.
    assert len(text.splitlines()) <= 68, text
    # Every block is flow-style YAML: read back, it is the composed config, every leaf value included.
    read_back = {name: yaml.safe_load("{" + body + "}") for name, body in _blocks(text).items()}
    composed = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k,
                v in cfg.items() if k != "hydra"}
    assert read_back.pop("config") == {k: v for k, v in composed.items() if not isinstance(v, dict)}
    assert read_back == {k: v for k, v in composed.items() if isinstance(v, dict)}
    assert all(len(line) <= 100 for line in text.splitlines() if "/" not in line)


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = subprocess_env(OMP_NUM_THREADS="1", COLUMNS="100")
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow
def test_console_order_and_train_log_of_a_real_command(tmp_path):
    args = [o for o in TINY if not o.startswith("callbacks.model_summary")]
    done = _cli([*args, "test=true"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout + done.stderr
    assert "💡" not in out and "GPU available" not in out and "site-packages" not in out
    assert "parameters per block" in out and "FLOPs" not in out
    # The start is a short summary (the whole config only with print_config=true), before the model summary.
    assert "\npaths " not in out and out.index("model    VQGAN <") < out.index("parameters per block")
    # The summary comes after the test table, last; paths are never folded inside a name.
    assert out.index("Test metric") < out.rindex("medvol run summary (test)")
    (run_dir,) = (tmp_path / "outputs" / "vqgan" / "runs").iterdir()
    assert f"run_dir          {run_dir}\n" in out
    log = (run_dir / "train.log").read_text()
    assert "GPU available" in log and "`Trainer.fit` stopped" in log and "model    VQGAN <" in log

    whole = _cli([*args, "trainer.fast_dev_run=true", "print_config=true"], tmp_path)
    assert whole.returncode == 0 and whole.stdout.index("\npaths ") < whole.stdout.index("model    VQGAN <")

    # Not a user error medvol knows (a negative codebook size fails inside torch): the traceback stays, and is logged.
    failed = _cli([*args, "model.n_codes=-3"], tmp_path)
    assert failed.returncode == 1
    failed_log = (max((tmp_path / "outputs" / "vqgan" / "runs").iterdir()) / "train.log").read_text()
    assert "run ended by" in failed_log and "Traceback" in failed_log
