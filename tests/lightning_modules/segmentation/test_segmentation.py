"""model=segmentation: the sigmoid loss for regions, MONAI's Dice/HD95, sliding windows, masks on the source grid,
errors."""

from __future__ import annotations

import csv
import json

import nibabel as nib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from monai.losses import DiceCELoss, DiceLoss
from monai.metrics import DiceMetric, HausdorffDistanceMetric
from scipy.ndimage import map_coordinates
from scipy.special import softmax

from lightning_modules.segmentation.label_scheme import LabelScheme
from lightning_modules.segmentation.losses import build_loss
from lightning_modules.segmentation.segmentation import Segmenter, supervision_weights
from lightning_modules.segmentation.subject_scores import SubjectScores, subject_scores
from medvol.core.errors import MedvolError
from medvol.run.training import run
from medvol.volumes.source_grid import to_source_grid
from tests.conftest import TINY_COMMON, TINY_MODEL, compose_cfg
from tests.ddp_support import explain, train_cli
from tests.medvol.run.test_ddp_correctness import recorder
from tests.medvol.volumes.test_source_grid import SHAPE, write_brats_lps
from tests.medvol.volumes.test_volume_geometry import (
    ROI,
    VOLUME_SHAPE,
    PositionDependent,
    gaussian_weights,
    hand_blend,
)

# The shared tiny settings for a file dataset: no synthetic dataset keys.
TINY_FILES = [o for o in [*TINY_COMMON, *TINY_MODEL["segmentation"]] if not o.startswith("dataset.")]
SYNTHETIC_REGIONS = "model.regions={lesion:[1,2],core:[1]}"


