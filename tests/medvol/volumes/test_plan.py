"""The segmentation plan from the data's fingerprint (medvol/volumes/plan.py, medvol/run/planning.py): each value
checked against numpy or nibabel on the files (the rules against nnU-Net itself: test_network_topology.py), and the
plan read back bit for bit by a resumed run and by predict.py."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from omegaconf import DictConfig

from datamodules.pipeline.transforms import PlannedNormalized
from datamodules.sources.brats import BratsDataModule
from datamodules.sources.example_data import write_brats
from datamodules.sources.nifti import NiftiDataModule
from medvol.core.build import build_model
from medvol.core.errors import MedvolError
from medvol.run.planning import planned
from medvol.run.predict_config import input_geometry, run_config, window_size
from medvol.run.predicting import predict
from medvol.run.training import run
from medvol.volumes.network_topology import feature_map_size, reference
from medvol.volumes.plan import DataFingerprint, background_values, make_plan
from medvol.volumes.sliding_window import SlidingWindow
from tests.conftest import compose_cfg
from tests.medvol.run.test_predict import predict_cfg, saved_run

# Per subject a different voxel size (mm), so the median differs from the mean on every axis.
SPACINGS = [(1.0, 1.0, 3.0), (1.2, 0.9, 5.0), (0.8, 1.1, 2.5), (1.0, 1.4, 6.0), (1.5, 1.0, 4.0), (0.9, 0.8, 3.5)]


def write_subjects(root: Path, spacings, ct: bool = False, shape=(24, 20, 12), seed: int = 0) -> Path:
    """`root/sub-N/image.nii.gz` and `label.nii.gz`: a bright box (MR) or a body in air (CT) holding a label blob."""
    rng = np.random.default_rng(seed)
    for i, spacing in enumerate(spacings):
        image = np.zeros(shape, np.float32) - (1000.0 if ct else 0.0)
        body = (slice(3, shape[0] - 4), slice(2, shape[1] - 3), slice(1, shape[2] - 2))
        image[body] = rng.normal(40.0 if ct else 300.0, 25.0, image[body].shape)
        label = np.zeros(shape, np.uint8)
        label[8 + i % 3 : 14 + i % 3, 6:11, 4:8] = 1
        image[label > 0] += 60.0
        affine = np.diag([*spacing, 1.0])
        folder = root / f"sub-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        nib.save(nib.Nifti1Image(image, affine), str(folder / "image.nii.gz"))
        nib.save(nib.Nifti1Image(label, affine), str(folder / "label.nii.gz"))
    return root


def datamodule(root: Path, tmp_path: Path, **kwargs) -> NiftiDataModule:
    return NiftiDataModule(
        root=str(root), pattern="{subject}/{modality}.nii.gz", label_file="{subject}/label.nii.gz",
        image_modalities=["image"], val_fraction=0.2, test_fraction=0.2, split_file=str(tmp_path / "split.json"),
        **kwargs,
    )


def test_the_planned_spacing_is_the_median_of_the_headers(tmp_path):
    data = datamodule(write_subjects(tmp_path / "data", SPACINGS), tmp_path)
    fingerprint = data.plan_fingerprint()
    headers = [nib.load(r["image"][0]).header.get_zooms()[:3] for r in data.training_records()]
    plan = make_plan(fingerprint, 512, 16)
    assert plan["spacing"] == pytest.approx(np.median(np.asarray(headers), axis=0).tolist())
    assert plan["spacing"] != pytest.approx(np.mean(np.asarray(headers), axis=0).tolist())


def test_ct_statistics_are_numpys_over_the_label_voxels_of_the_training_subjects(tmp_path):
    data = datamodule(write_subjects(tmp_path / "data", SPACINGS, ct=True), tmp_path)
    plan = make_plan(data.plan_fingerprint(), 512, 16)
    voxels = np.concatenate([
        np.asarray(nib.load(r["image"][0]).dataobj)[np.asarray(nib.load(r["label"]).dataobj) > 0]
        for r in data.training_records()
    ]).astype(np.float64)
    (channel,) = plan["normalization"]
    assert channel["kind"] == "ct"
    assert channel["clip"] == pytest.approx(np.percentile(voxels, [0.5, 99.5]).tolist())
    assert channel["mean"] == pytest.approx(voxels.mean())
    assert channel["std"] == pytest.approx(voxels.std())


def test_mr_data_is_planned_as_mr_and_modality_kind_overrides_it(tmp_path):
    root = write_subjects(tmp_path / "data", SPACINGS)
    (channel,) = make_plan(datamodule(root, tmp_path).plan_fingerprint(), 512, 16)["normalization"]
    assert channel["kind"] == "mr"
    forced = datamodule(root, tmp_path, modality_kind="ct")
    assert make_plan(forced.plan_fingerprint(), 512, 16, kinds=forced.modality_kind)["normalization"][0]["kind"] == "ct"


def test_mr_normalization_is_numpys_z_score_over_the_non_zero_mask_and_keeps_zeros():
    """With the mask (nnU-Net's `use_mask_for_norm`): one hole-filled mask of the voxels non-zero in any channel, so
    a zero inside the brain, or where only another channel is non-zero, is normalized and the air stays 0."""
    rng = np.random.default_rng(1)
    volume = np.zeros((2, 10, 9, 8), np.float32)
    volume[:, 2:8, 2:7, 1:6] = rng.normal(500.0, 80.0, (2, 6, 5, 5))
    volume[1, 8, 2:7, 1:6] = rng.normal(500.0, 80.0, (5, 5))  # a slab only channel 1 covers
    volume[:, 4, 4, 3] = 0.0  # a hole inside the brain in every channel: inside the filled mask
    volume[0, 5, 3, 2] = 0.0  # a zero in one channel only
    plans = [{"kind": "mr", "use_mask": True}] * 2
    out = PlannedNormalized(["image"], plans)({"image": torch.from_numpy(volume)})["image"]
    inside = np.zeros(volume.shape[1:], bool)
    inside[2:9, 2:7, 1:6] = True
    for c in range(2):
        expected = (volume[c][inside] - volume[c][inside].mean()) / volume[c][inside].std()
        assert np.asarray(out[c])[inside] == pytest.approx(expected, abs=1e-4)
        assert np.all(np.asarray(out[c])[~inside] == 0)


def test_mr_normalization_without_the_mask_is_numpys_z_score_of_the_whole_volume():
    """Integer MR without a zero background (nnU-Net: no mask): no speckle of 0 in the air."""
    volume = np.round(np.random.default_rng(2).normal(200.0, 30.0, (1, 8, 8, 8))).astype(np.float32)
    volume[0, :2] = 0.0
    out = PlannedNormalized(["image"], [{"kind": "mr", "use_mask": False}])({"image": torch.from_numpy(volume)})
    assert np.asarray(out["image"]) == pytest.approx((volume - volume.mean()) / volume.std(), abs=1e-4)


def test_ct_normalization_clips_then_uses_the_datasets_mean_and_deviation():
    volume = torch.tensor([[[[-1000.0, 0.0, 50.0, 3000.0]]]])
    plan = {"kind": "ct", "clip": [-100.0, 200.0], "mean": 40.0, "std": 20.0}
    out = PlannedNormalized(["image"], [plan])({"image": volume})["image"]
    expected = (np.clip([-1000.0, 0.0, 50.0, 3000.0], -100.0, 200.0) - 40.0) / 20.0
    assert np.asarray(out).ravel() == pytest.approx(expected)


def anisotropic(spacing=(0.8, 0.8, 4.0), shape=(120, 110, 30)) -> DataFingerprint:
    return DataFingerprint(
        np.asarray([spacing] * 3), np.asarray([shape] * 3), np.full(3, 0.9),
        [{"kind": "mr", "mean": 0.0, "std": 1.0, "low": 0.0, "high": 1.0}], {0: 1000, 1: 10},
    )


@pytest.mark.parametrize("budget_mib", [64, 512, 8192])
@pytest.mark.parametrize("fingerprint", [anisotropic(), anisotropic((1.0, 1.0, 1.0), (160, 190, 150))])
def test_a_planned_patch_and_batch_never_exceed_the_memory_budget(fingerprint, budget_mib):
    plan = make_plan(fingerprint, budget_mib, 16)
    estimate = feature_map_size(plan["patch_size"], plan["strides"], plan["features"], 2)
    assert estimate * 2 / 2 <= reference(budget_mib)
    assert plan["memory_estimate_mib"] <= 1.5 * budget_mib == 1.5 * plan["memory_budget_mib"]


def tiny_planned_run(tmp_path: Path, data: Path, extra=()) -> list[str]:
    return [
        "model=segmentation", "dataset=nifti", f"dataset.root={data}", "dataset.label_file='{subject}/label.nii.gz'",
        "dataset.image_modalities=[image]", "model.num_classes=2", "model.class_names=[lesion]",
        "dataset.val_fraction=0.2", "dataset.test_fraction=0.2", "dataset.num_workers=0", "model.plan.base_features=4",
        "hardware=cpu", "callbacks.progress_bar=null", "callbacks.model_summary=null", "trainer.max_epochs=1",
        "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1", "model.plan.iterations_per_epoch=2", *extra,
    ]


def test_a_plan_is_written_once_and_a_resume_and_predict_take_it_from_the_run(tmp_path, caplog):
    data = write_subjects(tmp_path / "data", SPACINGS)
    run_dir = tmp_path / "run"
    cfg = compose_cfg(run_dir, tiny_planned_run(tmp_path, data), tiny=False)
    saved_run(run_dir, cfg)
    plan_file = run_dir / "plan.json"
    text = plan_file.read_text()
    plan = json.loads(text)
    last = run_dir / "checkpoints" / "last.ckpt"
    # The resume and predict read the run's record, which holds the plan as training applied it (a patch no
    # fingerprint would give, so it must come from the record, not from a new plan); plan.json is kept as it was.
    record = json.loads((run_dir / "run.json").read_text())
    record["values"]["model"]["patch_size"] = [8, 8, 4]
    record["values"]["dataset"]["transforms"]["augmentation"]["patch"] = [8, 8, 4]
    (run_dir / "run.json").write_text(json.dumps(record))
    # Only the checkpoint and the epochs: the run's own overrides come from its record.
    caplog.clear()
    with caplog.at_level("INFO", logger="medvol"):
        run(compose_cfg(run_dir, [f"ckpt_path={last}", "trainer.max_epochs=2"], tiny=False))
    assert f"plan: as recorded in {plan_file}" in caplog.text and "plan: written to" not in caplog.text
    assert plan_file.read_text() == text
    assert torch.load(last, weights_only=True)["hyper_parameters"]["patch_size"] == [8, 8, 4]
    recorded = run_config(str(last))
    assert window_size(recorded) == [8, 8, 4]
    assert list(recorded.dataset.transforms.spacing) == plan["spacing"]
    # A run from before records: the plan of its plan.json is applied when its config is converted (a plan no
    # fingerprint would give, so it must come from the file, not from a new plan).
    (run_dir / "run.json").unlink()
    plan["patch_size"], plan["foreground_ratio"] = [8, 8, 8], 0.6
    plan_file.write_text(json.dumps(plan, indent=2) + "\n")
    converted = run_config(str(last))
    assert window_size(converted) == [8, 8, 8]
    assert converted.dataset.transforms.foreground_ratio == 0.6
    # predict.py end to end: masks on each input's own grid, through the plan's spacing, crop and normalization.
    out = tmp_path / "out"
    predict(predict_cfg(f"ckpt_path={last}", f"input={data / 'sub-3' / 'image.nii.gz'}", f"output_dir={out}"))
    mask, source = nib.load(str(out / "image_seg.nii.gz")), nib.load(str(data / "sub-3" / "image.nii.gz"))
    assert mask.shape == source.shape and np.allclose(mask.affine, source.affine)


def test_the_plan_lines_name_every_choice_and_an_override_wins(tmp_path):
    data = write_subjects(tmp_path / "data", SPACINGS)
    cfg = compose_cfg(tmp_path / "run", tiny_planned_run(tmp_path, data, ["model.plan.patch_size=[16,16,8]"]),
                      tiny=False)
    built = NiftiDataModule(**{k: v for k, v in cfg.dataset.items() if k != "_target_"})
    planned_cfg, lines = planned(cfg, built, "cpu")
    assert list(planned_cfg.model.patch_size) == [16, 16, 8] and planned_cfg.model.net == "dynunet"
    text = "\n".join(lines)
    for word in ("spacing", "normalization", "labels {'0':", "patch 16x16x8", "batch", "2 batches an epoch",
                 "DynUNet", "deep supervision", "poly", "augmentation as nnU-Net's", "patch_size"):
        assert word in text


def test_predict_keeps_each_inputs_spacing_when_training_kept_it(tmp_path):
    data = datamodule(write_subjects(tmp_path / "data", SPACINGS), tmp_path, transforms={"spacing": None})
    data.setup()
    record = data.fingerprint()
    assert record["resampled"] is False
    assert "spacing" not in input_geometry(None, record)
    assert input_geometry(None, record, refines=True)["spacing"] == record["spacing"]
    resampled = datamodule(tmp_path / "data", tmp_path, transforms={"spacing": [2.0, 2.0, 2.0]})
    resampled.setup()
    assert input_geometry(None, resampled.fingerprint())["spacing"] == [2.0, 2.0, 2.0]


def test_windows_past_a_small_volume_are_padded_with_the_training_background_per_channel():
    volume = torch.rand(1, 2, 5, 6, 7)
    seen = []

    def network(window):
        seen.append(window.clone())
        return window

    out = SlidingWindow.of([8, 8, 8], pad_value=(-1.0, 0.5))(network, volume)
    # MONAI's symmetric split of the missing voxels: half before (rounded down), the rest after.
    expected = np.stack([
        np.pad(volume[0, c].numpy(), [(1, 2), (1, 1), (0, 1)], constant_values=v) for c, v in enumerate((-1.0, 0.5))
    ])
    np.testing.assert_array_equal(seen[0][0].numpy(), expected)
    assert torch.equal(out, volume)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["dataset=nifti", "dataset.root=/data", "model.num_classes=3"], [-1.0]),  # percentile scaling into [-1, 1]
        (["dataset=nifti", "dataset.root=/data", "dataset.transforms.output_range=[0,1]", "model.num_classes=3"],
         [0.0]),
        (["model.num_classes=3"], [-1.0]),  # the synthetic phantoms in [-1, 1]
    ],
)
def test_the_segmenters_windows_pad_with_the_datasets_background(tmp_path, overrides, expected):
    cfg = compose_cfg(tmp_path, ["model=segmentation", *overrides], tiny=False)
    assert list(cfg.model.pad_value) == expected
    module = build_model(cfg.model)
    seen = []
    module.net.register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0].clone()))
    module.probabilities(torch.ones(1, 1, 4, 4, 4))
    assert float(seen[0].min()) == expected[0]


def test_a_ct_channels_background_is_its_clipped_air_in_z_units():
    plan = [{"kind": "ct", "clip": [-120.0, 300.0], "mean": 60.0, "std": 30.0}, {"kind": "mr"}]
    assert background_values(plan) == [(-120.0 - 60.0) / 30.0, 0.0]


# The final validation WT Dice the planned default must reach on 16 real-anatomy subjects at 4 mm in 25 epochs,
# and the old default as a user gets it (model.plan.use=false: 16^3 label-balanced patches, every volume padded to
# 128^3) stayed below. Calibrated on the 2 shared CPU cores: planned 0.634, old 0.481 (8 to 17 min for both runs).
LEARNS_WT_DICE = 0.56


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_planned_default_learns_on_real_anatomy(tmp_path):
    """The default segmentation command learns brain lesions on real anatomy (0.634 WT Dice when calibrated). The old
    default (`model.plan.use=false`) reached 0.481 on the same run, under the threshold: the mutation
    `seg-plan-default-off` (benchmarks/trust/mutations/segmentation-plan.yaml) runs it in place of the default, kept out
    of the suite since it doubles a 7-minute test."""
    pytest.importorskip("nilearn.datasets")
    from datamodules.sources.brain_lesions import write_brain_lesions

    root = write_brain_lesions(tmp_path / "data", 16, (4.0, 4.0, 4.0))
    common = [
        "model=segmentation", "dataset=brats", f"dataset.root={root}", "dataset.label_regions=[WT,TC,ET]",
        "dataset.val_fraction=0.25", "dataset.test_fraction=0.0", "dataset.num_workers=0", "trainer.max_epochs=25",
        "hardware=cpu", "callbacks.progress_bar=null", "callbacks.model_summary=null", "trainer.num_sanity_val_steps=0",
        # As many batches an epoch as one pass over the 12 training subjects (the plan's 250 would take hours here).
        "logger=none", "model.plan.iterations_per_epoch=6",
    ]
    planned_dice = run(compose_cfg(tmp_path / "planned", common, tiny=False))["val/dice_WT"]
    assert planned_dice > LEARNS_WT_DICE, planned_dice


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.plan.use=maybe", r"`model.plan.use` is 'maybe'; expected auto, true or false"),
        ("dataset.modality_kind=pet", r"`dataset.modality_kind` is 'pet'; expected auto, mr, ct"),
        ("model.plan.memory_budget_mib=-1", r"`model.plan.memory_budget_mib` is -1; expected a positive number"),
    ],
)
def test_bad_plan_settings_are_one_line_before_training(tmp_path, override, message):
    data = write_subjects(tmp_path / "data", SPACINGS[:3])
    with pytest.raises(MedvolError, match=message):
        run(compose_cfg(tmp_path / "run", tiny_planned_run(tmp_path, data, [override]), tiny=False))
    assert not (tmp_path / "run" / "plan.json").exists()


def test_a_binary_mask_trains_as_two_classes_and_the_plan_counts_its_labels(tmp_path):
    """`model.num_classes` null: the classes come from the label maps (0 and 1: two, the binary mask's), with
    their voxel counts as numpy counts them."""
    data = write_subjects(tmp_path / "data", SPACINGS)
    cfg = compose_cfg(tmp_path / "run", tiny_planned_run(
        tmp_path, data, ["model.num_classes=null", "model.class_names=null"]), tiny=False)
    built = NiftiDataModule(**{k: v for k, v in cfg.dataset.items() if k != "_target_"})
    planned_cfg, _ = planned(cfg, built, "cpu")
    assert planned_cfg.model.num_classes == 2 and list(planned_cfg.model.class_names) == ["class1"]
    assert build_model(planned_cfg.model).scheme.out_channels == 2
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    labels = np.concatenate([np.asarray(nib.load(r["label"]).dataobj).ravel() for r in built.training_records()])
    values, counts = np.unique(labels, return_counts=True)
    assert plan["labels"] == {str(v): int(c) for v, c in zip(values, counts, strict=True)}


@pytest.mark.parametrize(("classes", "message"), [
    ("null", r"label value 5 in \S+sub-\d/label.nii.gz is outside consecutive classes"),
    ("3", r"label value 5 in \S+sub-\d/label.nii.gz is outside the classes 0..2 of `model.num_classes=3`"),
])
def test_a_label_value_outside_the_classes_is_refused_naming_its_file(tmp_path, classes, message):
    data = write_subjects(tmp_path / "data", SPACINGS)
    for folder in sorted(data.iterdir()):
        path = folder / "label.nii.gz"
        label = nib.load(str(path))
        values = np.asarray(label.dataobj).copy()
        values[0, 0, 0] = 5
        nib.save(nib.Nifti1Image(values, label.affine), str(path))
    cfg = compose_cfg(tmp_path / "run", tiny_planned_run(
        tmp_path, data, [f"model.num_classes={classes}", "model.class_names=null"]), tiny=False)
    built = NiftiDataModule(**{k: v for k, v in cfg.dataset.items() if k != "_target_"})
    with pytest.raises(MedvolError, match=message):
        planned(cfg, built, "cpu")
    assert not (tmp_path / "run" / "plan.json").exists()


def _brats_planned(tmp_path: Path, root: Path, *overrides: str) -> DictConfig:
    cfg = compose_cfg(tmp_path / "run", [
        "model=segmentation", "dataset=brats", f"dataset.root={root}", "dataset.num_workers=0", *overrides,
    ], tiny=False)
    built = BratsDataModule(**{k: v for k, v in cfg.dataset.items() if k != "_target_"})
    return planned(cfg, built, "cpu")[0]


@pytest.mark.parametrize("num_classes", [None, 4])
def test_brats_plans_its_four_classes_named_as_brats_names_them_even_where_one_is_absent(tmp_path, num_classes):
    """Issue 49 item 11: BraTS training labels without a necrotic core ({0, 2, 4}: what the example data wrote)
    stopped the plan ("label value 3 ... outside consecutive classes"), and `model.num_classes=4` named the classes
    class1..3: BraTS declares its classes, 1 necrotic core (NCR), 2 oedema (ED), 3 enhancing tumour (ET)."""
    root = write_brats(tmp_path / "brats", 4, 2021, 16)
    for seg in root.glob("*/*_seg.nii.gz"):
        image = nib.load(str(seg))
        values = np.asarray(image.dataobj).copy()
        values[values == 1] = 4
        nib.save(nib.Nifti1Image(values, image.affine), str(seg))
    overrides = [] if num_classes is None else [f"model.num_classes={num_classes}"]
    cfg = _brats_planned(tmp_path, root, *overrides)
    assert cfg.model.num_classes == 4 and list(cfg.model.class_names) == ["NCR", "ED", "ET"]
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["labels"].keys() == {"0", "2", "3"}


def test_a_label_value_beyond_the_classes_brats_declares_is_refused(tmp_path):
    root = write_brats(tmp_path / "brats", 3, 2023, 16)
    seg = next(root.glob("*/*-seg.nii.gz"))
    image = nib.load(str(seg))
    values = np.asarray(image.dataobj).copy()
    values[0, 0, 0] = 5
    nib.save(nib.Nifti1Image(values, image.affine), str(seg))
    with pytest.raises(MedvolError, match=r"label value 5 in \S+-seg.nii.gz is outside the classes 0..3 of the "
                                          r"dataset's classes"):
        _brats_planned(tmp_path, root)
