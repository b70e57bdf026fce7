"""The X-ray projector and the projection-consistency loss of X-ray-to-CT."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_modules.xray2ct.physics import ProjectionLoss
from medvol.volumes.intensity import scale_from_range, scale_to_range
from medvol.volumes.projection import back_project, drr, radiographs, view_pixel_spacing, voxel_spacing


def _ball(n: int, radius_voxels: float, hounsfield: float) -> torch.Tensor:
    axis = torch.arange(n, dtype=torch.float64) - (n - 1) / 2
    x, y, z = torch.meshgrid(axis, axis, axis, indexing="ij")
    inside = x**2 + y**2 + z**2 <= radius_voxels**2
    return torch.where(inside, torch.tensor(hounsfield), torch.tensor(-1000.0))


def test_drr_of_a_ball_equals_the_analytic_chord_lengths():
    n, radius, spacing, mu_water = 65, 24.0, 0.5, 0.02
    volume = _ball(n, radius, 0.0)  # water ball in air: mu = mu_water inside, 0 outside
    image = drr(volume, spacing, axis=1, mu_water=mu_water)
    assert image.shape == (n, n)
    centre = (n - 1) // 2
    for offset in (0, 8, 16, 20):
        # A ray at distance d from the centre crosses a chord of 2 sqrt(r^2 - d^2) (voxel-sampled).
        chord_voxels = int(volume[centre + offset, :, centre].eq(0).sum())
        analytic = 2 * math.sqrt(radius**2 - offset**2)
        assert abs(chord_voxels - analytic) <= 2.0
        expected = 1 - math.exp(-mu_water * chord_voxels * spacing)
        # Rows run along z (flipped: head at the top), columns along x.
        assert float(image[n - 1 - centre, centre + offset]) == pytest.approx(expected, rel=1e-5)
        assert float(image[n - 1 - centre, centre + offset]) == pytest.approx(
            1 - math.exp(-mu_water * analytic * spacing), abs=0.02
        )


def test_radiographs_take_batches_and_per_sample_spacing():
    volume = _ball(17, 6.0, 500.0).float()
    batch = torch.stack([volume, volume])
    spacing = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    views = radiographs(batch, spacing, ["ap", "lateral"], (17, 17), output_range=(0.0, 1.0))
    assert views.shape == (2, 2, 17, 17)
    single = drr(volume, 2.0, axis=1, mu_water=0.02)
    assert torch.allclose(views[1, 0], single, atol=1e-5)
    # Twice the path length attenuates more.
    assert views[1, 0, 8, 8] > views[0, 0, 8, 8]


def test_intensity_scaling_round_trips_inside_the_window():
    hounsfield = torch.linspace(-1000, 1000, 101)
    model_units = scale_to_range(hounsfield, -1000.0, 1000.0, (-1.0, 1.0))
    assert torch.allclose(scale_from_range(model_units, -1000.0, 1000.0, (-1.0, 1.0)), hounsfield, atol=1e-3)


def numpy_views(hounsfield: np.ndarray, spacing: tuple[float, float, float], mu_water: float) -> np.ndarray:
    """(2, z, x|y) AP and lateral DRRs of an (x, y, z) HU volume in [-1, 1], written out with numpy: line integrals of
    mu_water (1 + HU / 1000), clipped at 0, along y (AP) and x (lateral); rows from the head, columns from the
    patient's right (AP) or front (lateral)."""
    mu = mu_water * np.clip(1.0 + hounsfield / 1000.0, 0.0, None)
    ap = 1.0 - np.exp(-mu.sum(axis=1) * spacing[1])
    lateral = 1.0 - np.exp(-mu.sum(axis=0) * spacing[0])
    return np.stack([ap.T[::-1, ::-1], lateral.T[::-1, ::-1]]) * 2.0 - 1.0


