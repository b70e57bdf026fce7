"""The training resolution travels with the model: runs record their data's fingerprint, predict.py resamples there."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from scipy import ndimage

from datamodules.sources.nifti import NiftiDataModule
from medvol.core.errors import MedvolError
from medvol.run.predict_config import input_geometry
from medvol.run.predict_inputs import file_dataset
from medvol.run.predicting import predict
from medvol.volumes.source_grid import to_source_grid
from tests.conftest import compose_cfg
from tests.medvol.run.test_predict import predict_cfg, saved_run


def rotation(degrees_z: float, degrees_x: float) -> np.ndarray:
    a, b = np.deg2rad(degrees_z), np.deg2rad(degrees_x)
    about_z = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
    about_x = np.array([[1, 0, 0], [0, np.cos(b), -np.sin(b)], [0, np.sin(b), np.cos(b)]])
    return about_z @ about_x


def smooth_volume(shape: tuple[int, int, int]) -> np.ndarray:
    z, y, x = np.meshgrid(*[np.linspace(0, 1, n) for n in shape], indexing="ij")
    return ((np.sin(3 * z) + np.cos(4 * y) * x + 2 * z * y) * 100).astype(np.float32)


def inside(mapping: np.ndarray, shape: tuple[int, ...], of: tuple[int, ...]) -> np.ndarray:
    """Voxels of a grid of `shape` whose position under `mapping` (voxel -> voxel) lies within a grid of `of`."""
    index = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), -1).reshape(-1, 3)
    coords = index @ mapping[:3, :3].T + mapping[:3, 3]
    return np.all((coords >= 0) & (coords <= np.asarray(of) - 1), axis=1).reshape(shape)


def test_an_oblique_anisotropic_scan_is_resampled_to_the_recorded_spacing_and_back_as_scipy_does(tmp_path):
    shape = (30, 24, 14)
    data = smooth_volume(shape)
    affine = np.eye(4)
    # Rotated 25 and 10 degrees, x flipped, 1.3 x 0.8 x 2.1 mm voxels.
    affine[:3, :3] = rotation(25, 10) @ np.diag([-1.3, 0.8, 2.1])
    affine[:3, 3] = [10.0, -20.0, 5.0]
    scan = tmp_path / "oblique.nii.gz"
    nib.save(nib.Nifti1Image(data, affine), str(scan))
    run = OmegaConf.create({"dataset": {"transforms": {"intensity": "none"}}})
    record = {"spacing": [1.7, 1.1, 1.5], "orientation": "RAS"}
    item = file_dataset([scan], run, None, tmp_path / "inputs.csv", input_geometry(None, record)).dataset[0]

    model_affine = item["affine"].numpy()
    model = item["image"][0].numpy()
    assert nib.aff2axcodes(model_affine) == ("R", "A", "S")
    np.testing.assert_allclose(np.linalg.norm(model_affine[:3, :3], axis=0), record["spacing"], rtol=1e-5)
    # The model grid's voxel values are the scan's, linearly interpolated at the same world points (scipy).
    forward = np.linalg.inv(affine) @ model_affine
    expected = ndimage.affine_transform(data, forward[:3, :3], forward[:3, 3], output_shape=model.shape, order=1)
    covered = inside(forward, model.shape, shape)
    assert covered.mean() > 0.5
    np.testing.assert_allclose(model[covered], expected[covered], rtol=0, atol=1e-4 * np.ptp(data))

    # And back onto the scan's own grid, as the writer maps outputs.
    back = to_source_grid(item["image"], (item["source_affine"], item["source_shape"]), item["affine"],
                          "linear")[0].numpy()
    backward = np.linalg.inv(model_affine) @ affine
    expected_back = ndimage.affine_transform(model, backward[:3, :3], backward[:3, 3], output_shape=shape, order=1)
    covered_back = inside(backward, shape, model.shape)
    assert covered_back.mean() > 0.5
    np.testing.assert_allclose(back[covered_back], expected_back[covered_back], rtol=0, atol=1e-4 * np.ptp(data))


def test_the_nifti_fingerprint_is_the_median_reoriented_spacing_and_the_median_percentile_ends(tmp_path):
    spacings = [(1.0, 2.0, 3.0), (1.5, 2.0, 2.0), (1.2, 0.9, 4.0), (2.0, 1.0, 1.0)]
    # Stored axes: as is, permuted (a sagittal export) and flipped, so reorientation moves the zooms around.
    permutations = [(0, 1, 2), (2, 0, 1), (0, 1, 2), (1, 2, 0)]
    expected_zooms, ends = [], []
    for i, (zooms, order) in enumerate(zip(spacings, permutations, strict=True)):
        axes = np.eye(3)[:, order] * np.asarray([-1, 1, 1])[:, None]
        affine = np.eye(4)
        affine[:3, :3] = axes * np.asarray(zooms)
        data = smooth_volume((12, 10, 8)) * (i + 1) + 50 * i
        image = nib.Nifti1Image(data, affine)
        nib.save(image, str(tmp_path / f"case{i}.nii.gz"))
        expected_zooms.append(nib.as_closest_canonical(image).header.get_zooms()[:3])
        ends.append(np.percentile(data, [0.5, 99.5]))
    datamodule = NiftiDataModule(
        root=str(tmp_path), pattern="{subject}.nii.gz", image_modalities=["image"], files={"image": "{subject}.nii.gz"},
        val_fraction=0.0, test_fraction=0.0,
    )
    datamodule.setup("fit")
    record = datamodule.fingerprint()
    assert record["orientation"] == "RAS" and record["subjects"] == 4
    np.testing.assert_allclose(record["spacing"], np.median(expected_zooms, axis=0), rtol=1e-6)
    assert record["intensity"]["mode"] == "percentile" and record["intensity"]["range"] == [-1.0, 1.0]
    np.testing.assert_allclose(record["intensity"]["low"], [np.median([e[0] for e in ends])], rtol=1e-4)
    np.testing.assert_allclose(record["intensity"]["high"], [np.median([e[1] for e in ends])], rtol=1e-4)


@pytest.fixture(scope="module")
def phantom_run(tmp_path_factory) -> Path:
    """A tiny VQ-GAN trained on the synthetic phantoms (16^3 at 6 mm), its config saved as train.py saves it."""
    run_dir = tmp_path_factory.mktemp("phantoms") / "run"
    return saved_run(run_dir, compose_cfg(run_dir, ["logger=none", "callbacks.volume_slices=null"]))


def test_a_run_records_the_phantoms_spacing_and_predict_resamples_there_native_or_as_asked(phantom_run, tmp_path):
    checkpoint = torch.load(phantom_run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["medvol_data"]["spacing"] == [6.0, 6.0, 6.0] and checkpoint["medvol_data"]["orientation"] == "RAS"
    # A 2 mm scan 96 x 80 x 64 mm wide: the model sees it at 6 mm unless told otherwise.
    scan = tmp_path / "scans" / "head.nii.gz"
    scan.parent.mkdir()
    nib.save(nib.Nifti1Image(smooth_volume((48, 40, 32)), np.diag([-2.0, 2.0, 2.0, 1.0])), str(scan))
    latent = {}
    for name, extra in (("trained", []), ("native", ["spacing=native"]), ("3mm", ["spacing=3"])):
        out = tmp_path / name
        predict(predict_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={scan}", f"output_dir={out}",
                            "codes=true", *extra))
        latent[name] = np.load(out / "head_codes.npy").shape
        # Whatever grid the model saw, the reconstruction lands on the scan's.
        assert nib.load(str(out / "head_reconstruction.nii.gz")).shape == (48, 40, 32)
    # The codes lie on the model grid, downsampled 4x (floor) by the encoder: MONAI's Spacing grid over the
    # 96 x 80 x 64 mm field of view is 17 x 14 x 11 voxels at 6 mm, 32 x 27 x 22 at 3 mm; native 48 x 40 x 32.
    assert latent == {"trained": (4, 3, 2), "native": (12, 10, 8), "3mm": (8, 6, 5)}


@pytest.mark.parametrize("spacing", ["coarse", -1.0, [1.0, 2.0], [0, 1, 1]])
def test_a_bad_spacing_is_refused(spacing):
    with pytest.raises(MedvolError, match="`spacing`"):
        input_geometry(OmegaConf.create({"s": spacing}).s, {"spacing": [6.0] * 3})
