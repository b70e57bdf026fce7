"""predict.py on the inputs a patient has: a diffusion model's outputs from its condition alone, N samples, bad
input."""

from __future__ import annotations

import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from datamodules.sources.phantom import make_phantom, phantom_affine
from medvol.core.errors import MedvolError
from medvol.run.predict_batch import SubjectsFailed
from medvol.run.predicting import predict
from tests.conftest import TINY_COMMON, TINY_MODEL, compose_cfg
from tests.medvol.run.test_predict import predict_cfg, saved_run
from tests.medvol.volumes.test_source_grid import LPS_AFFINE, SHAPE, write_brats_lps

SUBJECTS = 8


def ddpm_on_brats(run_dir: Path, data: Path, *overrides: str) -> Path:
    """A tiny Fast-DDPM trained and tested (`test=true`) on a BraTS folder, its config saved as train.py saves it."""
    common = [o for o in TINY_COMMON if not o.startswith("dataset.")]
    cfg = compose_cfg(run_dir, [
        *common, "model=ddpm", *TINY_MODEL["ddpm"], "dataset=brats", f"dataset.root={data}", "dataset.label=false",
        "dataset.transforms.spatial_size=[16,16,16]", "dataset.batch_size=2", "dataset.num_workers=0", "test=true",
        "logger=none", "callbacks.volume_slices=null", *overrides,
    ], tiny=False)
    return saved_run(run_dir, cfg)


def copy_modalities(brats: Path, target: Path, names: tuple[str, ...]) -> Path:
    """A copy of a BraTS 2021 folder with only the files of `names` (e.g. the condition modalities)."""
    for path in brats.glob("*/*.nii.gz"):
        if path.name.removesuffix(".nii.gz").rsplit("_", 1)[1] in names:
            (target / path.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target / path.parent.name / path.name)
    return target


@pytest.fixture(scope="module")
def translation_run(tmp_path_factory) -> Path:
    """T1 -> T2 on BraTS-layout LPS int16 scans, with the `test=true` samples in `<run>/predictions/`."""
    base = tmp_path_factory.mktemp("translation")
    data = write_brats_lps(base / "brats", SUBJECTS)
    return ddpm_on_brats(base / "run", data, "dataset.image_modalities=[t2]", "dataset.cond_modalities=[t1]")


def to_model_units(volume: np.ndarray, low: float, high: float) -> np.ndarray:
    return (volume - low) / (high - low) * 2 - 1


def test_a_condition_only_prediction_equals_the_test_true_sample_of_the_same_subject(translation_run, tmp_path):
    t1_only = copy_modalities(translation_run.parent / "brats", tmp_path / "t1", ("t1",))
    out = tmp_path / "out"
    # dataset=brats with the T1 files alone: the T2 (the target) is what the model is for.
    predict(predict_cfg(f"ckpt_path={translation_run}/checkpoints/last.ckpt", "dataset=brats",
                        f"dataset.root={t1_only}",
                        "split=test", "keep_crop=true", f"output_dir={out}"))
    tested = sorted((translation_run / "predictions").glob("*_sample.nii.gz"))
    written = sorted(p.name for p in out.iterdir() if p.name not in ("predict.log", ".predicted"))
    assert tested and written == [p.name for p in tested]
    record = torch.load(translation_run / "checkpoints" / "last.ckpt", weights_only=True)["medvol_data"]["intensity"]
    for path in tested:
        subject = path.name.removesuffix("_sample.nii.gz")
        # test=true wrote its sample in that subject's own T2 units (its 0.5/99.5 percentiles); the condition-only
        # sample is in the training targets' typical units (the checkpoint's median percentile ends).
        t2 = nib.load(str(translation_run.parent / "brats" / subject / f"{subject}_t2.nii.gz")).get_fdata()
        expected = to_model_units(nib.load(str(path)).get_fdata(), *np.percentile(t2, [0.5, 99.5]))
        written = nib.load(str(out / path.name))
        assert written.shape == SHAPE and np.allclose(written.affine, LPS_AFFINE)
        got = to_model_units(written.get_fdata(), record["low"][0], record["high"][0])
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def test_a_t1_to_t2_model_trained_on_the_phantoms_reads_brats_folders_holding_only_the_t1(tmp_path):
    """Issue 49 item 8: docs/predict.md's `dataset=brats dataset.root=/data/t1_only` for the default DDPM (phantom T1
    -> T2) was refused ("no `dataset.cond_modalities`"): BraTS's group file lists four image channels and no condition,
    the model one of each, named as BraTS names them."""
    run_dir = saved_run(tmp_path / "run", compose_cfg(tmp_path / "run", [
        "model=ddpm", *TINY_MODEL["ddpm"], "logger=none", "callbacks.volume_slices=null"]))
    t1_only = copy_modalities(write_brats_lps(tmp_path / "brats", 2), tmp_path / "t1_only", ("t1",))
    out = tmp_path / "out"
    predict(predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", "dataset=brats", f"dataset.root={t1_only}",
                        f"output_dir={out}"))
    for case in ("BraTS2021_00000", "BraTS2021_00001"):
        sample, t1 = nib.load(str(out / f"{case}_sample.nii.gz")), nib.load(str(t1_only / case / f"{case}_t1.nii.gz"))
        assert sample.shape == t1.shape and np.allclose(sample.affine, t1.affine)
        assert np.isfinite(sample.get_fdata()).all() and np.ptp(sample.get_fdata()) > 0


