"""dataset=xray_ct's views belong to the patient: projected from the CT on its own grid over the millimetres the
stage keeps, so a cascade's stages condition on the same radiographs whatever their voxel size."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from hydra.utils import instantiate

from medvol.volumes.projection import radiographs
from tests.conftest import compose_cfg

NATIVE_MM = 1.5
NATIVE_SHAPE = (80, 80, 56)


def write_ct(root: Path, subjects: int = 3) -> np.ndarray:
    """CTs of a water body with a bone block off centre, on a RAS grid of 1.5 mm voxels; returns the first."""
    root.mkdir(parents=True)
    first = None
    for i in range(subjects):
        x, y, z = np.meshgrid(*(np.arange(n) for n in NATIVE_SHAPE), indexing="ij")
        body = ((x - 40) ** 2 + (y - 40) ** 2) < 30**2
        ct = np.where(body, 0.0, -1000.0).astype(np.float32)
        ct[30 + i : 45 + i, 20:30, 10:40] = 1200.0  # bone, right of centre and to the front
        nib.save(nib.Nifti1Image(ct, np.diag([NATIVE_MM] * 3 + [1.0])), str(root / f"case{i}.nii.gz"))
        first = ct if first is None else first
    assert first is not None
    return first


def views_of(tmp_path: Path, data: Path, spacing: float, size: int) -> torch.Tensor:
    cfg = compose_cfg(tmp_path / f"run{size}", [
        "dataset=xray_ct", f"dataset.root={data}", "dataset.pattern='{subject}.nii.gz'", "dataset.xray_size=[24,24]",
        "dataset.num_workers=0", f"dataset.transforms.spacing=[{spacing},{spacing},{spacing}]",
        "dataset.val_fraction=0.34", "dataset.test_fraction=0",
    ], tiny=False)
    cfg.dataset.transforms.spatial_size = [size] * 3
    datamodule = instantiate(cfg.dataset)
    datamodule.setup()
    items = {str(item["subject"]): item for name in ("train", "val") for item in datamodule.datasets[name]}
    return items["case0"]["xray"]


def test_stages_covering_the_same_millimetres_see_the_views_of_the_ct_on_its_own_grid(tmp_path):
    ct = write_ct(tmp_path / "ct")
    # Two stages over the same 96 mm: 24 voxels of 4 mm and 48 of 2 mm.
    coarse, fine = views_of(tmp_path, tmp_path / "ct", 4.0, 24), views_of(tmp_path, tmp_path / "ct", 2.0, 48)
    # The reference: the 1.5 mm CT cut to 96 mm (64 voxels) by hand, centred: 8 voxels off each side in x and
    # y, 4 of air added at each end in z, projected once.
    native = np.full((64, 64, 64), -1000.0, dtype=np.float32)
    native[:, :, 4:60] = ct[8:72, 8:72, :]
    expected = radiographs(torch.from_numpy(native)[None], torch.full((1, 3), NATIVE_MM), ["ap", "lateral"], [24, 24])
    torch.testing.assert_close(coarse, expected[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(fine, expected[0], rtol=0, atol=1e-5)
