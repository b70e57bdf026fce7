"""A refusal that suggests a command gives one that works when pasted into a shell (issue 49, item 7 and the like).

Each test makes medvol refuse as a user's command would, takes the suggested command out of the one line, and runs
it with `bash -c` from where the user stood. The extras' `pip install -e '.[extra]'` lines are pasted in
tests/test_refusals.py. Descriptions that only name a command's shape (`python train.py -m ... dataset.fold=...`,
`srun` or `torchrun --nnodes ...`) are not commands to paste and are left out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from omegaconf import OmegaConf

from datamodules.sources.example_data import write_nifti_folder
from medvol.core.errors import MedvolError
from medvol.run import training
from medvol.run.override_check import override_error
from medvol.run.radiographs import in_view_frame
from medvol.run.run_check import check_dataset_settings
from tests.conftest import CONF_DIR, ROOT, compose_cfg, subprocess_env

pytestmark = pytest.mark.slow


def pasted(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` as a user pastes it: bash, the venv's python first on PATH."""
    env = subprocess_env(OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_data_checks_suggested_command_runs_the_full_check(tmp_path):
    """The overrides as docs/data.md types them, `{subject}` quoted for Hydra; one file truncated."""
    root = write_nifti_folder(tmp_path / "mr", 3, 12, modalities=("t1", "t2"), label=True)
    scan = root / "sub-001" / "t2.nii.gz"
    scan.write_bytes(scan.read_bytes()[:300])
    cfg = compose_cfg(tmp_path / "run", ["dataset=nifti", f"dataset.root={root}", "dataset.image_modalities=[t1,t2]",
                                         'dataset.label_file="{subject}/label.nii.gz"', "logger=none"], tiny=False)
    with pytest.raises(MedvolError) as refused:
        training.run(cfg)
    command = str(refused.value).split("run the full check for the whole table: ")[1]
    assert command.startswith("python check_data.py ")
    # From the folder the user ran train.py in: the repository.
    done = pasted(command, ROOT)
    # Exit status 1: the check ran and found the problem (2 would be a bad command, as before the quoting).
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "sub-001" in done.stdout and "1 problem(s) in 3 subject(s)" in done.stdout


def test_the_misspelt_key_refusals_listing_command_lists_the_keys(tmp_path):
    for root in ("train",):
        message = override_error(CONF_DIR, root, ["trainer.max_epochs=2", "modle.lr=1"])
        command = re.search(r"`(python [^`]+)` lists the keys", message).group(1)
        done = pasted(command, ROOT)
        assert done.returncode == 0, done.stderr
        assert "\nmodel:\n" in done.stdout and "\ntrainer:\n" in done.stdout


def test_predicts_misspelt_key_refusal_lists_predicts_keys():
    message = override_error(CONF_DIR, "predict", ["ckpt_path=x.ckpt", "outptu_dir=out"])
    command = re.search(r"`(python [^`]+)` lists the keys", message).group(1)
    done = pasted(command, ROOT)
    assert done.returncode == 0 and "\noutput_dir:" in done.stdout, done.stdout[-2000:]


def test_a_dataset_setting_refusals_listing_command_lists_that_datasets_settings(tmp_path):
    cfg = compose_cfg(tmp_path, ["dataset=brats", "dataset.root=/data", "+dataset.size=32"], tiny=False)
    with pytest.raises(MedvolError) as refused:
        check_dataset_settings(cfg)
    command = re.search(r"`(python [^`]+)` lists its config", str(refused.value)).group(1)
    done = pasted(command, ROOT)
    assert done.returncode == 0, done.stderr
    listed = OmegaConf.create(done.stdout.split("\n", 1)[1])  # after `# @package dataset`
    assert listed._target_ == "datamodules.sources.brats.BratsDataModule" and "size" not in listed


def test_a_radiograph_refusals_example_command_writes_radiographs_with_their_orientation(tmp_path):
    view = nib.Nifti1Image(np.zeros((8, 8), np.float32), None)
    view.header["sform_code"] = view.header["qform_code"] = 0
    with pytest.raises(MedvolError) as refused:
        in_view_frame(view, np.zeros((8, 8), np.float32), Path("p_ap.nii.gz"), "ap")
    command = re.search(r"as `(python [^`]+)` writes", str(refused.value)).group(1)
    done = pasted(command, tmp_path)
    assert done.returncode == 0, done.stderr
    written = sorted((tmp_path / command.split()[-1]).glob("*_ap.nii.gz"))
    assert written and int(nib.load(str(written[0])).header["sform_code"]) > 0
