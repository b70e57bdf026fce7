"""predict.py: whole volumes through sliding windows, outputs on the source grid and in source units, bad input
refused."""

from __future__ import annotations

import csv
import subprocess
import sys
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from datamodules.sources.nifti import NiftiDataModule
from datamodules.sources.phantom import make_phantom
from medvol.core.errors import MedvolError
from medvol.run.predicting import predict
from medvol.run.training import run
from medvol.volumes.prediction_writer import PredictionWriter
from medvol.volumes.sliding_window import SlidingWindow
from tests.conftest import CONF_DIR, ROOT, TINY_COMMON, TINY_MODEL, compose_cfg

# LPS-oriented (x and y flipped), anisotropic voxels, an odd shape: what a scanner export looks like.
LPS_AFFINE = np.array([[-1.2, 0, 0, 30.0], [0, -0.9, 0, 21.0], [0, 0, 2.5, -40.0], [0, 0, 0, 1]])
SHAPE = (22, 13, 18)


def write_lps_scans(root: Path, subjects: int, channels: int = 1) -> Path:
    """`<root>/<subject>/image.nii.gz`: int16 phantoms (T1-like, scaled to ~0..1000) on an LPS, anisotropic grid."""
    for i in range(subjects):
        phantom = make_phantom(0, i, SHAPE)
        # Channels with different ranges, so swapping their scalings would show.
        modalities = ("t1", "t2")[:channels]
        data = np.stack([phantom.channels[m] * (1000 + 500 * c) - 200 * c for c, m in enumerate(modalities)], -1)
        path = root / f"case{i:02d}" / "image.nii.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        nib.save(nib.Nifti1Image((data[..., 0] if channels == 1 else data).astype(np.int16), LPS_AFFINE), str(path))
    return root


def predict_cfg(*overrides: str) -> DictConfig:
    """The composed `predict` config, on the CPU, as the current Hydra job: predict.py reads the command line's
    own `dataset.*` overrides from it, as it does under `python predict.py`."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="predict"):
        cfg = compose(config_name="predict", overrides=["device=cpu", *overrides], return_hydra_config=True)
    HydraConfig().set_config(cfg)
    GlobalHydra.instance().clear()
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A tiny VQ-GAN trained on LPS int16 scans, tested with `test=true`; its config saved as train.py saves it."""
    base = tmp_path_factory.mktemp("predict")
    data = write_lps_scans(base / "scans", 8)
    run_dir = base / "run"
    common = [o for o in TINY_COMMON if not o.startswith("dataset.")]
    cfg = compose_cfg(run_dir, [
        *common, *TINY_MODEL["vqgan"], "dataset=nifti", f"dataset.root={data}",
        "dataset.transforms.spatial_size=[16,16,16]", "dataset.batch_size=2",
        "dataset.num_workers=0", "test=true", "logger=none", "callbacks.volume_slices=null",
    ], tiny=False)
    return saved_run(run_dir, cfg)