def test_projection_loss_compares_the_volumes_drrs_with_views_made_elsewhere():
    # (x, y, z) = (12, 12, 20) voxels of 1.5 x 2.5 x 3.0 mm, views of (20, 12) pixels: no resampling between.
    hounsfield = np.full((12, 12, 20), -1000.0)
    hounsfield[1:4, 7:11, 13:19] = 1000.0
    hounsfield[6:11, 2:4, 2:6] = 0.0
    spacing, mu_water, window = (1.5, 2.5, 3.0), 0.03, (-1000.0, 2000.0)
    affine = torch.diag(torch.tensor([*spacing, 1.0]))[None]
    views = torch.from_numpy(numpy_views(hounsfield, spacing, mu_water)).float()[None]
    loss_fn = ProjectionLoss(["ap", "lateral"], window=window, mu_water=mu_water)

    def model_units(hu: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(2.0 * (hu - window[0]) / (window[1] - window[0]) - 1.0).float()[None, None]

    assert float(loss_fn(model_units(hounsfield), views, affine)) == pytest.approx(0.0, abs=1e-5)
    guess_hu = np.random.default_rng(0).uniform(-1000.0, 500.0, hounsfield.shape)
    guess = model_units(guess_hu).requires_grad_(True)
    loss = loss_fn(guess, views, affine)
    expected = np.abs(numpy_views(guess_hu, spacing, mu_water) - views[0].numpy()).mean()
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-4) and expected > 0.05
    loss.backward()
    assert guess.grad is not None and float(guess.grad.abs().sum()) > 0


def test_back_projection_of_one_view_projects_back_onto_it():
    hounsfield = _ball(16, 5.0, 400.0).float()[None]
    spacing = torch.tensor([[2.0, 2.0, 2.0]])
    for view in ("ap", "lateral"):
        views = radiographs(hounsfield, spacing, [view], (16, 16))
        volume = back_project(views, spacing, [view], (16, 16, 16))
        assert volume.shape == (1, 16, 16, 16)
        again = radiographs(volume, spacing, [view], (16, 16))
        assert torch.allclose(again, views, atol=1e-3)


def test_views_of_an_asymmetric_anisotropic_phantom_equal_numpy_line_integrals_along_the_right_axes():
    # (x, y, z) = (12, 12, 20) voxels of 1.5 x 2.5 x 3.0 mm (RAS): two blocks off every axis' centre.
    hounsfield = np.full((12, 12, 20), -1000.0)
    hounsfield[1:4, 7:11, 13:19] = 1000.0
    hounsfield[6:11, 2:4, 2:6] = 0.0
    affine = torch.diag(torch.tensor([1.5, 2.5, 3.0, 1.0], dtype=torch.float64))
    mu_water = 0.02
    views = radiographs(
        torch.from_numpy(hounsfield).float()[None], voxel_spacing(affine)[None], ["ap", "lateral"], (20, 12),
        mu_water, output_range=(0.0, 1.0),
    )[0].double().numpy()
    mu = mu_water * np.clip(1.0 + hounsfield / 1000.0, 0.0, None)
    # AP: rays along y (2.5 mm steps), columns along x from its high end (the patient's right) down; lateral: along
    # x (1.5 mm), columns along y from its high end (anterior) down; rows run along z from the head (the last z) down.
    ap = 1.0 - np.exp(-mu.sum(axis=1) * 2.5)
    lateral = 1.0 - np.exp(-mu.sum(axis=0) * 1.5)
    np.testing.assert_allclose(views[0], ap.T[::-1, ::-1], atol=1e-5)
    np.testing.assert_allclose(views[1], lateral.T[::-1, ::-1], atol=1e-5)


def test_a_blob_at_the_patients_right_front_and_top_shows_where_a_radiologist_looks_for_it():
    # RAS: x grows toward the patient's right, y toward the front, z toward the head. Air, with a bone blob in the
    # right, anterior, upper corner.
    hounsfield = torch.full((1, 16, 16, 16), -1000.0)
    hounsfield[0, 11:15, 11:15, 11:15] = 1000.0
    ap, lateral = radiographs(hounsfield, torch.tensor([[2.0, 2.0, 2.0]]), ["ap", "lateral"], (16, 16))[0]

    def where(view: torch.Tensor) -> tuple[str, str]:
        rows, columns = torch.nonzero(view > view.min() + 0.1, as_tuple=True)
        return ("top" if rows.float().mean() < 8 else "bottom", "left" if columns.float().mean() < 8 else "right")

    # AP, read facing the patient: their right on the viewer's left. Lateral, read from their left: face to the left.
    assert where(ap) == ("top", "left")
    assert where(lateral) == ("top", "left")


def test_view_pixel_spacing_rows_run_along_z_and_columns_across_the_view():
    # A 10 x 20 x 30 mm volume (x, y, z) as 5 x 4 views: ap integrates over y, so its columns span x; lateral over x.
    assert view_pixel_spacing("ap", (10.0, 20.0, 30.0), (5, 4)) == (6.0, 2.5)
    assert view_pixel_spacing("lateral", (10.0, 20.0, 30.0), (5, 4)) == (6.0, 5.0)