def random_masks(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    smooth = F.avg_pool3d(torch.rand(shape, generator=generator), 5, stride=1, padding=2)
    return (smooth > 0.5).to(torch.uint8)


def test_region_loss_is_sigmoid_dice_plus_binary_cross_entropy_not_monais_softmax_ce():
    logits = torch.randn(2, 3, 8, 8, 8, generator=torch.Generator().manual_seed(0))
    target = random_masks(1, (2, 3, 8, 8, 8))
    loss = build_loss("dice_ce", regions=True)(logits, target)
    expected = DiceLoss(sigmoid=True)(logits, target) + F.binary_cross_entropy_with_logits(logits, target.float())
    assert torch.allclose(loss, expected)
    # MONAI's DiceCELoss(sigmoid=True) takes softmax cross-entropy over the channels: a different loss.
    softmax_ce = DiceCELoss(sigmoid=True)(logits, target)
    assert not torch.allclose(loss, softmax_ce, atol=1e-3)
    assert torch.allclose(softmax_ce, DiceLoss(sigmoid=True)(logits, target) + F.cross_entropy(logits, target.float()))


@pytest.mark.parametrize("stages", [3, 4, 6])
def test_deep_supervision_weights_are_nnunets(stages):
    """nnU-Net's `_build_loss`: one weight per decoder stage's output, 1/2^i, the lowest 0, normalised to 1."""
    weights = np.array([1 / 2**i for i in range(stages - 1)])
    weights[-1] = 0
    assert supervision_weights(stages) == pytest.approx((weights / weights.sum()).tolist())


def test_deep_supervision_scores_each_head_at_its_own_resolution_against_the_downsampled_target():
    """nnU-Net's deep supervision: head i (1/2^i of the patch) against the target taken every 2^i voxels at the
    centre of each block (`nearest-exact`: index 2^i * j + 2^(i-1)), weighted 1/2^i, the lowest head left out;
    worked here with numpy slices and MONAI's Dice + BCE on the raw heads, not with the module's loss."""
    torch.manual_seed(0)
    regions = {"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]}
    module = Segmenter(in_channels=2, net="dynunet", regions=regions, features=[4, 8, 16, 32],
                       strides=[[1, 1, 1], [2, 2, 2], [2, 2, 2], [2, 2, 2]], kernels=[[3, 3, 3]] * 4,
                       deep_supervision=True, patch_size=[16, 16, 16]).train()
    image = torch.randn(2, 2, 16, 16, 16)
    label = torch.randint(0, 4, (2, 1, 16, 16, 16))
    target = module.scheme.target(label)
    output = module(image)
    heads = [output[:, 0], *[h for h in module.net.heads]]
    assert [tuple(h.shape[2:]) for h in heads] == [(16,) * 3, (8,) * 3, (4,) * 3]
    weights = np.array([1.0, 0.5, 0.0]) / 1.5
    by_hand = 0.0
    for level, (head, weight) in enumerate(zip(heads, weights, strict=True)):
        step = 2**level
        start = step // 2
        scaled = target[:, :, start::step, start::step, start::step].float()
        by_hand += weight * (DiceLoss(sigmoid=True)(head, scaled) + F.binary_cross_entropy_with_logits(head, scaled))
    assert torch.allclose(module.training_loss(output, target), by_hand, atol=1e-6)
    # Scoring the upsampled heads against the full-resolution target is another number.
    upsampled = sum(w * (DiceLoss(sigmoid=True)(output[:, i], target.float())
                         + F.binary_cross_entropy_with_logits(output[:, i], target.float()))
                    for i, w in enumerate(weights))
    assert not torch.allclose(by_hand, upsampled, atol=1e-4)


def test_class_loss_is_dice_without_background_plus_cross_entropy_over_every_class():
    """nnU-Net's DC_and_CE_loss: soft Dice (smooth 1e-5) over the foreground channels, cross-entropy over all."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 6, 5, 4)
    label = torch.randint(0, 3, (2, 1, 6, 5, 4))
    probabilities = logits.softmax(1)
    onehot = F.one_hot(label[:, 0], 3).movedim(-1, 1).float()
    dims = (2, 3, 4)
    intersection = (probabilities * onehot).sum(dims)[:, 1:]
    denominator = (probabilities.sum(dims) + onehot.sum(dims))[:, 1:]
    dice = 1 - ((2 * intersection + 1e-5) / (denominator + 1e-5)).mean()
    expected = dice + F.cross_entropy(logits, label[:, 0])
    assert torch.allclose(build_loss("dice_ce", regions=False)(logits, label), expected, atol=1e-6)


def test_dice_and_hd95_equal_monais_metric_classes_and_an_absent_class_is_left_out():
    prediction, target = random_masks(2, (3, 2, 12, 10, 14)), random_masks(3, (3, 2, 12, 10, 14))
    target[2, 1] = 0  # an empty target: Dice counts a prediction there as 0, HD95 is undefined
    prediction[1, 0] = 0
    target[1, 0] = 0  # both empty: the class is absent from the case, Dice NaN (nnU-Net's compute_metrics)
    spacing = [[1.0, 2.0, 0.5], [1.0, 1.0, 1.0], [3.0, 1.0, 2.0]]
    dice, hd95 = subject_scores(prediction, target, spacing)

    # nnU-Net's Dice by hand: 2 TP / (2 TP + FP + FN), NaN where TP + FP + FN is 0.
    p, t = prediction.flatten(2).double(), target.flatten(2).double()
    tp, fp, fn = (p * t).sum(-1), (p * (1 - t)).sum(-1), ((1 - p) * t).sum(-1)
    by_hand = torch.where(tp + fp + fn > 0, 2 * tp / (2 * tp + fp + fn), torch.full_like(tp, float("nan")))
    assert torch.allclose(dice.double(), by_hand, equal_nan=True)
    dice_metric = DiceMetric(include_background=True, reduction="none", ignore_empty=False)
    hd_metric = HausdorffDistanceMetric(include_background=True, percentile=95, reduction="none")
    dice_metric(prediction, target)
    hd_metric(prediction, target, spacing=spacing)
    present = ~torch.isnan(dice)
    assert torch.allclose(dice[present], dice_metric.aggregate().float()[present])
    reference_hd = hd_metric.aggregate().float()
    finite = torch.isfinite(reference_hd)
    assert torch.allclose(hd95[finite], reference_hd[finite]) and torch.isnan(hd95[~finite]).all()
    assert torch.isnan(dice[1, 0]) and dice[2, 1] == 0

    # Gathered over updates (and ranks), each column is the mean over subjects; undefined values left out.
    scores = SubjectScores(2)
    scores.update(hd95[:2])
    scores.update(hd95[2:])
    assert torch.allclose(scores.compute(), reference_hd.masked_fill(~finite, float("nan")).nanmean(0).float())
    averaged = SubjectScores(2)
    averaged.update(dice)
    assert torch.allclose(averaged.compute().double(), by_hand.nanmean(0))


def test_a_model_predicting_background_everywhere_scores_0_not_the_absent_classes_1():
    """One class present in the truth, one absent from truth and prediction: the mean Dice is the present class's 0
    (the absent class was counted as 1 before, giving 0.5)."""
    module = Segmenter(num_classes=3, class_names=["a", "b"], features=[4, 8], patch_size=[8, 8, 8])
    label = torch.zeros(1, 1, 8, 8, 8, dtype=torch.int64)
    label[0, 0, 2:5, 2:5, 2:5] = 1
    with torch.no_grad():
        module.net = BackgroundOnly()
        module._evaluate({"image": torch.zeros(1, 1, 8, 8, 8), "label": label}, "val")
    dice = module.val_dice.compute()
    assert dice[0] == 0 and torch.isnan(dice[1]) and dice.nanmean() == 0


class BackgroundOnly(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(x.shape[0], 3, *x.shape[2:])
        logits[:, 0] = 10.0
        return logits


class Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


def test_sliding_window_of_an_identity_net_returns_the_input_on_a_non_divisible_volume():
    module = Segmenter(in_channels=3, num_classes=3, features=[4, 8], patch_size=[16, 16, 16], overlap=0.5)
    module.net = Identity()
    volume = torch.randn(1, 3, 37, 29, 41, generator=torch.Generator().manual_seed(0))
    out = module.window(volume)(module.net, volume)
    assert out.shape == volume.shape
    assert torch.allclose(out, volume, atol=1e-5)


def test_brats_regions_turn_back_into_the_same_label_map():
    scheme = LabelScheme(regions={"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]})
    label = torch.randint(0, 4, (2, 1, 6, 6, 6))
    regions = scheme.target(label)
    assert regions.shape == (2, 3, 6, 6, 6) and torch.equal(regions[:, 0].bool(), label[:, 0] > 0)
    assert torch.equal(scheme.label_map(regions), label)


def test_test_run_writes_masks_on_the_source_grid_with_brats_values_and_per_subject_metrics(tmp_path):
    root = write_brats_lps(tmp_path / "brats", subjects=5)
    cfg = compose_cfg(tmp_path / "run", [
        *TINY_FILES, "experiment=brats_segmentation", f"dataset.root={root}", "model.plan.patch_size=[16,16,16]",
        "model.plan.features=[4,8,16]", "dataset.transforms.spacing=[1.5,1.5,1.5]",
        "dataset.transforms.spatial_size=[16,16,32]",
        "dataset.val_fraction=0.2", "dataset.test_fraction=0.4", "dataset.batch_size=1", "dataset.num_workers=0",
        "test=true",
    ], tiny=False)
    metrics = run(cfg)
    assert {"test/dice", "test/dice_WT", "test/dice_TC", "test/dice_ET", "val/dice"} <= set(metrics)
    test_subjects = json.loads((tmp_path / "run" / "split.json").read_text())["test"]
    predictions = tmp_path / "run" / "predictions"
    assert sorted(p.name for p in predictions.glob("*.nii.gz")) == sorted(f"{s}_seg.nii.gz" for s in test_subjects)
    for subject in test_subjects:
        source = nib.load(str(root / subject / f"{subject}_seg.nii.gz"))
        mask = nib.load(str(predictions / f"{subject}_seg.nii.gz"))
        assert mask.shape == source.shape == SHAPE and np.allclose(mask.affine, source.affine)
        assert np.issubdtype(mask.get_data_dtype(), np.integer)
        assert set(np.unique(np.asarray(mask.dataobj)).tolist()) <= {0, 1, 2, 4}
    with (predictions / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["subject"] for r in rows] == sorted(test_subjects)
    assert {"dice_WT", "dice_TC", "dice_ET", "hd95_WT"} <= set(rows[0])
    assert np.mean([float(r["dice_WT"]) for r in rows] + [float(r["dice_TC"]) for r in rows]
                   + [float(r["dice_ET"]) for r in rows]) == pytest.approx(metrics["test/dice"], abs=1e-5)
    # The page and a picture per subject beside the masks; each structure's volume in metrics.csv.
    assert (predictions / "index.html").is_file() and {"volume_WT_ml", "volume_ET_ml"} <= set(rows[0])
    assert sorted(p.name for p in predictions.glob("*.png")) == sorted(f"{s}_seg.png" for s in test_subjects)
    # After training, the validation subjects on their source grids, and the post-processing chosen on them.
    val_subjects = json.loads((tmp_path / "run" / "split.json").read_text())["val"]
    validation = tmp_path / "run" / "validation"
    assert sorted(p.name for p in validation.glob("*_seg.nii.gz")) == sorted(f"{s}_seg.nii.gz" for s in val_subjects)
    assert "validation/dice_WT" in metrics and (tmp_path / "run" / "postprocessing.json").is_file()
    assert set(json.loads((tmp_path / "run" / "structure_volumes.json").read_text())) == {"WT", "TC", "ET"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.num_classes=2", "model.class_names=null"],
         r"label value 2( in \S+)? is outside the configured classes \(`model.num_classes`\)"),
        (["model.net=swinunetr", "model.patch_size=[48,48,48]"],
         r"`model.patch_size` is \[48, 48, 48\]; model.net=swinunetr"),
        (["model.net=swinunetr", "model.patch_size=[32,32,32]"], r"model.net=swinunetr needs sizes of at least 64"),
        (["model.patch_size=[32,32,32]"], r"`model.patch_size` \[32, 32, 32\] is larger than the training volume"),
        (["model.class_names=[core]"], r"`model.class_names` has 1 names; expected one per foreground class"),
        (["model.regions={WT:[1,2],TC:[2,3]}"],
         r"`model.regions`: WT \[1, 2\] and TC \[2, 3\] overlap without nesting"),
    ],
)
def test_bad_input_gets_one_clear_line(tmp_path, overrides, message):
    with pytest.raises(MedvolError, match=message):
        run(compose_cfg(tmp_path, ["model=segmentation", "trainer.fast_dev_run=true", *overrides]))


@pytest.mark.slow
def test_short_cpu_run_on_synthetic_lesions_reaches_dice_above_0_7(tmp_path):
    metrics = run(compose_cfg(tmp_path, [
        "model=segmentation", "dataset.image_modalities=[flair,t1ce]", "dataset.num_subjects=24", "dataset.size=24",
        "model.features=[8,16,32]", "model.patch_size=[16,16,16]", SYNTHETIC_REGIONS,
        "trainer.max_epochs=15", "model.optimizer.lr=3e-3",
    ]))
    assert metrics["val/dice_lesion"] > 0.7


@pytest.mark.slow
def test_two_gloo_ranks_give_the_metrics_of_one_process_with_an_odd_subject_count(tmp_path):
    # 13 subjects: 7 train, 3 val and 3 test, so the evaluation ranks hold 2 and 1 subjects.
    common = [
        *TINY_COMMON, *TINY_MODEL["segmentation"], "model=segmentation", SYNTHETIC_REGIONS, "model.patch_size=null",
        "dataset.num_subjects=13", "dataset.val_fraction=0.25", "dataset.test_fraction=0.25",
        "trainer.limit_train_batches=2", "trainer.max_epochs=2", "test=true",
        # Every rank samples the whole split (no partitioned cache), so the 2-rank batches are the single process's.
        "dataset.cache=none",
    ]
    ddp = train_cli(
        [*common, "strategy=ddp", "trainer.devices=2", "dataset.batch_size=1", *recorder(tmp_path / "ranks"),
         f"hydra.run.dir={tmp_path / 'ddp'}"],
        cwd=tmp_path, tiny=False,
    )
    assert ddp.returncode == 0, explain(ddp)
    single_dir = tmp_path / "single"
    single_dir.mkdir()
    run(compose_cfg(single_dir, [*common, "dataset.batch_size=2", *recorder(single_dir / "ranks")], tiny=False))

    ranks = [json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    single = json.loads((single_dir / "ranks" / "rank0.json").read_text())
    for stage in ("val", "test"):
        names = [f"{stage}/{m}" for m in ("dice", "dice_lesion", "dice_core", "loss")]
        for name in names:
            assert ranks[0][stage][name] == ranks[1][stage][name], f"{name} differs between ranks"
            assert ranks[0][stage][name] == pytest.approx(single[stage][name], rel=1e-4, abs=1e-6), name
    rows = [list(csv.DictReader((d / "predictions" / "metrics.csv").open())) for d in (tmp_path / "ddp", single_dir)]
    assert [r["subject"] for r in rows[0]] == [r["subject"] for r in rows[1]] and len(rows[0]) == 3
    for ddp_row, single_row in zip(*rows, strict=True):
        assert float(ddp_row["dice_lesion"]) == pytest.approx(float(single_row["dice_lesion"]), rel=1e-4, abs=1e-6)


def test_experiments_have_the_seed_values(tmp_path):
    brats = compose_cfg(tmp_path, ["experiment=brats_segmentation", "dataset.root=/data"], tiny=False)
    assert dict(brats.model.regions) == {"WT": [1, 2, 3], "TC": [1, 3],
                                         "ET": [3]} and brats.optimized_metric == "val/dice"
    assert len(brats.dataset.image_modalities) == 4 and list(brats.model.plan.patch_size) == [128, 128, 128]
    prs = compose_cfg(tmp_path, ["experiment=prs_segmentation"], tiny=False)
    assert (prs.dataset.batch_size, prs.model.optimizer.lr, prs.lr_scaling, prs.trainer.max_epochs) == (8, 1e-4,
                                                                                                        "linear", 20)
    assert prs.strategy._target_.endswith("DDPStrategy")


def test_a_label_on_another_grid_than_its_image_stops_before_training(tmp_path):
    root = write_brats_lps(tmp_path / "brats", subjects=3)
    seg = next(root.glob("*/*_seg.nii.gz"))
    nib.save(nib.Nifti1Image(np.zeros((10, 10, 10), dtype=np.uint8), np.eye(4)), str(seg))
    with pytest.raises(MedvolError, match="shape"):
        run(compose_cfg(tmp_path / "run", [*TINY_FILES, "experiment=brats_segmentation", f"dataset.root={root}",
                                           "trainer.fast_dev_run=true"], tiny=False))


@pytest.mark.parametrize("regions", [None, {"lesion": [1, 2], "core": [1]}])
def test_post_processing_keeps_the_largest_component_of_each_class_or_region(regions):
    module = Segmenter(in_channels=1, num_classes=3, regions=regions, features=[4, 8], largest_component=True)
    logits = torch.full((1, module.scheme.out_channels, 12, 12, 12), -5.0)
    logits[:, 0] = 5.0 if regions is None else -5.0  # background wins everywhere (classes)
    logits[:, 1, 6] = 10.0  # the large component: a plane that splits the background in two
    logits[:, 1, 1:4, 1:4, 1:4] = 10.0  # a small one, dropped
    label_map = module.label_maps(module.scheme.activation(logits))
    assert type(label_map) is torch.Tensor
    assert int((label_map == 1).sum()) == 144 and int(label_map[0, 0, 1:4, 1:4, 1:4].sum()) == 0
    without = Segmenter(in_channels=1, num_classes=3, regions=regions, features=[4, 8])
    assert int((without.label_maps(without.scheme.activation(logits)) == 1).sum()) == 144 + 27
    if regions is None:
        # Both halves of the background stay: the background is not cut down to one component.
        assert int((label_map == 0).sum()) == 12**3 - 144


class FixedLogits(torch.nn.Module):
    """A network whose output is given: the same logits whatever the input."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(x.shape[0], *self.logits.shape[1:]).clone()


def test_hd95_in_millimetres_and_dice_on_an_oblique_anisotropic_volume_equal_a_hand_count():
    # Target: a line of 10 voxels along axis 0. Prediction: the same line plus one voxel 2 voxels off it along
    # axis 1 and 1 along axis 2. Voxels are 0.5 x 2 x 3 mm, the grid turned 30 degrees about z (the affine's
    # columns keep their lengths). Every voxel of these thin masks is a surface voxel.
    # Prediction -> target distances: ten 0 mm and one sqrt((2 * 2)^2 + (1 * 3)^2) = 5 mm; target -> prediction:
    # all 0. The 95th percentile of the eleven sorted distances (linear interpolation) sits at position
    # 0.95 * 10 = 9.5, halfway between the tenth (0) and the eleventh (5): HD95 = 2.5 mm (in voxels it would
    # be sqrt(5) / 2 = 1.12; with the spacings reversed, sqrt(4^2 + 0.5^2) / 2 = 2.02; the maximum, 5).
    # Dice = 2 * 10 / (11 + 10) = 20 / 21.
    shape = (14, 6, 6)
    target = torch.zeros(1, 1, *shape, dtype=torch.int64)
    target[0, 0, 2:12, 2, 2] = 1
    predicted = target.clone()
    predicted[0, 0, 5, 4, 3] = 1
    logits = torch.cat([-5.0 * predicted, 5.0 * predicted], 1).float()  # argmax: class 1 exactly on the prediction
    angle = np.radians(30)
    turn = np.array([[np.cos(angle), -np.sin(angle), 0], [np.sin(angle), np.cos(angle), 0], [0, 0, 1]])
    affine = np.eye(4)
    affine[:3, :3] = turn @ np.diag([0.5, 2.0, 3.0])
    affine[:3, 3] = [10.0, -4.0, 7.0]

    # Without mirroring: the given output is the prediction (mirrored copies of a fixed output would average it).
    module = Segmenter(in_channels=1, num_classes=2, features=[4, 8], tta=False)
    module.net = FixedLogits(logits)
    batch = {"image": torch.zeros(1, 1, *shape), "label": target, "affine": torch.from_numpy(affine)[None]}
    with torch.no_grad():
        outputs = module.test_step(batch, 0)
    assert torch.equal(outputs["volumes"]["seg"], predicted)
    assert float(outputs["subject_metrics"]["hd95_class1"][0]) == pytest.approx(2.5, abs=1e-5)
    assert float(outputs["subject_metrics"]["dice_class1"][0]) == pytest.approx(20 / 21, abs=1e-6)
    assert float(module.test_hd95.compute()) == pytest.approx(2.5, abs=1e-5)  # one class: a scalar


def test_whole_volume_evaluation_blends_windows_with_gaussian_weights():
    module = Segmenter(in_channels=2, num_classes=2, features=[4, 8], patch_size=list(ROI), overlap=0.5,
                       sw_batch_size=3)
    module.net = PositionDependent()
    volume = torch.randn(1, 2, *VOLUME_SHAPE, generator=torch.Generator().manual_seed(1))
    out = module.window(volume)(module.net, volume)
    np.testing.assert_allclose(out[0].numpy(), hand_blend(volume[0].numpy(), gaussian_weights(ROI)), atol=1e-4)


def test_logits_go_to_the_source_grid_before_the_argmax_so_a_thin_structure_survives():
    # Model grid: 8^3 at 1 mm. Source grid: 2 mm along D (2x, not separated), its voxels at model depths 1.5, 3.5,
    # 5.5. A thin plane of class 1 at depth 1 (p 0.9), depth 2 at p 0.3: the source voxel at depth 1.5 lies halfway,
    # its logits the mean of theirs, p 0.66 > 0.5. Nearest-neighbour on the model-grid mask picks depth 2 (background)
    # and loses the plane.
    foreground = torch.full((8, 8, 8), 0.05)
    foreground[1], foreground[2] = 0.9, 0.3
    probabilities = torch.stack([1 - foreground, foreground])[None]
    logits = torch.log(probabilities)
    source_affine = torch.tensor([[2.0, 0, 0, 1.5], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.float64)
    batch = {
        "image": torch.zeros(1, 1, 8, 8, 8), "affine": torch.eye(4, dtype=torch.float64)[None],
        "source_affine": source_affine[None], "source_shape": torch.tensor([[3, 8, 8]]),
    }
    module = Segmenter(in_channels=1, num_classes=2, features=[4, 8])
    outputs = module.outputs_of(batch, logits, extras=["probabilities"])
    seg = outputs["volumes"]["seg"][0][0]
    assert seg.shape == (3, 8, 8) and bool((seg[0] == 1).all()) and not bool(seg[1:].any())
    # The reference: scipy's linear interpolation of each class's logits at the source voxels' positions, softmax.
    positions = np.meshgrid(np.arange(3) * 2 + 1.5, np.arange(8), np.arange(8), indexing="ij")
    expected = softmax(np.stack([map_coordinates(c.numpy(), positions, order=1) for c in logits[0]]), axis=0)
    np.testing.assert_allclose(outputs["volumes"]["probabilities"][0].numpy(), expected, atol=1e-5)
    assert np.array_equal(seg.numpy(), expected.argmax(0))
    # The old way, argmax on the model grid then nearest-neighbour: the plane is gone.
    nearest = to_source_grid(probabilities.argmax(1), (source_affine, (3, 8, 8)), torch.eye(4), "nearest")
    assert not bool(nearest.any())
    assert outputs["as_is"] == ["seg", "probabilities"]


def test_test_time_metrics_score_the_label_file_as_stored_on_the_source_grid(tmp_path):
    # The label file holds BraTS 2021's 4; the model's label 3 (ET) must meet it through `label_values`.
    truth = np.zeros((6, 6, 6), dtype=np.int16)
    truth[1:4, 1:4, 1:4] = 4
    truth[4, 4, 4] = 2
    path = tmp_path / "seg.nii.gz"
    affine = np.diag([2.0, 2.0, 2.0, 1.0])
    nib.save(nib.Nifti1Image(truth, affine), str(path))
    module = Segmenter(in_channels=1, regions={"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]}, features=[4, 8])
    logits = torch.full((1, 3, 6, 6, 6), -5.0)
    logits[0, :, 1:4, 1:4, 1:4] = 5.0  # WT, TC and ET on the cube; the oedema voxel missed
    batch = {
        "image": torch.zeros(1, 1, 6, 6, 6), "affine": torch.from_numpy(affine)[None],
        "source_affine": torch.from_numpy(affine)[None], "source_shape": torch.tensor([[6, 6, 6]]),
        "source_label_file": [str(path)], "label_values": torch.tensor([[0, 1, 2, 4]]),
        "label": torch.zeros(1, 1, 6, 6, 6, dtype=torch.int64),  # the model-grid label is not what is scored
    }
    metrics = module.outputs_of(batch, logits)["subject_metrics"]
    assert float(metrics["dice_ET"][0]) == pytest.approx(1.0) and float(metrics["dice_TC"][0]) == pytest.approx(1.0)
    assert float(metrics["dice_WT"][0]) == pytest.approx(2 * 27 / (27 + 28))