def test_t1_files_give_n_seeded_samples_with_their_mean_and_spread_on_each_files_grid(translation_run, tmp_path):
    inputs = tmp_path / "t1"
    inputs.mkdir()
    for path in sorted((translation_run.parent / "brats").glob("*/*_t1.nii.gz"))[:2]:
        shutil.copy(path, inputs / f"{path.parent.name}.nii.gz")
    ckpt = f"ckpt_path={translation_run}/checkpoints/last.ckpt"
    predict(predict_cfg(ckpt, f"input={inputs}", f"output_dir={tmp_path / 'one'}"))
    predict(predict_cfg(ckpt, f"input={inputs}", f"output_dir={tmp_path / 'three'}", "num_samples=3"))
    record = torch.load(translation_run / "checkpoints" / "last.ckpt", weights_only=True)["medvol_data"]["intensity"]
    for path in sorted(inputs.iterdir()):
        subject = path.name.removesuffix(".nii.gz")
        assert sorted(p.name for p in (tmp_path / "one").glob(f"{subject}_*")) == [f"{subject}_sample.nii.gz"]
        single = nib.load(str(tmp_path / "one" / f"{subject}_sample.nii.gz"))
        assert single.shape == SHAPE and np.allclose(single.affine, LPS_AFFINE)
        # In the training targets' typical units: within the recorded median percentile ends.
        assert record["low"][0] - 1e-3 <= single.get_fdata().min()
        assert single.get_fdata().max() <= record["high"][0] + 1e-3
        draws = np.stack([nib.load(str(tmp_path / "three" / f"{subject}_sample_{k}.nii.gz")).get_fdata()
                          for k in range(3)])
        # Draw 0 is the single sample; the others are other seeds.
        np.testing.assert_allclose(draws[0], single.get_fdata(), rtol=0, atol=1e-3)
        assert np.abs(draws[1] - draws[0]).max() > 1.0
        mean = nib.load(str(tmp_path / "three" / f"{subject}_sample_mean.nii.gz")).get_fdata()
        spread = nib.load(str(tmp_path / "three" / f"{subject}_sample_std.nii.gz")).get_fdata()
        np.testing.assert_allclose(mean, draws.mean(axis=0), rtol=0, atol=1e-3)
        np.testing.assert_allclose(spread, draws.std(axis=0, ddof=1), rtol=0, atol=1e-3)


