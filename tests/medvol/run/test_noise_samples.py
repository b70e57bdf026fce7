"""predict.py's samples from noise on their own: the RAS grid, the units, one file per draw, the spacing refusal."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch

from medvol.core.errors import MedvolError
from medvol.run.noise_samples import ras_affine, write_noise_samples


def test_the_grid_is_ras_at_the_spacing_asked_and_centred_on_the_origin():
    affine = ras_affine([2.0, 2.0, 3.0], (4, 4, 5)).numpy()
    assert nib.aff2axcodes(affine) == ("R", "A", "S")
    np.testing.assert_allclose(affine[:3, :3], np.diag([2.0, 2.0, 3.0]))
    # Hand-worked: the centre voxel (1.5, 1.5, 2) sits at the origin, voxel 0 at (-3, -3, -6) mm.
    np.testing.assert_allclose(affine @ [1.5, 1.5, 2, 1], [0, 0, 0, 1], atol=1e-12)
    np.testing.assert_allclose(affine[:3, 3], [-3.0, -3.0, -6.0])


class Generator:
    """The part of a trained model `write_noise_samples` calls: draw k is the constant k / 4 in model units."""

    training_data = {"intensity": {"low": [-1000.0], "high": [1000.0], "range": [-1.0, 1.0]}}

    def generate_volumes(self, batch, draw):
        return {"volumes": {"sample": torch.full((1, 1, 3, 4, 5), draw / 4)}}


def test_each_draw_is_one_file_on_the_grid_in_the_training_units(tmp_path):
    assert write_noise_samples(Generator(), {"spacing": [1.5, 1.5, 2.0]}, 3, tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample_0.nii.gz", "sample_1.nii.gz", "sample_2.nii.gz"]
    for draw in range(3):
        image = nib.load(str(tmp_path / f"sample_{draw}.nii.gz"))
        assert image.shape == (3, 4, 5) and nib.aff2axcodes(image.affine) == ("R", "A", "S")
        np.testing.assert_allclose(np.diag(image.affine)[:3], [1.5, 1.5, 2.0])
        # [-1, 1] -> [-1000, 1000] HU: draw / 4 is draw * 250 HU.
        np.testing.assert_allclose(image.get_fdata(), draw * 250.0, atol=0.5)


def test_samples_without_a_spacing_are_refused_naming_the_key(tmp_path):
    with pytest.raises(MedvolError, match="^`spacing`"):
        write_noise_samples(Generator(), {}, 1, tmp_path)
    assert not any(tmp_path.iterdir())
