"""The safe normaliser, the transform settings' validation and the NIfTI writer."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch

from datamodules.pipeline.transforms import SafeScaleIntensityd, TransformSettings, scale_to_range
from medvol.core.errors import MedvolError
from medvol.volumes.nifti_io import save_volume


def test_constant_volume_becomes_zeros_not_nan():
    out = SafeScaleIntensityd(["image"], "percentile")({"image": torch.full((1, 4, 4, 4), 3.0)})["image"]
    assert torch.equal(out, torch.zeros(1, 4, 4, 4))


def test_nan_and_inf_voxels_do_not_poison_the_volume():
    volume = torch.linspace(0, 100, 64).reshape(1, 4, 4, 4)
    volume[0, 0, 0, :2] = torch.tensor([float("nan"), float("inf")])
    out = SafeScaleIntensityd(["image"], "percentile", percentiles=(0, 100),
                              output_range=(0, 1))({"image": volume})["image"]
    assert torch.isfinite(out).all() and out.min() >= 0 and out.max() <= 1


def test_percentiles_per_channel_and_hu_window():
    volume = torch.stack([torch.linspace(0, 1, 1000), torch.linspace(0, 500, 1000)]).reshape(2, 10, 10, 10)
    out = SafeScaleIntensityd(["image"], "percentile", percentiles=(0, 100))({"image": volume})["image"]
    assert torch.allclose(out.amin(dim=(1, 2, 3)), torch.tensor([-1.0, -1.0]))
    assert torch.allclose(out.amax(dim=(1, 2, 3)), torch.tensor([1.0, 1.0]))
    hu = torch.tensor([-2000.0, -1000.0, 0.0, 1000.0, 3000.0])
    assert torch.allclose(scale_to_range(hu, -1000, 1000, (0, 1)), torch.tensor([0, 0, 0.5, 1, 1]))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"intensity": "minmax"}, "`dataset.transforms.intensity`"),
        ({"window": [500, -500]}, "`dataset.transforms.window`"),
        ({"output_range": [-2, 2]}, "`dataset.transforms.output_range`"),
        ({"spatial_size": [64, 64]}, "`dataset.transforms.spatial_size`"),
        ({"flip": 0.5}, "`dataset.transforms.flip` is not a transform setting"),
    ],
)
def test_bad_transform_settings_name_the_key(config, message):
    with pytest.raises(MedvolError, match=message.replace("[", r"\[")):
        TransformSettings.from_config(config)


def test_saved_volume_keeps_affine_and_source_header(tmp_path):
    affine = np.diag([0.8, 0.8, 2.5, 1.0])
    affine[:3, 3] = [-90, -100, 40]
    source = nib.Nifti1Image(np.zeros((6, 5, 4), dtype=np.int16), affine)
    source.header["descrip"] = b"source scan"
    source.header.set_xyzt_units("mm", "sec")
    nib.save(source, str(tmp_path / "src.nii.gz"))
    path = save_volume(torch.rand(1, 6, 5, 4), tmp_path / "out" / "recon.nii.gz", torch.tensor(affine),
                       tmp_path / "src.nii.gz")
    saved = nib.load(str(path))
    assert np.allclose(saved.affine, affine) and saved.shape == (6, 5, 4)
    assert saved.header["descrip"].tobytes().startswith(b"source scan") and saved.header.get_xyzt_units() == ("mm",
                                                                                                              "sec")
    assert saved.get_data_dtype() == np.float32
    labels = save_volume(torch.ones(6, 5, 4, dtype=torch.int64), tmp_path / "seg.nii.gz", affine)
    assert nib.load(str(labels)).get_data_dtype() == np.int32