def test_bad_condition_only_inputs_are_refused_before_anything_is_written(translation_run, tmp_path):
    ckpt = f"ckpt_path={translation_run}/checkpoints/last.ckpt"
    brats = translation_run.parent / "brats"
    t1_files = sorted(brats.glob("*/*_t1.nii.gz"))
    # A folder of T1 files whose last file has two channels: that file alone refused, the good files written (issue
    # 63 item 10: a bad subject is a failed row of the summary, not the end of the job).
    folder = tmp_path / "folder"
    folder.mkdir()
    for path in t1_files[:2]:
        shutil.copy(path, folder / path.name)
    two = np.stack([nib.load(str(t1_files[0])).get_fdata()] * 2, -1).astype(np.int16)
    nib.save(nib.Nifti1Image(two, LPS_AFFINE), str(folder / "z_two_channels.nii.gz"))
    t1_only = copy_modalities(brats, tmp_path / "t1", ("t1",))
    flair_only = copy_modalities(brats, tmp_path / "flair", ("flair",))
    # One case keeps its T2 but lost its T1: the others are condition-only, so it cannot be predicted.
    lost_t1 = copy_modalities(brats, tmp_path / "lost", ("t1",))
    case = sorted(lost_t1.iterdir())[0]
    shutil.copy(brats / case.name / f"{case.name}_t2.nii.gz", case)
    (case / f"{case.name}_t1.nii.gz").unlink()
    cases = [
        ([f"input={folder / 'z_two_channels.nii.gz'}"], "subject z_two_channels has 2 condition channels"),
        # The modality count: two condition modalities for a model trained on one.
        (["dataset=brats", f"dataset.root={brats}", "dataset.cond_modalities=[t1,t1ce]"], "has 2 condition channels"),
        (["dataset=brats", f"dataset.root={t1_only}", "dataset.cond_modalities=[t1,t1ce]"], "has no 't1ce' file"),
        # Folders without the condition files.
        (["dataset=brats", f"dataset.root={flair_only}"], r"holds none of the condition files \(t1\)"),
        (["dataset=brats", f"dataset.root={lost_t1}"], f"subject {case.name} has no 't1' file"),
    ]
    for number, (overrides, message) in enumerate(cases):
        out = tmp_path / f"out{number}"
        with pytest.raises(MedvolError, match=message):
            predict(predict_cfg(ckpt, *overrides, f"output_dir={out}"))
        assert not out.exists()
    with pytest.raises(SubjectsFailed, match="1 of 3 subjects failed .z_two_channels.*has 2 condition channels"):
        predict(predict_cfg(ckpt, f"input={folder}", f"output_dir={tmp_path / 'folder-out'}"))
    assert sorted(p.name for p in (tmp_path / "folder-out").glob("*_sample.nii.gz")) == \
        sorted(f"{p.name.removesuffix('.nii.gz')}_sample.nii.gz" for p in t1_files[:2])


@pytest.fixture(scope="module", params=["super_resolution", "denoising"])
def restoration_run(request, tmp_path_factory) -> tuple[str, Path]:
    """A tiny Fast-DDPM that makes its condition from the T2 (average-pooled, or with noise), as in training."""
    base = tmp_path_factory.mktemp(request.param)
    data = write_brats_lps(base / "brats", SUBJECTS)
    return request.param, ddpm_on_brats(base / "run", data, f"model.task={request.param}",
                                        "dataset.image_modalities=[t2]")


