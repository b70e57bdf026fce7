"""The application end to end: every model config trains, resume is exact, bad input gets one clear line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from datamodules.sources.phantom import phantom_affine
from lightning_modules.ldm.first_stage import VQGAN_CLASS
from lightning_modules.vqgan.vqgan import VQGAN
from medvol.core.errors import MedvolError
from medvol.run.training import run
from tests.conftest import CONF_DIR, ROOT, TINY, compose_cfg, subprocess_env
from tests.lightning_modules.ldm.test_ldm import TINY_VQGAN, save_checkpoint

MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


# The classifier's AUROC needs both classes in the validation batch (a one-class set logs NaN): 2 of 8 subjects;
# the diffusion families' set metrics (MMD, MS-SSIM among samples) compare sets of at least two volumes (NaN below).
SETS = ["dataset.val_fraction=0.25", "dataset.batch_size=2"]
# Survival's C-index needs a comparable pair among the validation subjects (NaN, and a warning, without one).
EXTRA = {"classifier": ["dataset.val_fraction=0.25"], "survival": ["dataset.val_fraction=0.25"], "ldm": SETS,
         "ddpm": SETS}


def model_extra(model: str, tmp_path: Path) -> list[str]:
    """What a model needs beyond the tiny settings: a latent diffusion model a VQ-GAN checkpoint to encode with."""
    if model == "ldm":
        checkpoint = save_checkpoint(VQGAN(**TINY_VQGAN), tmp_path / "vqgan.ckpt", VQGAN_CLASS)
        return [*EXTRA[model], f"model.first_stage_ckpt={checkpoint}"]
    return EXTRA.get(model, [])


@pytest.mark.parametrize("model", MODELS)
def test_every_model_config_runs_fast_dev_run_on_synthetic(tiny_cfg, tmp_path, model):
    metrics = run(tiny_cfg(f"model={model}", "dataset=synthetic", "trainer.fast_dev_run=true",
                           *model_extra(model, tmp_path)))
    assert metrics, f"model={model} logged no metrics"
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


@pytest.mark.parametrize("model", MODELS)
def test_every_model_writes_checkpoints_that_read_as_data(tiny_cfg, tmp_path, model):
    # PyTorch's weights_only unpickler with no allowlist: a checkpoint of tensors and plain values only.
    # The survival family's monitored C-index needs an event among the validation subjects (issue 41 noted).
    survival = ["dataset.num_subjects=16", "dataset.val_fraction=0.5"] if model == "survival" else []
    run(tiny_cfg(f"model={model}", "dataset=synthetic", "trainer.limit_train_batches=1",
                 *model_extra(model, tmp_path), *survival))
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["medvol_model"].endswith(tuple(model_class_names(model)))
    assert checkpoint["hyper_parameters"] and checkpoint["state_dict"]


def test_an_old_checkpoint_resumes_with_the_opt_in_only_and_its_run_goes_on_plain(tiny_cfg, tmp_path):
    run(tiny_cfg("trainer.limit_train_batches=1", "trainer.limit_val_batches=1"))
    last = tmp_path / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    # As a medvol from before the rule wrote it: config nodes among the hyperparameters.
    checkpoint["hyper_parameters"]["downsample"] = OmegaConf.create(checkpoint["hyper_parameters"]["downsample"])
    torch.save(checkpoint, old := tmp_path / "checkpoints" / "old.ckpt")
    resume = ["trainer.max_epochs=2", "trainer.limit_train_batches=1", "trainer.limit_val_batches=1",
              f"ckpt_path={old}"]
    with pytest.raises(MedvolError, match=r"asks to load `omegaconf\.listconfig\.ListConfig`"):
        run(tiny_cfg(*resume))
    run(tiny_cfg(*resume, "trust_checkpoints=true"))
    assert torch.load(last, weights_only=True)["epoch"] == 1


def model_class_names(model: str) -> list[str]:
    """The class names a `model=` config group builds (its `_target_`'s last part)."""
    target = OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml").get("_target_")
    return [str(target).rsplit(".", 1)[-1]]


def test_resumed_run_matches_uninterrupted_run_and_keeps_the_codebook(tmp_path):
    common = [
        "seed=11",
        "trainer.deterministic=true",
        "logger=csv",
        "model.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:1,gamma:0.5}",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(compose_cfg(straight, [*common, "trainer.max_epochs=3"]))
    run(compose_cfg(resumed, [*common, "trainer.max_epochs=2"]))
    first = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    assert bool(first["state_dict"]["codebook.initialized"])
    run(compose_cfg(resumed, [*common, "trainer.max_epochs=3", f"ckpt_path={resumed}/checkpoints/last.ckpt"]))

    a = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    assert (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"])
    for key, value in a["state_dict"].items():
        assert torch.allclose(value.float(), b["state_dict"][key].float(), atol=1e-6), key
    for opt_a, opt_b in zip(a["optimizer_states"], b["optimizer_states"], strict=True):
        for sa, sb in zip(opt_a["state"].values(), opt_b["state"].values(), strict=True):
            assert torch.allclose(sa["exp_avg"], sb["exp_avg"], atol=1e-6)
    assert [s["_last_lr"] for s in a["lr_schedulers"]] == [s["_last_lr"] for s in b["lr_schedulers"]]
    assert a["lr_schedulers"][0]["_last_lr"][0] == pytest.approx(3e-4 * 0.5**3)
    # The metrics history of the first part of the run is still there.
    rows = (resumed / "csv" / "metrics.csv").read_text().splitlines()
    epochs = {line.split(",")[0] for line in rows[1:]}
    assert {"0", "1", "2"} <= epochs


def test_a_resume_checks_its_checkpoint_from_one_read(tiny_cfg, tmp_path, monkeypatch):
    """Issue 62 item 1: the family's check (before data) and the shapes' check (after planning) share one read of the
    checkpoint (Lightning then restores from the file itself)."""
    import medvol.run.checkpoint_check as checkpoint_check

    run(tiny_cfg("trainer.max_epochs=1"))
    read = checkpoint_check.load_checkpoint
    reads: list[str] = []
    monkeypatch.setattr(checkpoint_check, "load_checkpoint", lambda path, *a, **k: reads.append(path.name) or read(
        path, *a, **k))
    run(tiny_cfg("trainer.max_epochs=2", f"ckpt_path={tmp_path}/checkpoints/last.ckpt"))
    assert reads == ["last.ckpt"]


def test_split_is_by_subject_recorded_and_reused(tiny_cfg, tmp_path):
    run(tiny_cfg("trainer.fast_dev_run=true", "dataset.num_subjects=10"))
    split = json.loads((tmp_path / "split.json").read_text())
    members = [set(split[s]) for s in ("train", "val", "test")]
    assert sum(len(m) for m in members) == 10
    assert not (members[0] & members[1]) and not (members[0] & members[2]) and not (members[1] & members[2])
    # A second run in the same directory (a resume) reuses the file even if the seed changed.
    written = (tmp_path / "split.json").read_text()
    run(tiny_cfg("trainer.fast_dev_run=true", "dataset.num_subjects=10", "dataset.split_seed=99"))
    assert (tmp_path / "split.json").read_text() == written


def test_test_split_is_evaluated_with_the_best_checkpoint_and_alone(tiny_cfg, tmp_path):
    metrics = run(tiny_cfg("test=true", "trainer.max_epochs=2"))
    assert {"test/psnr", "test/ssim", "test/recon_loss"} <= set(metrics)
    # Reconstructions of the test subjects are NIfTI files on the source grid.
    (subject,) = json.loads((tmp_path / "split.json").read_text())["test"]
    written = nib.load(tmp_path / "predictions" / f"{subject}_reconstruction.nii.gz")
    assert written.shape == (16, 16, 16)
    assert np.allclose(written.affine, phantom_affine((16, 16, 16), 6.0))
    assert not list((tmp_path / "predictions").glob("*_input.nii.gz"))
    best = tmp_path / "checkpoints" / "last.ckpt"
    again = run(tiny_cfg("train=false", "test=true", f"ckpt_path={best}"))
    assert "test/psnr" in again and "val/psnr" not in again


def _last_checkpoint(tiny_cfg, tmp_path: Path) -> Path:
    run(tiny_cfg("trainer.max_epochs=1"))
    return tmp_path / "checkpoints" / "last.ckpt"


def test_bad_checkpoints_get_one_clear_error(tiny_cfg, tmp_path):
    with pytest.raises(MedvolError, match=r"`ckpt_path`: no file at .*missing\.ckpt"):
        run(tiny_cfg(f"ckpt_path={tmp_path}/missing.ckpt"))

    corrupt = tmp_path / "corrupt.ckpt"
    good = _last_checkpoint(tiny_cfg, tmp_path)
    corrupt.write_bytes(good.read_bytes()[:2000])
    with pytest.raises(MedvolError, match="is not a readable checkpoint"):
        run(tiny_cfg(f"ckpt_path={corrupt}"))

    other = torch.load(good, weights_only=True)
    other["medvol_model"] = "lightning_modules.survival.SurvivalResNet"
    foreign = tmp_path / "foreign.ckpt"
    torch.save(other, foreign)
    with pytest.raises(MedvolError, match="checkpoint of lightning_modules.survival.SurvivalResNet"):
        run(tiny_cfg(f"ckpt_path={foreign}"))

    with pytest.raises(MedvolError, match=r"codebook.embeddings of shape \(32, 8\).*gives \(64, 8\)"):
        run(tiny_cfg(f"ckpt_path={good}", "model.n_codes=64"))

    torch.save({"weights": 1}, plain := tmp_path / "plain.ckpt")
    with pytest.raises(MedvolError, match="not a Lightning training checkpoint"):
        run(tiny_cfg(f"ckpt_path={plain}"))


def test_unknown_key_value_or_group_gets_hydras_clear_error(tmp_path):
    with pytest.raises(ConfigCompositionException, match="modle"):
        compose_cfg(tmp_path, ["modle.lr=1"])
    with pytest.raises(MissingConfigException, match="vqgn"):
        compose_cfg(tmp_path, ["model=vqgn"])
    with pytest.raises(MedvolError, match="image_modalities.*'t3'"):
        run(compose_cfg(tmp_path, ["dataset.image_modalities=[t3]"]))


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = subprocess_env(OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


# ~40 s of two train.py processes: the slow suite (CI runs it); the in-process resume tests below stay fast.
@pytest.mark.slow
def test_command_line_trains_writes_the_run_directory_and_resumes_in_it(tmp_path):
    tiny = [o for o in TINY if not o.startswith("callbacks.progress_bar")]
    first = _cli([*tiny, "trainer.max_epochs=1"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    (run_dir,) = (tmp_path / "outputs" / "vqgan" / "runs").iterdir()
    for name in ("checkpoints/last.ckpt", "split.json", "summary.json", "train.log", ".hydra/config.yaml"):
        assert (run_dir / name).exists(), name
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples_per_second"] > 0 and "val/psnr" in summary["metrics"]
    assert "medvol run summary" in first.stdout
    # The phantoms are cached in memory by default: said once at start, recorded in the summary.
    choice = [line for line in (first.stdout + first.stderr).splitlines() if "dataset.cache=auto:" in line]
    assert len(choice) == 1 and "dataset.cache=auto: memory: this rank's 8 subjects" in choice[0], choice
    assert summary["cache"]["requested"] == "auto" and summary["cache"]["mode"] == "memory"
    assert summary["cache"]["estimate_mb"] > 0 and summary["cache"]["budget_mb"] > summary["cache"]["estimate_mb"]
    original_config = (run_dir / ".hydra" / "config.yaml").read_text()

    second = _cli([*tiny, "trainer.max_epochs=2", f"ckpt_path={run_dir}/checkpoints/last.ckpt"], tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert [p.name for p in (tmp_path / "outputs" / "vqgan" / "runs").iterdir()] == [run_dir.name]
    assert (run_dir / ".hydra" / "config.yaml").read_text() == original_config
    assert list((run_dir / ".hydra").glob("resume-*/config.yaml"))
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 1

    bad = _cli([*tiny, "ckpt_path=nowhere.ckpt"], tmp_path)
    assert bad.returncode == 2
    error_lines = [line for line in bad.stderr.splitlines() if "medvol: error" in line]
    assert len(error_lines) == 1 and "nowhere.ckpt" in error_lines[0]


@pytest.mark.slow  # several train.py processes, ~25 s
def test_help_and_cfg_job_work_as_hydra_users_expect(tmp_path):
    shown = _cli(["--help"], tmp_path)
    assert shown.returncode == 0 and "== Configuration groups ==" in shown.stdout
    assert re.search(r"^model: .*vqgan", shown.stdout, re.M) and re.search(r"^dataset: .*synthetic", shown.stdout, re.M)
    job = _cli(["--cfg", "job", "model.n_codes=99"], tmp_path)
    assert job.returncode == 0 and "n_codes: 99" in job.stdout
