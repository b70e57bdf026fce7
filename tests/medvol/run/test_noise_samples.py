"""predict.py's samples from noise (medvol/run/noise_samples.py): `sample_<k>.nii.gz` on a RAS grid of the asked
spacing centred on the origin, in the training data's units, and one line when no spacing is known."""

from __future__ import annotations

from typing import Any

import nibabel as nib
import numpy as np
import pytest
import torch
from nibabel.affines import apply_affine

from medvol.core.errors import MedvolError
from medvol.run.noise_samples import noise_batch, ras_affine, write_noise_samples

# Per `image` channel, as a checkpoint's record holds the training targets' scaling: [-1, 1] <- [-1000, 1000] HU.
INTENSITY = {"low": [-1000.0], "high": [1000.0], "range": [-1.0, 1.0]}
SHAPE = (4, 5, 6)


class NoiseModel:
    """Draw k is a ramp in model units shifted by k / 10; it records the batches it was given."""

    def __init__(self) -> None:
        self.training_data = {"intensity": INTENSITY}
        self.batches: list[dict[str, Any]] = []

    def generate_volumes(self, batch: dict[str, Any], draw: int) -> dict[str, Any]:
        self.batches.append(batch)
        return {"volumes": {"sample": _draw(draw)[None, None]}}


def _draw(k: int) -> torch.Tensor:
    return torch.linspace(-0.8, 0.7, int(np.prod(SHAPE))).reshape(SHAPE) + k / 10


def test_the_grid_has_the_asked_voxel_size_and_its_centre_at_the_origin():
    affine = ras_affine([2.0, 3.0, 4.0], (5, 3, 2)).numpy()
    # Translation -spacing (shape - 1) / 2 = -(2 x 2, 3 x 1, 4 x 0.5).
    np.testing.assert_array_equal(affine, [[2, 0, 0, -4], [0, 3, 0, -3], [0, 0, 4, -2], [0, 0, 0, 1]])
    np.testing.assert_allclose(apply_affine(affine, [2.0, 1.0, 0.5]), [0.0, 0.0, 0.0])


def test_a_noise_batch_names_the_sample_and_carries_the_training_units():
    batch = noise_batch([1.0, 1.0, 2.0], SHAPE, INTENSITY)
    assert batch["subject"] == ["sample"]
    np.testing.assert_array_equal(batch["affine"][0].numpy(), ras_affine([1.0, 1.0, 2.0], SHAPE).numpy())
    torch.testing.assert_close(batch["intensity_low"], torch.tensor([[-1000.0]], dtype=torch.float64))


def test_each_draw_is_written_on_the_spacing_grid_in_hounsfield_units(tmp_path):
    model, spacing = NoiseModel(), [1.5, 2.0, 2.5]
    assert write_noise_samples(model, {"spacing": spacing}, 3, tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample_0.nii.gz", "sample_1.nii.gz", "sample_2.nii.gz"]
    assert [batch["affine"][0].diagonal()[:3].tolist() for batch in model.batches] == [spacing] * 3
    for k in range(3):
        image = nib.load(str(tmp_path / f"sample_{k}.nii.gz"))
        # [-1, 1] -> [-1000, 1000] HU: 1000 times the model's value.
        np.testing.assert_allclose(image.get_fdata(), 1000 * _draw(k).numpy(), atol=1e-2)
        np.testing.assert_allclose(image.affine, ras_affine(spacing, SHAPE).numpy(), atol=1e-6)


def test_no_spacing_is_one_line_before_anything_is_generated_or_written(tmp_path):
    model = NoiseModel()
    with pytest.raises(MedvolError, match=r"`spacing`: samples from noise need a voxel size"):
        write_noise_samples(model, {"spacing": None}, 2, tmp_path / "out")
    assert model.batches == [] and not (tmp_path / "out").exists()