def test_a_coarse_scan_is_refined_to_the_training_spacing_and_a_noisy_one_denoised_on_its_grid(restoration_run,
                                                                                               tmp_path):
    task, run_dir = restoration_run
    t2 = next((run_dir.parent / "brats").glob("*/*_t2.nii.gz"))
    fine = nib.load(str(t2))
    # The same field of view at twice the voxel size (every other voxel), and the scan with noise added; both
    # stored 8x brighter than the training scans, so their own units and the training targets' differ.
    coarse_affine = fine.affine @ np.diag([2.0, 2.0, 2.0, 1.0])
    coarse_affine[:3, 3] += coarse_affine[:3, :3] @ np.full(3, -0.25)
    scans = tmp_path / "scans"
    scans.mkdir()
    raw = np.asarray(fine.dataobj).astype(np.float64) * 8
    nib.save(nib.Nifti1Image(raw[::2, ::2, ::2].astype(np.int16), coarse_affine), str(scans / "coarse.nii.gz"))
    noisy = raw + np.random.default_rng(0).normal(0, 160, SHAPE)
    nib.save(nib.Nifti1Image(noisy.astype(np.int16), fine.affine), str(scans / "noisy.nii.gz"))
    ckpt = f"ckpt_path={run_dir}/checkpoints/last.ckpt"
    spacing = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["medvol_data"]["spacing"]
    if task == "super_resolution":
        predict(predict_cfg(ckpt, f"input={scans / 'coarse.nii.gz'}", f"output_dir={tmp_path / 'out'}"))
        written = nib.load(str(tmp_path / "out" / "coarse_sample.nii.gz"))
        # At the training spacing (the model grid: RAS), over the coarse scan's field of view.
        np.testing.assert_allclose(written.header.get_zooms()[:3], spacing, rtol=1e-5)
        assert nib.aff2axcodes(written.affine) == ("R", "A", "S")
        extent = np.asarray(written.shape) * np.asarray(spacing)
        np.testing.assert_allclose(extent, np.asarray(SHAPE) * np.asarray(spacing), atol=2 * max(spacing))
        with pytest.raises(MedvolError, match="already at or finer than the training spacing"):
            predict(predict_cfg(ckpt, f"input={t2}", f"output_dir={tmp_path / 'fine'}"))
        assert not (tmp_path / "fine").exists()
        source = nib.load(str(scans / "coarse.nii.gz")).get_fdata()
    else:
        predict(predict_cfg(ckpt, f"input={scans / 'noisy.nii.gz'}", f"output_dir={tmp_path / 'out'}"))
        written = nib.load(str(tmp_path / "out" / "noisy_sample.nii.gz"))
        assert written.shape == SHAPE and np.allclose(written.affine, fine.affine)
        source = noisy
    # In the input's own units: within its 0.5 / 99.5 percentiles (what its scaling maps onto [-1, 1]).
    low, high = np.percentile(source, [0.5, 99.5])
    values = written.get_fdata()
    assert low - 1e-2 <= values.min() and values.max() <= high + 1e-2
    assert values.max() - values.min() > 0.2 * (high - low)


@pytest.mark.slow
def test_a_few_epochs_beat_the_identity_baseline_from_t1_files_alone(tmp_path):
    run_dir = saved_run(tmp_path / "run", compose_cfg(tmp_path / "run", [
        "model=ddpm", "dataset.num_subjects=32", "trainer.max_epochs=8", "logger=none", "callbacks.volume_slices=null",
    ]))
    inputs, size = tmp_path / "t1", 16
    inputs.mkdir()
    targets = {}
    # Withheld phantoms (indices past the 32 trained on): their T1 on disk, their T2 kept for the comparison.
    for index in range(1000, 1004):
        phantom = make_phantom(0, index, (size,) * 3)
        nib.save(nib.Nifti1Image(phantom.channels["t1"], phantom_affine((size,) * 3, 6.0)),
                 str(inputs / f"p{index}.nii.gz"))
        targets[f"p{index}"] = phantom
    predict(predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"input={inputs}",
                        f"output_dir={tmp_path / 'out'}"))
    high = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["medvol_data"]["intensity"]["high"][0]

    def psnr(a: np.ndarray, b: np.ndarray) -> float:
        return float(10 * np.log10(4.0 / np.mean((a - b) ** 2)))

    def unit(volume: np.ndarray, top: float) -> np.ndarray:
        # The phantoms' own scaling into model units: 0 -> -1, the 99.5th percentile (or `top`) -> 1.
        return np.clip(volume / top, 0, 1) * 2 - 1

    model, identity = [], []
    for subject, phantom in targets.items():
        target = unit(phantom.channels["t2"], np.percentile(phantom.channels["t2"], 99.5))
        sample = nib.load(str(tmp_path / "out" / f"{subject}_sample.nii.gz")).get_fdata()
        model.append(psnr(unit(sample, high), target))
        identity.append(psnr(unit(phantom.channels["t1"], np.percentile(phantom.channels["t1"], 99.5)), target))
    assert np.mean(model) > np.mean(identity) + 3.0, (model, identity)
