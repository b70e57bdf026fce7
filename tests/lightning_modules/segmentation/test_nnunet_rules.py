"""Issue 50's rules against nnU-Net v2's own functions, whose answers on fixed inputs
`benchmarks/segmentation/nnunet_plans.py rules` recorded in tests/data/nnunet_rules.pt (in a venv with nnunetv2 2.8.1
and batchgeneratorsv2; the file says which made it): the losses with `batch_dice` and with an ignore label, the spatial
augmentation's one-hot linear label resampling, the predictor's mirrored logits, and the resampling of logits to the
source grid with and without an axis apart (separate-z).
MONAI's Dice loss is 1 - Dice where nnU-Net's is -Dice: medvol's losses are nnU-Net's plus 1."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.ndimage import map_coordinates

from datamodules.pipeline.augmentation import one_hot_linear
from lightning_modules.segmentation.losses import build_loss

ROOT = Path(__file__).resolve().parents[3]
REFERENCE = torch.load(ROOT / "tests" / "data" / "nnunet_rules.pt", weights_only=True)
# nnU-Net's region channels of the recorded label maps (1 oedema, 2 core): WT [1, 2], TC [2], and [2] again.
REGIONS = ((1, 2), (2,), (2,))


def region_channels(labels: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.isin(labels, torch.tensor(r)) for r in REGIONS], 1).to(torch.uint8)


@pytest.mark.parametrize("batch_dice", [False, True])
def test_the_dice_losses_with_and_without_batch_dice_are_nnunets(batch_dice):
    logits, labels = REFERENCE["logits"].float(), REFERENCE["labels"]
    losses = REFERENCE["losses"]
    classes = build_loss("dice_ce", regions=False, batch_dice=batch_dice)(logits, labels)
    assert float(classes) - 1 == pytest.approx(losses["classes"][str(batch_dice)], abs=1e-6)
    regions = build_loss("dice_ce", regions=True, batch_dice=batch_dice)(logits, region_channels(labels))
    assert float(regions) - 1 == pytest.approx(losses["regions"][str(batch_dice)], abs=1e-6)
    # The two differ by more than the tolerance: the test tells them apart.
    assert abs(losses["classes"]["True"] - losses["classes"]["False"]) > 1e-4


def test_labels_are_resampled_one_hot_linearly_as_batchgeneratorsv2_resamples_them():
    """nnU-Net's SpatialTransform (border label -1, then 0) on one sampling grid: a label map of three values and one
    that reaches past the volume, and two region channels; voxel for voxel."""
    spatial = REFERENCE["spatial"]
    grid = spatial["grid"]

    def sample(volume: torch.Tensor, mode: str) -> torch.Tensor:
        return F.grid_sample(volume[None], grid[None], mode=mode, padding_mode="zeros", align_corners=False)[0]

    for name in ("labels", "regions"):
        ours = one_hot_linear(spatial[name].float(), sample)
        assert torch.equal(ours, spatial["out"][name].long()), name
    # Nearest-neighbour resampling (medvol's rule before) gives another map on the same grid.
    nearest = sample(spatial["labels"].float(), "nearest").long()
    assert not torch.equal(nearest, spatial["out"]["labels"].long())


@pytest.mark.parametrize("batch_dice", [False, True])
def test_the_losses_with_an_ignore_label_are_nnunets(batch_dice):
    """nnU-Net's losses with an ignore label (3): Dice and cross-entropy on the annotated voxels only; for regions its
    binary cross-entropy summed over the regions per annotated voxel."""
    from lightning_modules.segmentation.label_scheme import LabelScheme

    logits, ignored = REFERENCE["logits"].float(), REFERENCE["ignored"]
    losses = REFERENCE["losses"]
    scheme = LabelScheme(num_classes=3, ignore_label=3)
    annotated = scheme.annotated(ignored)
    assert annotated is not None and not bool(annotated.all())
    classes = build_loss("dice_ce", regions=False, batch_dice=batch_dice, ignore_label=3)
    assert float(classes(logits, scheme.target(ignored), annotated)) - 1 == pytest.approx(
        losses["classes_ignore"][str(batch_dice)], abs=1e-6)
    regions = build_loss("dice_ce", regions=True, batch_dice=batch_dice, ignore_label=3)
    assert float(regions(logits, region_channels(ignored), annotated)) - 1 == pytest.approx(
        losses["regions_ignore"][str(batch_dice)], abs=1e-6)


def test_an_ignore_label_is_left_out_of_the_metrics_and_never_predicted():
    """A hand count: truth class 1 in a 2x2x2 cube and an ignored slab; the prediction is class 1 on the cube and on
    the slab. nnU-Net's `compute_metrics` leaves the slab out: Dice 1 (8 of 8), where counting it would give
    2 x 8 / (8 + 8 + 16) = 0.5."""
    from lightning_modules.segmentation.segmentation import Segmenter
    from medvol.core.errors import MedvolError

    module = Segmenter(in_channels=1, num_classes=3, ignore_label=3, features=[4, 8], patch_size=[8, 8, 8],
                       tta=False).eval()
    truth = torch.zeros(1, 1, 8, 8, 8, dtype=torch.long)
    truth[0, 0, :2, :2, :2] = 1
    truth[0, 0, 6, :4, :4] = 3
    predicted = torch.zeros_like(truth)
    predicted[0, 0, :2, :2, :2] = 1
    predicted[0, 0, 6, :4, :4] = 1
    probabilities = F.one_hot(predicted[:, 0], 3).movedim(-1, 1).float()
    outputs = module.outputs_of({"image": torch.zeros(1, 1, 8, 8, 8), "label": truth}, probabilities)
    assert float(outputs["subject_metrics"]["dice_class1"][0]) == pytest.approx(1.0)
    assert np.isnan(float(outputs["subject_metrics"]["dice_class2"][0]))
    # The network predicts the classes only: three channels, never the ignore value.
    assert module.scheme.out_channels == 3 and int(module.label_maps(probabilities).max()) <= 2
    module.scheme.check_label(truth)
    with pytest.raises(MedvolError, match="label value 4"):
        module.scheme.check_label(truth + 1)
    with pytest.raises(MedvolError, match="`model.ignore_label` is 2; expected a value above every class"):
        Segmenter(in_channels=1, num_classes=3, ignore_label=2, features=[4, 8], patch_size=[8, 8, 8])
    with pytest.raises(MedvolError, match="an ignore label needs model.loss=dice_ce"):
        Segmenter(in_channels=1, num_classes=3, ignore_label=3, loss="dice_focal", features=[4, 8])
    # A training step on a label map holding the ignore value: the loss of the annotated voxels.
    module.train()
    image = torch.randn(1, 1, 8, 8, 8)
    loss = module.training_step({"image": image, "label": truth}, 0)
    annotated = truth != 3
    assert float(loss) == pytest.approx(float(module.loss(module(image), truth * annotated, annotated)))


def test_the_spatial_augmentation_resamples_labels_one_hot_linearly_on_the_images_grid():
    """SpatialAugmentd's label output is `one_hot_linear` (checked against batchgeneratorsv2 above) on the sampling
    of MONAI's Affine with the drawn rotation and scale, the images' own; not its nearest neighbour."""
    from monai.transforms import Affine

    from datamodules.pipeline.augmentation import SpatialAugmentd

    label = torch.zeros(1, 20, 18, 16)
    label[0, 4:14, 5:13, 3:12] = 1
    label[0, 7:11, 7:10, 5:9] = 2
    spatial = SpatialAugmentd(["image"], ["label"], [16, 14, 12], 0.5, False, 2, [0.0]).set_random_state(0)
    spatial.randomize = lambda data=None: None
    spatial.angles, spatial.scale, spatial.transformed = [0.3, -0.2, 0.4], 1.2, True
    out = spatial({"image": torch.randn(1, 20, 18, 16), "label": label})["label"]

    def sample(volume, mode):
        return Affine(rotate_params=[0.3, -0.2, 0.4], scale_params=[1.2] * 3, spatial_size=[16, 14, 12], mode=mode,
                      padding_mode="zeros", image_only=True)(volume)

    assert torch.equal(out.long(), one_hot_linear(label, sample))
    assert not torch.equal(out.long(), sample(label, "nearest").round().long())


def test_mirrored_logits_are_nnunets_predictor_s():
    """nnU-Net's `_internal_maybe_mirror_and_predict` on a fixed 3x3x3 convolution: the mean of the 8 flipped-back
    copies' logits; medvol's `MirrorAveraged` gives the same logits."""
    from medvol.volumes.mirroring import MirrorAveraged

    recorded = REFERENCE["mirroring"]
    net = torch.nn.Conv3d(2, 3, 3, padding=1)
    with torch.no_grad():
        net.weight.copy_(recorded["weight"].float())
        net.bias.copy_(recorded["bias"].float())
        ours = MirrorAveraged(net)(recorded["image"].float())
    torch.testing.assert_close(ours, recorded["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["separate_z", "model_anisotropic", "under_3x"])
def test_logits_go_back_to_the_scans_grid_as_nnunets_resampling(case):
    """nnU-Net's `resample_data_or_seg_to_shape` (order 1, order_z 0) of logits from the model grid to a scan of the
    same extent, the two grids placed corner to corner as nnU-Net's resizing places them: the scan over 3x anisotropic
    (6 -> 8 mm slices: z apart, nearest, halves rounded up), the model grid over 3x (7 -> 3.5 mm), neither (every axis
    linear); voxel for voxel, and the axis apart is the one `determine_do_sep_z_and_axis` chose."""
    from medvol.volumes.plan import separate_axis
    from medvol.volumes.source_grid import logits_to_source_grid

    recorded = REFERENCE["resampling"][case]
    logits = recorded["logits"].float()
    model_spacing, source_spacing = recorded["model_spacing"], recorded["source_spacing"]
    axis = separate_axis(model_spacing, source_spacing)
    assert (-1 if axis is None else axis) == recorded["separate_axis"]
    source_affine = np.diag([*source_spacing, 1.0])
    model_affine = np.diag([*model_spacing, 1.0])
    # Corner to corner: the first voxels' outer faces coincide.
    model_affine[:3, 3] = (np.asarray(model_spacing) - np.asarray(source_spacing)) / 2
    ours = logits_to_source_grid(logits, (source_affine, recorded["source_shape"]), model_affine, [0.0] * 3)
    torch.testing.assert_close(ours, recorded["out"].float(), rtol=1e-5, atol=1e-5)
    # Linear along every axis (scipy, edges held) gives other logits exactly where an axis is apart.
    scale = np.asarray(logits.shape[1:]) / np.asarray(recorded["source_shape"])
    positions = np.meshgrid(
        *[(np.arange(n) + 0.5) * f - 0.5 for n, f in zip(recorded["source_shape"], scale, strict=True)], indexing="ij")
    linear = np.stack([map_coordinates(c, positions, order=1, mode="nearest") for c in logits.numpy()])
    assert np.allclose(linear, recorded["out"].numpy(), atol=1e-4) == (axis is None)
