"""A shared model is data (issue 36): a crafted checkpoint or run config placed where medvol reads one is refused in
one line, and none of it runs, wherever the file enters (predict, resume, a latent model's first stage, a cascade's
earlier stages and its hand-off). Resume's case is in tests/test_refusals.py ("crafted")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from lightning_modules.base import MODEL_KEY
from lightning_modules.ldm.first_stage import VQGAN_CLASS
from lightning_modules.xray2ct.earlier_stages import read_stage
from medvol.core.errors import MedvolError
from medvol.run.cascade import best_checkpoint
from medvol.run.predicting import predict
from medvol.run.trained_run import open_trained_run
from medvol.run.training import check_config
from tests.conftest import ROOT, TINY_MODEL, compose_cfg, subprocess_env
from tests.medvol.run.test_predict import predict_cfg, trained_run, write_lps_scans  # noqa: F401 - a fixture
from tests.payloads import crafted_checkpoint

ONE_LINE = r"asks to load `posix.system` when read; medvol reads checkpoints as data"


def run_folder(root: Path, config: dict | None = None) -> Path:
    """A run directory as train.py leaves one, its config composed from the real config groups (no training)."""
    cfg = compose_cfg(root, ["model=vqgan", *TINY_MODEL["vqgan"]])
    if config:
        OmegaConf.set_struct(cfg, False)
        cfg = OmegaConf.merge(cfg, config)
    (root / ".hydra").mkdir(parents=True)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    OmegaConf.save(cfg, root / ".hydra" / "config.yaml")
    (root / "checkpoints").mkdir()
    return root


def test_predict_refuses_a_crafted_checkpoint_in_a_genuine_run_folder_before_it_runs(tmp_path):
    run_dir = run_folder(tmp_path / "run")
    ckpt = crafted_checkpoint(run_dir / "checkpoints" / "last.ckpt", tmp_path / "ran", **{MODEL_KEY: VQGAN_CLASS})
    scans = write_lps_scans(tmp_path / "scans", 1) / "case00" / "image.nii.gz"
    with pytest.raises(MedvolError, match=ONE_LINE):
        predict(predict_cfg(f"ckpt_path={ckpt}", f"input={scans}", f"output_dir={tmp_path / 'out'}"))
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_predict_py_prints_the_refusal_alone(tmp_path):
    run_dir = run_folder(tmp_path / "run")
    ckpt = crafted_checkpoint(run_dir / "checkpoints" / "last.ckpt", tmp_path / "ran", **{MODEL_KEY: VQGAN_CLASS})
    scans = write_lps_scans(tmp_path / "scans", 1) / "case00" / "image.nii.gz"
    done = subprocess.run(
        [sys.executable, str(ROOT / "predict.py"), f"ckpt_path={ckpt}", f"input={scans}",
         f"output_dir={tmp_path / 'out'}", "device=cpu"],
        cwd=tmp_path, env=subprocess_env(OMP_NUM_THREADS="1"),
        capture_output=True, text=True, timeout=240,
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("medvol: error: `ckpt_path`: "), lines
    assert "`posix.system`" in lines[0]
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("key", "config"), [
    ("callbacks.evil", {"callbacks": {"evil": {"_target_": "os.system", "command": "touch ran"}}}),
    ("model", {"model": {"_target_": "subprocess.call", "args": ["touch", "ran"]}}),
    ("model.optimizer", {"model": {"optimizer": {"_target_": "torch.hub.load", "repo_or_dir": "x/y", "model": "z"}}}),
])
def test_predict_never_builds_a_class_an_old_run_config_names(tmp_path, monkeypatch, key, config):
    # A class that is not the one medvol's config builds at that key is the user's own: predict refuses it where it
    # would build it (the model) unless its command names one there, and never builds the rest (callbacks).
    monkeypatch.chdir(tmp_path)
    run_dir = run_folder(tmp_path / "run", config)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"never read")
    scans = write_lps_scans(tmp_path / "scans", 1) / "case00" / "image.nii.gz"
    refusal = (r"last\.ckpt is not a readable checkpoint" if key.startswith("callbacks") else
               rf"^{run_dir}/\.hydra/config\.yaml: the run built `{key}` from a class of your own; name it again")
    with pytest.raises(MedvolError, match=refusal):
        predict(predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"input={scans}",
                            f"output_dir={tmp_path / 'out'}"))
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_a_latent_models_first_stage_that_runs_a_command_is_refused_by_the_config_check(tmp_path):
    ckpt = crafted_checkpoint(tmp_path / "vqgan.ckpt", tmp_path / "ran", **{MODEL_KEY: VQGAN_CLASS})
    cfg = compose_cfg(tmp_path / "run", ["model=ldm", f"model.first_stage_ckpt={ckpt}", *TINY_MODEL["ldm"]])
    with pytest.raises(MedvolError, match=rf"^`model\.first_stage_ckpt`: {ckpt} {ONE_LINE}"):
        check_config(cfg)
    assert not (tmp_path / "ran").exists()


def test_an_earlier_cascade_stage_that_runs_a_command_is_refused(tmp_path):
    ckpt = crafted_checkpoint(tmp_path / "best.ckpt", tmp_path / "ran")
    with pytest.raises(MedvolError, match=rf"^`model\.previous_stages`: {ckpt} {ONE_LINE}"):
        read_stage(str(ckpt))
    assert not (tmp_path / "ran").exists()


def test_the_cascade_hand_off_refuses_a_stage_checkpoint_that_runs_a_command(tmp_path):
    stage = tmp_path / "stage1"
    (stage / "checkpoints").mkdir(parents=True)
    crafted_checkpoint(stage / "checkpoints" / "last.ckpt", tmp_path / "ran")
    with pytest.raises(MedvolError, match=ONE_LINE):
        best_checkpoint(stage)
    assert not (tmp_path / "ran").exists() and not (stage / "best.ckpt").exists()


def test_a_checkpoint_from_before_the_rule_needs_the_opt_in_and_predicts_with_it(trained_run, tmp_path):  # noqa: F811
    old = trained_run / "checkpoints" / "old-format.ckpt"
    checkpoint = torch.load(trained_run / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["hyper_parameters"]["downsample"] = OmegaConf.create(checkpoint["hyper_parameters"]["downsample"])
    torch.save(checkpoint, old)
    scans = write_lps_scans(tmp_path / "scans", 1) / "case00" / "image.nii.gz"
    common = [f"ckpt_path={old}", f"input={scans}"]
    with pytest.raises(MedvolError, match=r"asks to load `omegaconf\.listconfig\.ListConfig`.*trust_checkpoints=true"):
        predict(predict_cfg(*common, f"output_dir={tmp_path / 'refused'}"))
    assert not (tmp_path / "refused").exists()
    predict(predict_cfg(*common, f"output_dir={tmp_path / 'out'}", "trust_checkpoints=true"))
    assert (tmp_path / "out" / "image_reconstruction.nii.gz").is_file()


def test_settings_a_checkpoint_restores_may_not_name_a_target_either(tmp_path):
    # A latent model rebuilds its first stage from settings its checkpoint holds; Hydra would build a `_target_`
    # among them. The file itself is plain data (it passes the unpickler), so the settings are checked too.
    cfg = compose_cfg(tmp_path / "run", ["model=ldm", "model.first_stage_ckpt=null", *TINY_MODEL["ldm"]])
    ckpt = tmp_path / "ldm.ckpt"
    torch.save({MODEL_KEY: "lightning_modules.ldm.latent_diffusion.LatentDiffusion", "state_dict": {}, "loops": {},
                "hyper_parameters": {"first_stage_settings": {"_target_": "os.system",
                                                              "command": f"touch {tmp_path / 'ran'}"}}}, ckpt)
    refusal = rf"^{ckpt}: `hyper_parameters\.first_stage_settings\._target_` is a Hydra key"
    with pytest.raises(MedvolError, match=refusal):
        open_trained_run(str(ckpt), config=cfg).module(torch.device("cpu"))
    assert not (tmp_path / "ran").exists()
