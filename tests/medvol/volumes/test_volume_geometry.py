"""What predict.py writes, against references outside medvol: resampling onto the source grid (nibabel),
blending of sliding windows (a blend computed here), units and fill values (worked by hand)."""

from __future__ import annotations

import math

import nibabel as nib
import numpy as np
import pytest
import torch
from nibabel.processing import resample_from_to

from medvol.volumes.prediction_writer import PredictionWriter, to_source_units
from medvol.volumes.sliding_window import SlidingWindow
from medvol.volumes.source_grid import to_source_grid


def rotation(axis: int, degrees: float) -> np.ndarray:
    angle = math.radians(degrees)
    c, s = math.cos(angle), math.sin(angle)
    i, j = [a for a in range(3) if a != axis]
    matrix = np.eye(3)
    matrix[i, i], matrix[i, j], matrix[j, i], matrix[j, j] = c, -s, s, c
    return matrix


def affine(linear: np.ndarray, origin: list[float]) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3], out[:3, 3] = linear, origin
    return out


# The model grid: 1.5 x 1.0 x 2.0 mm voxels, turned 20 degrees about z. The source scan: 1.1 x 1.3 x 0.9 mm,
# turned -15 degrees about x and 10 about y, shifted so that part of it lies outside the model grid.
MODEL_SHAPE = (12, 10, 9)
MODEL_AFFINE = affine(rotation(2, 20) @ np.diag([1.5, 1.0, 2.0]), [-6.0, -4.0, -7.0])
SOURCE_SHAPE = (17, 13, 16)
SOURCE_AFFINE = affine(rotation(0, -15) @ rotation(1, 10) @ np.diag([1.1, 1.3, 0.9]), [-5.0, -6.0, -8.0])


def smooth_volume(seed: int = 0) -> np.ndarray:
    """A float volume on the model grid, about -1000 .. 1000 (HU-like), with no two neighbours equal."""
    rng = np.random.default_rng(seed)
    grid = np.meshgrid(*[np.linspace(0, 1, n) for n in MODEL_SHAPE], indexing="ij")
    values = 600 * np.sin(3 * grid[0] + 2 * grid[1]) + 300 * grid[2] + 50 * rng.normal(size=MODEL_SHAPE)
    return values.astype(np.float32)


def source_coordinates() -> np.ndarray:
    """Every source voxel's position in model-grid voxel coordinates (nibabel's apply_affine)."""
    index = np.stack(np.meshgrid(*[np.arange(n) for n in SOURCE_SHAPE], indexing="ij"), -1)
    return nib.affines.apply_affine(np.linalg.inv(MODEL_AFFINE) @ SOURCE_AFFINE, index)


def test_the_grids_make_a_hard_case():
    coords = source_coordinates()
    inside = np.all((coords >= 0) & (coords <= np.array(MODEL_SHAPE) - 1), axis=-1)
    # Mostly non-integer positions, a good share inside and a good share outside the model grid.
    assert np.abs(coords - np.rint(coords)).max() > 0.45 and 0.2 < inside.mean() < 0.8


def test_linear_resampling_onto_an_oblique_anisotropic_source_grid_equals_nibabel():
    volume = smooth_volume()
    fill = -1000.0
    ours = to_source_grid(torch.from_numpy(volume), (SOURCE_AFFINE, SOURCE_SHAPE), MODEL_AFFINE, "linear", fill).numpy()
    # scipy's "grid-constant": the volume is padded with `fill` and interpolated up to it, as a linear
    # lookup between the last voxel and the outside should be.
    reference = resample_from_to(
        nib.Nifti1Image(volume.astype(np.float64), MODEL_AFFINE), (SOURCE_SHAPE, SOURCE_AFFINE),
        order=1, mode="grid-constant", cval=fill,
    ).get_fdata()
    assert ours.shape == SOURCE_SHAPE
    np.testing.assert_allclose(ours, reference, atol=2e-3)
    # Far outside the model grid: the fill value itself.
    coords = source_coordinates()
    outside = np.any((coords < -1) | (coords > np.array(MODEL_SHAPE)), axis=-1)
    assert outside.sum() > 100 and np.all(ours[outside] == fill)


def test_nearest_resampling_of_a_label_map_equals_nibabel_order_zero():
    labels = np.random.default_rng(1).integers(0, 5, MODEL_SHAPE).astype(np.int64)
    ours = to_source_grid(torch.from_numpy(labels), (SOURCE_AFFINE, SOURCE_SHAPE), MODEL_AFFINE, "nearest", 0.0).numpy()
    reference = resample_from_to(
        nib.Nifti1Image(labels.astype(np.float64), MODEL_AFFINE), (SOURCE_SHAPE, SOURCE_AFFINE), order=0, mode="nearest"
    ).get_fdata()
    coords = source_coordinates()
    # Compared where the nearest voxel exists; voxels whose nearest model voxel lies outside take the fill value.
    rounded = np.rint(coords)
    inside = np.all((rounded >= 0) & (rounded <= np.array(MODEL_SHAPE) - 1), axis=-1)
    assert ours.dtype == np.int64 and inside.mean() > 0.2
    assert np.array_equal(ours[inside], reference[inside].astype(np.int64))
    assert np.all(ours[~inside] == 0)