def saved_run(run_dir: Path, cfg: DictConfig) -> Path:
    """Train and test `cfg`, and save its config where train.py saves it."""
    run(cfg)
    (run_dir / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save({k: v for k, v in cfg.items() if k != "hydra"}, run_dir / ".hydra" / "config.yaml")
    return run_dir


def test_sliding_window_of_an_identity_net_equals_the_input_on_a_larger_non_divisible_volume():
    volume = torch.randn(1, 2, 19, 23, 13)
    seen: list[tuple[int, ...]] = []

    def identity(window: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(window.shape[2:]))
        return window.clone()

    out = SlidingWindow.of([8, 8, 8], overlap=0.25, mode="gaussian", batch_size=3)(identity, volume)
    assert out.shape == volume.shape
    # float32's own tolerances: the blend sums each voxel's windows in an order the CPU kernels choose (it moved by
    # 1.4e-6 after other tests had run on the same worker).
    torch.testing.assert_close(out, volume)
    # The network only ever sees windows of the training size, several of them.
    assert set(seen) == {(8, 8, 8)} and len(seen) > 1


def test_identity_output_is_written_on_the_lps_int16_source_grid_in_its_units(tmp_path):
    root = write_lps_scans(tmp_path / "scans", 1, channels=2)
    settings = {"orientation": "RAS", "intensity": "percentile", "percentiles": [0.0, 100.0],
                "spatial_size": [24, 16, 20]}
    datamodule = NiftiDataModule(root=str(root), transforms=settings)
    batch = torch.utils.data.default_collate([datamodule.build_dataset(datamodule.subjects(), "test")[0]])
    assert batch["image"].abs().max() <= 1.0  # model units
    PredictionWriter(tmp_path / "out").write({"volumes": {"reconstruction": batch["image"]}}, batch)

    out = nib.load(str(tmp_path / "out" / "case00_reconstruction.nii.gz"))
    source = nib.load(str(root / "case00" / "image.nii.gz"))
    assert out.shape == source.shape and np.allclose(out.affine, source.affine)
    written, raw = np.asarray(out.dataobj, dtype=np.float64), np.asarray(source.dataobj, dtype=np.float64)
    # Per channel (each has its own percentile bounds): within 1e-3 of that channel's range.
    for c in range(2):
        span = raw[..., c].max() - raw[..., c].min()
        assert np.abs(written[..., c] - raw[..., c]).max() <= 1e-3 * span


def test_a_volume_in_the_conditions_units_is_written_with_the_conditions_scaling(tmp_path):
    batch = {
        "subject": ["s"], "affine": torch.eye(4, dtype=torch.float64)[None],
        "intensity_low": torch.tensor([[0.0]]), "intensity_high": torch.tensor([[1000.0]]),
        "cond_intensity_low": torch.tensor([[-10.0]]), "cond_intensity_high": torch.tensor([[10.0]]),
        "intensity_range": torch.tensor([[-1.0, 1.0]]),
    }
    middle = torch.zeros(1, 1, 4, 4, 4)
    outputs = {"volumes": {"sample": middle, "condition": middle}, "units": {"condition": "cond"}}
    PredictionWriter(tmp_path).write(outputs, batch)
    assert np.allclose(nib.load(str(tmp_path / "s_sample.nii.gz")).get_fdata(), 500.0)
    assert np.allclose(nib.load(str(tmp_path / "s_condition.nii.gz")).get_fdata(), 0.0)


def test_predict_and_test_true_write_the_same_files(trained_run, tmp_path):
    out = tmp_path / "out"
    predict(predict_cfg(f"ckpt_path={trained_run}/checkpoints/last.ckpt", "split=test", "keep_crop=true",
                        f"output_dir={out}"))
    tested = sorted(p.name for p in (trained_run / "predictions").glob("*.nii.gz"))
    assert tested and sorted(p.name for p in out.glob("*.nii.gz")) == tested
    tested_subjects = {name.rsplit("_", 1)[0] for name in tested}
    for name in tested:
        a, b = nib.load(str(out / name)), nib.load(str(trained_run / "predictions" / name))
        assert a.shape == b.shape == SHAPE and np.array_equal(a.affine, b.affine)
        assert a.get_data_dtype() == b.get_data_dtype()
        np.testing.assert_allclose(a.get_fdata(), b.get_fdata(), rtol=0, atol=1e-3)
    # Issue 49 item 12: the VQ-GAN's test=true wrote no per-subject metrics; they are predict.py's, subject by subject.
    with (trained_run / "predictions" / "metrics.csv").open() as a, (out / "metrics.csv").open() as b:
        tested, predicted = list(csv.DictReader(a)), list(csv.DictReader(b))
    assert [r["subject"] for r in tested] == [r["subject"] for r in predicted] and len(tested) == len(tested_subjects)
    for t, p in zip(tested, predicted, strict=True):
        assert list(t) == ["subject", "psnr", "ssim"]
        assert float(t["psnr"]) == pytest.approx(float(p["psnr"]), abs=1e-3)
        assert float(t["ssim"]) == pytest.approx(float(p["ssim"]), abs=1e-4)


def test_a_dataset_chosen_by_name_lists_every_subject_and_keeps_the_runs_preprocessing(trained_run, tmp_path):
    out = tmp_path / "out"
    scans = trained_run.parent / "scans"
    # conf/dataset/nifti.yaml crops to 64^3: the run's own 16^3 must win, as the test=true files show.
    predict(predict_cfg(f"ckpt_path={trained_run}/checkpoints/last.ckpt", "dataset=nifti", f"dataset.root={scans}",
                        "keep_crop=true", f"output_dir={out}"))
    assert len(list(out.glob("*_reconstruction.nii.gz"))) == 8
    for tested in (trained_run / "predictions").glob("*.nii.gz"):
        np.testing.assert_allclose(nib.load(str(out / tested.name)).get_fdata(), nib.load(str(tested)).get_fdata(),
                                   atol=1e-3)


def test_predict_reconstructs_unseen_files_on_their_grid_with_per_subject_psnr(trained_run, tmp_path):
    scans = write_lps_scans(tmp_path / "new", 2)
    files = tmp_path / "inputs"
    files.mkdir()
    for i, path in enumerate(sorted(scans.glob("*/image.nii.gz"))):
        path.rename(files / f"scan{i}.nii.gz")
    metrics = predict(predict_cfg(
        f"ckpt_path={trained_run}/checkpoints/last.ckpt", f"input={files}", f"output_dir={tmp_path / 'out'}",
        "codes=true"
    ))
    for i in range(2):
        out = nib.load(str(tmp_path / "out" / f"scan{i}_reconstruction.nii.gz"))
        assert out.shape == SHAPE and np.allclose(out.affine, LPS_AFFINE)
        # Source units: the int16 scan's range (about 0..1000), not the model's [-1, 1].
        assert out.get_fdata().max() > 100
        codes = np.load(tmp_path / "out" / f"scan{i}_codes.npy")
        # The latent grid of the whole scan (downsample 4), indices into the 32-code book.
        assert codes.shape == tuple(n // 4 for n in SHAPE)
        assert np.issubdtype(codes.dtype, np.integer) and codes.min() >= 0 and codes.max() < 32
    rows = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
    assert rows[0] == "subject,psnr,ssim" and [r.split(",")[0] for r in rows[1:]] == ["scan0", "scan1"]
    assert np.isfinite(metrics["psnr"])


def test_a_model_trained_on_phantoms_reads_a_nifti_dataset_chosen_by_name(tmp_path):
    run_dir = saved_run(tmp_path / "run",
                        compose_cfg(tmp_path / "run", ["logger=none", "callbacks.volume_slices=null"]))
    scans = write_lps_scans(tmp_path / "scans", 2)
    predict(predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", "dataset=nifti", f"dataset.root={scans}",
                        f"output_dir={tmp_path / 'out'}"))
    for subject in ("case00", "case01"):
        assert nib.load(str(tmp_path / "out" / f"{subject}_reconstruction.nii.gz")).shape == SHAPE


@pytest.mark.parametrize("family", ["segmentation", "ddpm"])
def test_segmentation_and_diffusion_predictions_equal_their_test_outputs(tmp_path, family):
    overrides = [f"model={family}", "dataset.num_subjects=16", "test=true", "logger=none",
                 "callbacks.volume_slices=null"]
    run_dir = saved_run(tmp_path / "run", compose_cfg(tmp_path / "run", overrides))
    out = tmp_path / "out"
    predict(predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", "split=test", f"output_dir={out}"))
    tested = sorted(p.name for p in (run_dir / "predictions").iterdir())
    written = sorted(p.name for p in out.iterdir() if p.name not in ("predict.log", ".predicted"))
    assert len(tested) >= 2 and written == tested
    for name in tested:
        if name.endswith((".csv", ".html", ".png")):
            # The tables, the report page and its pictures (segmentation) byte for byte.
            assert (out / name).read_bytes() == (run_dir / "predictions" / name).read_bytes()
            continue
        a, b = nib.load(str(out / name)), nib.load(str(run_dir / "predictions" / name))
        assert a.get_data_dtype() == b.get_data_dtype() and np.array_equal(a.affine, b.affine)
        np.testing.assert_allclose(a.get_fdata(), b.get_fdata(), rtol=0, atol=1e-4)


@pytest.mark.parametrize(("family", "table", "column"),
                         [("survival", "risks.csv", "risk"), ("classifier", "probabilities.csv", "p1")])
def test_outcome_models_write_predictions_csv_rows_equal_to_the_test_tables(tmp_path, family, table, column):
    overrides = [f"model={family}", "dataset.num_subjects=16", "test=true", "logger=none",
                 "callbacks.volume_slices=null"]
    run_dir = saved_run(tmp_path / "run", compose_cfg(tmp_path / "run", overrides))
    predict(predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", "split=test", f"output_dir={tmp_path / 'out'}"))
    with (run_dir / "predictions" / table).open() as a, (tmp_path / "out" / "predictions.csv").open() as b:
        tested, predicted = list(csv.DictReader(a)), list(csv.DictReader(b))
    assert len(tested) == 2 and [r["subject"] for r in predicted] == [r["subject"] for r in tested]
    assert list(predicted[0]) == list(tested[0])
    for t, p in zip(tested, predicted, strict=True):
        assert float(p[column]) == pytest.approx(float(t[column]), abs=1e-5) and p["split"] == "predict"


def test_a_missing_input_is_one_line_and_exit_code_2(trained_run, tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "predict.py"), f"ckpt_path={trained_run}/checkpoints/last.ckpt",
         f"input={tmp_path / 'nothing.nii.gz'}", f"output_dir={tmp_path / 'out'}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"medvol: error: `input`: no NIfTI file or folder at {tmp_path / 'nothing.nii.gz'}; "
        "expected a .nii/.nii.gz file or a folder of them"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_command_line_transform_overrides_apply_to_a_dataset_chosen_by_name(trained_run, tmp_path):
    def command(out: Path, *extra: str) -> Path:
        subprocess.run(
            [sys.executable, str(ROOT / "predict.py"), f"ckpt_path={trained_run}/checkpoints/last.ckpt", "device=cpu",
             "dataset=nifti", f"dataset.root={trained_run.parent / 'scans'}", "keep_crop=true",
             f"output_dir={out}", *extra],
            check=True, capture_output=True, cwd=tmp_path, timeout=300,
        )
        return out

    tested = next((trained_run / "predictions").glob("*.nii.gz"))
    plain = nib.load(str(command(tmp_path / "plain") / tested.name)).get_fdata()
    changed = nib.load(str(command(tmp_path / "changed",
                                   "dataset.transforms.percentiles=[20,80]") / tested.name)).get_fdata()
    # Without overrides the run's own preprocessing (the test=true file); with one, that key changes.
    np.testing.assert_allclose(plain, nib.load(str(tested)).get_fdata(), atol=1e-3)
    assert np.abs(changed - plain).max() > 1.0


def test_predict_writes_a_log_beside_its_outputs_with_the_library_warnings_the_console_drops(
    trained_run, tmp_path, monkeypatch
):
    scans = write_lps_scans(tmp_path / "new", 1)
    real_write = PredictionWriter.write

    def write_after_a_library_warning(self, *args, **kwargs):
        # As a library would warn from its own file: the console filter drops warnings from site-packages.
        warnings.warn_explicit("resampling chatter", UserWarning, "/x/site-packages/library/module.py", 7)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(PredictionWriter, "write", write_after_a_library_warning)
    ckpt = f"ckpt_path={trained_run}/checkpoints/last.ckpt"
    predict(predict_cfg(ckpt, f"input={scans / 'case00' / 'image.nii.gz'}", f"output_dir={tmp_path / 'out'}"))
    text = (tmp_path / "out" / "predict.log").read_text()
    assert "site-packages/library/module.py:7: UserWarning: resampling chatter" in text
    assert "predicted 1 subject -> " in text and "last.ckpt on 1 subject(s) from input" in text
    # A refused command leaves no log (nor any other file) behind.
    with pytest.raises(MedvolError, match="roi"):
        predict(predict_cfg(ckpt, f"input={scans / 'case00' / 'image.nii.gz'}", f"output_dir={tmp_path / 'refused'}",
                            "roi=[8,8]"))
    assert not (tmp_path / "refused").exists()


def test_bad_input_is_refused_with_the_key_named(trained_run, tmp_path):
    ckpt = f"ckpt_path={trained_run}/checkpoints/last.ckpt"
    scans = write_lps_scans(tmp_path / "scans", 1)
    two_channels = write_lps_scans(tmp_path / "two", 1, channels=2)
    # Not medvol's: a Lightning-style checkpoint without medvol's model record, inside a run directory.
    foreign = trained_run.parent / "foreign" / "checkpoints" / "other.ckpt"
    foreign.parent.mkdir(parents=True)
    (foreign.parent.parent / ".hydra").mkdir()
    (foreign.parent.parent / ".hydra" / "config.yaml").write_text((trained_run / ".hydra" / "config.yaml").read_text())
    torch.save({"state_dict": {}, "loops": {}}, foreign)
    cases = [
        ([ckpt, f"input={scans}", f"output_dir={scans / 'out'}"], "`output_dir`"),
        ([ckpt, f"input={two_channels / 'case00' / 'image.nii.gz'}", f"output_dir={tmp_path / 'o1'}"],
         "has 2 image channels"),
        ([f"ckpt_path={foreign}", f"input={scans}", f"output_dir={tmp_path / 'o2'}"], "an unknown model"),
        ([f"ckpt_path={tmp_path / 'none.ckpt'}", f"input={scans}", f"output_dir={tmp_path / 'o3'}"],
         "`ckpt_path`: no file"),
        ([ckpt, f"output_dir={tmp_path / 'o4'}"], "`input` is not set"),
    ]
    for overrides, message in cases:
        with pytest.raises(MedvolError, match=message.replace("`", ".")):
            predict(predict_cfg(*overrides))
    assert not (scans / "out").exists()


def test_a_file_input_may_write_beside_itself_but_never_onto_an_input(trained_run, tmp_path):
    ckpt = f"ckpt_path={trained_run}/checkpoints/last.ckpt"
    scan = write_lps_scans(tmp_path / "scans", 1) / "case00" / "image.nii.gz"
    before = scan.read_bytes()
    # A folder inside the file's own folder, and that folder itself: no output is named like an input.
    for out in (scan.parent / "pred", scan.parent):
        predict(predict_cfg(ckpt, f"input={scan}", f"output_dir={out}"))
        assert (out / "image_reconstruction.nii.gz").is_file()
    assert scan.read_bytes() == before

    # An input that is (a link to) the very file an output would be: refused before anything is written.
    out = tmp_path / "out"
    out.mkdir()
    target = out / "image_reconstruction.nii.gz"
    target.write_bytes(before)
    link = tmp_path / "links" / "image.nii.gz"
    link.parent.mkdir()
    link.symlink_to(target)
    with pytest.raises(MedvolError,
                       match=r"`output_dir`: the output .*image_reconstruction.nii.gz would replace the input file"):
        predict(predict_cfg(ckpt, f"input={link}", f"output_dir={out}"))
    assert target.read_bytes() == before and sorted(p.name for p in out.iterdir()) == [target.name]


def test_predict_opens_the_checkpoint_and_the_runs_record_once(trained_run, tmp_path, monkeypatch):
    """Issue 62 item 1: predict's first stage (`medvol.run.trained_run`) reads the checkpoint and the run's record
    once and hands them on; no later stage reads either again."""
    import medvol.run.checkpoint_check as checkpoint_check
    import medvol.run.run_record as run_record

    reads: list[str] = []

    def counted(name, read):
        def wrapper(path, *args, **kwargs):
            reads.append(f"{name} {Path(path).name}")
            return read(path, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(checkpoint_check, "load_checkpoint", counted("checkpoint", checkpoint_check.load_checkpoint))
    monkeypatch.setattr(run_record, "read_json", counted("record", run_record.read_json))
    out = tmp_path / "out"
    predict(predict_cfg(f"ckpt_path={trained_run}/checkpoints/last.ckpt", "split=test", "keep_crop=true",
                        f"output_dir={out}"))
    assert list(out.glob("*_reconstruction.nii.gz"))
    assert sorted(reads) == ["checkpoint last.ckpt", "record run.json"]
