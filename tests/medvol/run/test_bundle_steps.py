"""The bundle's steps against predict.py's own, one stage at a time, without a trained model.

Preprocessing: the transforms inference.json gets (`BundleSteps.preprocessing`, parsed by MONAI's ConfigParser) and
the dataset chain predict.py reads an input file with (`deterministic_transforms`) on the same two-channel scan,
for the plan's z-score (the filled non-zero mask of all channels: a channel's own zeros inside the brain and an
enclosed cavity), CT and unmasked MR channels, nnU-Net's resampling with an anisotropic axis (in the scan's spacing,
in the target's) and the linear one, percentile and window scaling: the same voxels on the same grid.
Post-processing: the bundle's steps from model-grid logits to the written label map, against predict.py's
(`logits_to_source_grid` with the background filled, on an isotropic and an over 3x anisotropic grid, the softmax or
sigmoid, the threshold or argmax, `keep_largest`, the training files' label values), for classes and for regions.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.bundle import ConfigParser
from monai.data import MetaTensor
from monai.transforms import Compose
from scipy import ndimage

from datamodules.pipeline.transforms import TransformSettings, deterministic_transforms
from datamodules.sources.nifti import LABEL_FILE_VALUES
from lightning_modules.segmentation.postprocessing import Postprocessing, keep_largest
from lightning_modules.segmentation.segmentation import Segmenter
from medvol.run.bundle import DESCRIPTION_PREFIX, SOURCE_KEY, BundleSteps, step
from medvol.run.predict_job import label_file_values
from medvol.volumes.source_grid import logits_to_source_grid

SHAPE = (30, 26, 20)
MR_MASKED = [{"kind": "mr", "use_mask": True}] * 2
PLANNED = {"intensity": "zscore", "normalization": MR_MASKED, "resampling": "nnunet", "crop_foreground": True}
SETTINGS = {
    "planned": ({**PLANNED, "spacing": [2.0, 1.5, 3.0]}, (1.2, 0.9, 2.5)),
    "anisotropic-scan": ({**PLANNED, "spacing": [1.5, 1.5, 1.5]}, (0.8, 0.8, 4.0)),
    "anisotropic-target": ({**PLANNED, "spacing": [1.0, 1.0, 4.5]}, (1.2, 0.9, 1.0)),
    "ct-and-unmasked-mr": ({"intensity": "zscore", "crop_foreground": True, "normalization": [
        {"kind": "ct", "clip": [-100.0, 300.0], "mean": 50.0, "std": 80.0}, {"kind": "mr", "use_mask": False}]},
        (1.2, 0.9, 2.5)),
    "linear-percentile": ({"intensity": "percentile", "spacing": [2.0, 2.0, 2.0]}, (1.2, 0.9, 2.5)),
    "window": ({"intensity": "window", "window": [-200.0, 400.0], "orientation": "LPS"}, (1.2, 0.9, 2.5)),
}


def two_channel_scan(path: Path, spacing: tuple[float, float, float]) -> Path:
    """A 4D LPS NIfTI of two channels: zero outside an ellipsoid, inside it smooth values, zeros of the first
    channel alone in a slab across it (open to the outside: only the other channel keeps it in the mask) and a
    cavity of zeros in both (enclosed: the filled mask keeps it)."""
    rng = np.random.default_rng(0)
    grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, n) for n in SHAPE], indexing="ij"), -1)
    inside = (grid ** 2).sum(-1) < 0.8
    smooth = [ndimage.gaussian_filter(rng.standard_normal(SHAPE), 2.0) * 300 + 400 + 100 * c for c in range(2)]
    data = np.stack([np.where(inside, s, 0.0) for s in smooth], -1)
    data[12:14, :, :, 0] = 0.0
    data[((grid - [0.1, 0.0, 0.0]) ** 2).sum(-1) < 0.05] = 0.0
    affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])
    affine[:3, 3] = [20.0, 15.0, -30.0]
    nib.save(nib.Nifti1Image(data.astype(np.float32), affine), str(path))
    return path


def parsed(steps: BundleSteps, transforms: list[dict], name: str) -> list[tuple[str, object]]:
    """`transforms` as MONAI's ConfigParser builds them from inference.json (with the helpers they call), each with
    the predict.py step its description names."""
    parser = ConfigParser({"imports": steps.imports(), **steps.helpers,
                           name: {"_target_": "Compose", "transforms": transforms}})
    built = parser.get_parsed_content(name).transforms
    return [(t["_desc_"].removeprefix(DESCRIPTION_PREFIX), b) for t, b in zip(transforms, built, strict=True)]


@pytest.mark.parametrize("case", list(SETTINGS))
def test_the_bundles_preprocessing_is_predicts_voxel_for_voxel(case, tmp_path):
    given, spacing = SETTINGS[case]
    scan = two_channel_scan(tmp_path / "scan.nii.gz", spacing)
    settings = asdict(TransformSettings.from_config(given))
    expected = Compose(deterministic_transforms(TransformSettings.from_config(settings), ["image"], None))(
        {"image": [str(scan)]})
    steps = BundleSteps()
    data: dict = {"image": str(scan)}
    for _, transform in parsed(steps, steps.preprocessing(settings, 2), "preprocessing"):
        data = transform(data)
    assert tuple(data["image"].shape) == tuple(expected["image"].shape)
    assert np.allclose(np.asarray(data["image"].affine), expected["affine"].numpy(), atol=1e-5)
    torch.testing.assert_close(data["image"].as_tensor(), expected["image"], atol=1e-5, rtol=1e-5)
    for key in ("intensity_low", "intensity_high"):
        if key in expected:
            assert np.allclose(data[key], expected[key].numpy())


def segmenter(regions: bool) -> Segmenter:
    """A segmentation model as predict.py holds it: post-processing decided (the largest component of all
    foreground), and training files that stored one label value otherwise (BraTS 2021's 4 for 3, here 2 -> 5)."""
    module = Segmenter(in_channels=1, num_classes=3, regions={"outer": [1, 2], "inner": [2]} if regions else None,
                       features=[4, 8], patch_size=[8, 8, 8])
    module.postprocessing = Postprocessing((("all foreground", (1, 2)),))
    module.training_data = {LABEL_FILE_VALUES: {"2": 5}}
    return module


@pytest.mark.parametrize("anisotropic", [False, True], ids=["isotropic", "thick-slices"])
@pytest.mark.parametrize("regions", [False, True], ids=["classes", "regions"])
def test_the_bundles_postprocessing_is_predicts_on_the_scans_grid(regions, anisotropic):
    """Logits on a model grid that covers part of the scan (cropped, another spacing; with thick slices the model
    grid's z over 3x its in-plane spacing, resampled apart), smooth enough to make several blobs per structure: the
    bundle's label map on the scan's grid is predict.py's, voxel for voxel."""
    module = segmenter(regions)
    scheme = module.scheme
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(scheme.out_channels, 14, 12, 9, generator=generator)
    logits = torch.from_numpy(ndimage.gaussian_filter(logits.numpy(), (0, 1.2, 1.2, 1.2))) * 6
    logits[0] += 0 if regions else 2.0  # the background most of the scan: foreground in pieces
    z = 7.0 if anisotropic else 3.0
    model_affine = torch.tensor([[-2.0, 0, 0, 12.0], [0, -1.5, 0, 9.0], [0, 0, z, -24.0], [0, 0, 0, 1]],
                                dtype=torch.float64)
    source_affine = torch.tensor([[-1.2, 0, 0, 20.0], [0, -0.9, 0, 15.0], [0, 0, 2.5, -30.0], [0, 0, 0, 1]],
                                 dtype=torch.float64)
    source_shape = (30, 26, 20)
    source = scheme.activation(logits_to_source_grid(
        logits, (source_affine, source_shape), model_affine, scheme.background_logits()
    )[None])[0]
    kept = module.label_maps(source[None])[0]
    # The post-processing drops some components, and the model grid's edge lies inside the scan.
    assert bool((kept != scheme.label_map(scheme.discretise(source[None]))[0]).any())
    expected = torch.tensor(label_file_values(module))[kept]
    steps = BundleSteps()
    # Up to the file: SaveImaged writes what the steps before it give.
    transforms = [t for t in steps.postprocessing(module, {}, segmentation=True) if "save_volume" not in t["_desc_"]]
    data = {"pred": MetaTensor(logits.clone(), affine=model_affine),
            SOURCE_KEY: MetaTensor(torch.zeros(1, *source_shape), affine=source_affine)}
    for _, transform in parsed(steps, transforms, "postprocessing"):
        data = transform(data)
    got = data["pred"].as_tensor()
    assert torch.equal(got, expected) and 5 in set(got.unique().tolist())


def test_the_bundles_largest_component_is_predicts_on_scattered_labels():
    """A label map of scattered voxels, whose pieces often touch only at an edge or a corner: the bundle keeps
    the largest 26-connected component of the listed values, as predict.py's post-processing."""
    label = np.random.default_rng(2).choice(4, size=(20, 18, 16), p=[0.75, 0.1, 0.1, 0.05])
    steps = BundleSteps()
    transforms = [step("Postprocessing", "Lambdad", keys="pred",
                       func=f"$lambda m: {steps.helper('keep_largest')}(m, [1, 2])")]
    (_, transform), = parsed(steps, transforms, "postprocessing")
    got = transform({"pred": MetaTensor(torch.from_numpy(label)[None])})["pred"].as_tensor()[0].numpy()
    expected = keep_largest(label, (1, 2))
    assert (expected != label).any() and np.array_equal(got, expected)