def test_the_writer_puts_a_float_output_on_the_source_grid_linearly_with_its_darkest_value_outside(tmp_path):
    volume = smooth_volume(seed=2)
    batch = {
        "subject": ["case00"],
        "affine": torch.from_numpy(MODEL_AFFINE)[None],
        "source_affine": torch.from_numpy(SOURCE_AFFINE)[None],
        "source_shape": torch.tensor([SOURCE_SHAPE]),
    }
    PredictionWriter(tmp_path).write({"volumes": {"ct": torch.from_numpy(volume)[None, None]}}, batch)
    written = nib.load(str(tmp_path / "case00_ct.nii.gz"))
    assert written.shape == SOURCE_SHAPE and np.allclose(written.affine, SOURCE_AFFINE)
    darkest = float(volume.min())
    reference = resample_from_to(
        nib.Nifti1Image(volume.astype(np.float64), MODEL_AFFINE), (SOURCE_SHAPE, SOURCE_AFFINE),
        order=1, mode="grid-constant", cval=darkest,
    ).get_fdata()
    np.testing.assert_allclose(written.get_fdata(), reference, atol=2e-3)
    outside = np.any((source_coordinates() < -1) | (source_coordinates() > np.array(MODEL_SHAPE)), axis=-1)
    assert np.all(written.get_fdata()[outside] == pytest.approx(darkest))


def test_a_model_window_is_inverted_into_its_raw_units_by_hand():
    # A model trained on the CT window [-1000, 1000] HU mapped onto [-1, 1]: model -1 is -1000 HU, 0 is 0 HU,
    # 0.25 is 250 HU; values beyond the model range are clipped as the forward scaling clipped them.
    model_units = torch.tensor([[[[-1.0, 0.0, 0.25, 1.0, 1.5, -3.0]]]])
    hounsfield = to_source_units(model_units, {}, 0, window=(-1000.0, 1000.0))
    assert torch.allclose(hounsfield, torch.tensor([[[[-1000.0, 0.0, 250.0, 1000.0, 1000.0, -1000.0]]]]))
    # With the dataset's record of a percentile scaling onto [0, 1], that record wins over the window.
    batch = {"intensity_low": torch.tensor([[40.0]]), "intensity_high": torch.tensor([[240.0]]),
             "intensity_range": torch.tensor([[0.0, 1.0]])}
    raw = to_source_units(torch.tensor([[[[0.0, 0.5, 1.0]]]]), batch, 0, window=(-1000.0, 1000.0))
    assert torch.allclose(raw, torch.tensor([[[[40.0, 140.0, 240.0]]]]))


# Sliding windows -------------------------------------------------------------------------------------

ROI = (8, 8, 8)
# Windows of 8 voxels at overlap 0.5 start every 4 voxels; the last one along an axis is moved back so it
# ends at the volume's edge. A 20 x 12 x 8 volume: starts 0, 4, 8, 12 | 0, 4 | 0.
WINDOW_STARTS = [(a, b, 0) for a in (0, 4, 8, 12) for b in (0, 4)]
VOLUME_SHAPE = (20, 12, 8)


class PositionDependent(torch.nn.Module):
    """2 x input plus a ramp over the window's own voxels (i + 0.5 j): each window says where in it a voxel sat."""

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        i, j, _ = torch.meshgrid(*[torch.arange(n, dtype=window.dtype) for n in window.shape[2:]], indexing="ij")
        return 2 * window + (i + 0.5 * j)


def gaussian_weights(roi: tuple[int, ...], sigma_scale: float = 0.125, floor: float = 1e-3) -> np.ndarray:
    """Per window voxel: a Gaussian centred on the window, sigma = roi / 8 per axis, floored at 1e-3 (MONAI's
    documented sigma_scale and its floor that keeps far corners from weighing zero)."""
    axes = [np.exp(-((np.arange(n) - (n - 1) / 2) ** 2) / (2 * (sigma_scale * n) ** 2)) for n in roi]
    return np.maximum(axes[0][:, None, None] * axes[1][None, :, None] * axes[2][None, None, :], floor)


def hand_blend(volume: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Sum over windows of weight x network output, divided by the sum of the weights, voxel by voxel."""
    numerator = np.zeros_like(volume, dtype=np.float64)
    denominator = np.zeros(volume.shape[1:], dtype=np.float64)
    for a, b, c in WINDOW_STARTS:
        window = volume[:, a:a + ROI[0], b:b + ROI[1], c:c + ROI[2]].astype(np.float64)
        ramp = np.arange(ROI[0])[:, None, None] + 0.5 * np.arange(ROI[1])[None, :, None]
        numerator[:, a:a + ROI[0], b:b + ROI[1], c:c + ROI[2]] += weights * (2 * window + ramp)
        denominator[a:a + ROI[0], b:b + ROI[1], c:c + ROI[2]] += weights
    return numerator / denominator


def test_gaussian_blending_of_a_position_dependent_network_equals_a_hand_blend():
    volume = torch.randn(1, 2, *VOLUME_SHAPE, generator=torch.Generator().manual_seed(0))
    out = SlidingWindow.of(ROI, overlap=0.5, mode="gaussian", batch_size=3)(PositionDependent(), volume)
    expected = hand_blend(volume[0].numpy(), gaussian_weights(ROI))
    np.testing.assert_allclose(out[0].numpy(), expected, atol=1e-4)
    # Constant weights would give a visibly different blend of the ramps (not a float-noise difference).
    assert np.abs(hand_blend(volume[0].numpy(), np.ones(ROI)) - expected).max() > 0.5


@pytest.mark.parametrize(("shape", "roi", "overlap"), [
    ((1, 2, *VOLUME_SHAPE), ROI, 0.5), ((2, 1, 12, 12, 12), (8, 8, 8), 0.5), ((1, 1, 9, 16, 24), (8, 8, 8), 0.25),
    ((1, 1, 6, 16, 8), (8, 8, 8), 0.5), ((1, 1, 128, 128, 152), (64, 64, 64), 0.5),
])
def test_the_windows_counted_are_the_windows_monai_runs(shape, roi, overlap):
    calls = []

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x

    window = SlidingWindow.of(roi, overlap=overlap, batch_size=1)
    window(counting, torch.zeros(shape))
    assert window.windows(shape) == len(calls)
