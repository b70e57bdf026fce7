"""Runs are named by what they are: `outputs/<family>/runs/<stamp>` and `outputs/<family>/multiruns/<stamp>/<job>`,
the family the model config chosen (a preset's own name where it gives one), and a sweep job's folder its number and
overrides, made a safe folder name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from medvol.run.resolvers import MAX_FOLDER_NAME, job_folder, run_dir_of_checkpoint, sweep_name
from tests.conftest import CONF_DIR
from tests.doc_world import composed

STAMP = r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d"
FAMILIES = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_and_a_sweep_go_under_their_model_family(family, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = composed("train", [f"model={family}"])
    assert re.fullmatch(rf"outputs/{family}/runs/{STAMP}", str(Path(cfg.hydra.run.dir).relative_to(tmp_path)))
    assert re.fullmatch(rf"outputs/{family}/multiruns/{STAMP}", str(Path(cfg.hydra.sweep.dir).relative_to(tmp_path)))


def test_a_preset_names_its_own_folder_and_debug_runs_go_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "/outputs/debug/runs/" in composed("train", ["model=segmentation", "debug=fast"]).hydra.run.dir
    assert "/outputs/ldm_cpu/runs/" in composed("train", ["experiment=ldm_cpu"]).hydra.run.dir


def test_a_sweep_over_families_is_named_by_them_and_every_job_writes_into_it(tmp_path, monkeypatch):
    assert sweep_name("train", "vqgan", ["model=segmentation,classifier", "seed=1"]) == "segmentation+classifier"
    assert sweep_name("train", "vqgan", ["seed=1,2"]) == "vqgan"
    assert sweep_name("brats_segmentation", "segmentation", ["model=segmentation,classifier"]) == "brats_segmentation"
    # Hydra composes each job anew and hands it the launching process's resolved values (OmegaConf.copy_cache): a
    # job of another family still writes into the sweep's folder.
    monkeypatch.chdir(tmp_path)
    master = composed("train", [])
    folder = master.hydra.sweep.dir
    job = composed("train", ["model=segmentation"])
    OmegaConf.copy_cache(from_config=master, to_config=job)
    assert job.hydra.sweep.dir == folder and "/outputs/vqgan/multiruns/" in folder


def test_a_sweep_job_folder_carries_its_overrides_in_a_safe_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = composed("train", ["model.optimizer.lr=0.003", "model.n_hiddens=8", "dataset=nifti",
                             f"dataset.root={tmp_path}/scans", "ckpt_path=null", "trainer.devices=[0,1]",
                             "+callbacks.extra.note='a b*c'"])
    with open_dict(cfg):
        cfg.hydra.job.num = 4
    name = cfg.hydra.sweep.subdir
    # The swept value and its key; paths and switches left out; brackets, quotes and spaces made `_`.
    assert name.startswith("4_") and "model.optimizer.lr=0.003" in name and "model.n_hiddens=8" in name
    assert "dataset.root" not in name and "ckpt_path" not in name
    assert re.fullmatch(r"[A-Za-z0-9._,=+-]+", name), name
    long = job_folder(12, ",".join(f"model.key{i}=/a/../b c" for i in range(40)))
    assert len(long) == MAX_FOLDER_NAME and long.startswith("12_model.key0=_a_.._b_c")
    assert "/" not in long and job_folder(0, "") == "0"


def test_resume_finds_the_run_of_a_checkpoint_under_its_family(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "outputs" / "segmentation" / "runs" / "2026-01-01_00-00-00"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert run_dir_of_checkpoint(str(run / "checkpoints" / "last.ckpt")) == run
    cfg = composed("train", ["model=segmentation", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"])
    assert Path(cfg.hydra.run.dir) == run
