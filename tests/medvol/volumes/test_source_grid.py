"""Volumes on the model grid map back onto the source file's grid: orientation, spacing and crop/pad undone."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from callbacks.nifti_predictions import NiftiPredictionWriter
from datamodules.sources.brats import BratsDataModule
from datamodules.sources.phantom import make_phantom
from medvol.volumes.source_grid import SourceGrid, to_source_grid

# LPS-oriented (x and y flipped), anisotropic voxels, an odd shape: what a scanner export looks like.
LPS_AFFINE = np.array([[-1.2, 0, 0, 30.0], [0, -0.9, 0, 21.0], [0, 0, 2.5, -40.0], [0, 0, 0, 1]])
SHAPE = (22, 13, 18)


def write_brats_lps(root: Path, subjects: int = 2) -> Path:
    """BraTS 2021 case folders (enhancing tumour stored as 4) on an LPS, anisotropic, int16 grid."""
    for i in range(subjects):
        phantom = make_phantom(0, i + 4, SHAPE)  # phantoms 4 and 5 have lesions
        case = f"BraTS2021_{i:05d}"
        seg = np.zeros(SHAPE, dtype=np.uint8)
        seg[phantom.label == 2] = 2
        seg[phantom.label == 1] = 4
        seg[(phantom.label == 1) & (np.arange(SHAPE[0]) % 2 == 0)[:, None, None]] = 1
        files = {"seg": seg,
                 **{m: (phantom.channels[m] * 1000).astype(np.int16) for m in ("t1", "t1ce", "t2", "flair")}}
        for name, data in files.items():
            path = root / case / f"{case}_{name}.nii.gz"
            path.parent.mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(data, LPS_AFFINE), str(path))
    return root


def first_item(root: Path, **transforms: object) -> dict:
    settings = {"orientation": "RAS", "intensity": "none", "spatial_size": [16, 16, 16], **transforms}
    datamodule = BratsDataModule(root=str(root), image_modalities=["flair"], transforms=settings)
    return datamodule.build_dataset(datamodule.subjects()[:1], "test")[0]


def test_reoriented_cropped_padded_label_maps_back_exactly(tmp_path):
    root = write_brats_lps(tmp_path / "brats")
    item = first_item(root)
    source = nib.load(str(next(root.glob("*/*_seg.nii.gz"))))
    # The model grid differs from the source's: reoriented, and cropped (axes 0, 2) and padded (axis 1).
    assert tuple(item["label"].shape[1:]) == (16, 16, 16) and not np.allclose(item["affine"].numpy(), source.affine)
    assert tuple(item["source_shape"].tolist()) == SHAPE
    assert np.allclose(item["source_affine"].numpy(), source.affine)

    back = to_source_grid(item["label"], (item["source_affine"], item["source_shape"]), item["affine"], "nearest",
                          fill=-1)
    assert back.dtype == torch.int64 and tuple(back.shape) == (1, *SHAPE)
    expected = torch.from_numpy(np.asarray(source.dataobj).astype(np.int64))
    expected = torch.where(expected == 4, 3, expected)  # the dataset's unified numbering
    kept = back[0] != -1
    # Every voxel the crop kept is the source voxel itself; the cropped-away ones take the fill value.
    assert torch.equal(back[0][kept], expected[kept])
    assert int(kept.sum()) == 16 * SHAPE[1] * 16

    image = to_source_grid(item["image"], source.get_filename(), item["affine"], "linear", fill=0.0)
    flair = np.asarray(nib.load(source.get_filename().replace("_seg", "_flair")).dataobj, dtype=np.float32)
    assert np.allclose(image[0].numpy()[kept.numpy()], flair[kept.numpy()], atol=1e-3)


def test_resampled_label_maps_back_onto_the_source_shape(tmp_path):
    root = write_brats_lps(tmp_path / "brats")
    item = first_item(root, spacing=[1.5, 1.5, 1.5], spatial_size=[24, 24, 32])
    source = SourceGrid.from_file(next(root.glob("*/*_seg.nii.gz")))
    back = to_source_grid(item["label"], source, item["affine"], "nearest")
    assert tuple(back.shape) == (1, *SHAPE)
    expected = torch.from_numpy(np.asarray(nib.load(next(root.glob("*/*_seg.nii.gz"))).dataobj).astype(np.int64))
    expected = torch.where(expected == 4, 3, expected)
    # Nearest there and back at another spacing: not voxel-exact at borders, but the same masks.
    assert float((back[0] == expected).float().mean()) > 0.95
    lesion, truth = back[0] > 0, expected > 0
    assert 2 * float((lesion & truth).sum()) / float(lesion.sum() + truth.sum()) > 0.8


def test_writer_puts_a_label_map_back_on_the_source_grid_with_the_source_label_values(tmp_path):
    root = write_brats_lps(tmp_path / "brats")
    settings = {"orientation": "RAS", "intensity": "none", "spatial_size": [24, 24, 24]}
    datamodule = BratsDataModule(root=str(root), image_modalities=["flair"], transforms=settings)
    item = datamodule.build_dataset(datamodule.subjects()[:1], "test")[0]
    batch = torch.utils.data.default_collate([item])
    writer = NiftiPredictionWriter(str(tmp_path / "predictions"))
    volumes = {"input": batch["image"], "seg": batch["label"], "label": batch["label"]}
    writer.on_test_batch_end(None, None, {"volumes": volumes}, batch, 0)  # type: ignore[arg-type]

    written = sorted(p.name for p in (tmp_path / "predictions").iterdir())
    assert written == [f"{item['subject']}_seg.nii.gz"]
    out = nib.load(str(tmp_path / "predictions" / written[0]))
    source = nib.load(str(next(root.glob("*/*_seg.nii.gz"))))
    assert out.shape == source.shape and np.allclose(out.affine, source.affine)
    assert np.issubdtype(out.get_data_dtype(), np.integer)
    # Padding only (24 >= every source size): every voxel is back, with BraTS 2021's 4 for enhancing.
    assert np.array_equal(np.asarray(out.dataobj), np.asarray(source.dataobj))
    assert 4 in np.unique(np.asarray(out.dataobj))


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="nearest for label maps"):
        to_source_grid(torch.zeros(1, 4, 4, 4, dtype=torch.int64), (np.eye(4), (4, 4, 4)), np.eye(4), "linear")
