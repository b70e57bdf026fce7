"""X-ray-to-CT: the cascade as one command, stage hand-over, resume inside a stage, HU outputs, bad input."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from datamodules.sources.example_data import write_xray_ct
from lightning_modules.xray2ct.module import XrayToCT
from medvol.core.build import build
from medvol.core.errors import MedvolError
from medvol.run import predict_config
from medvol.run.predicting import predict
from medvol.run.radiographs import model_views, view_geometry
from medvol.run.training import run
from tests.conftest import TINY_COMMON, TINY_MODEL, compose_cfg
from tests.medvol.run.test_predict import predict_cfg

# Two tiny stages (8^3 -> 16^3), 16 px views, a 2-level UNet, 4 Fast-DDPM steps.
TINY_CASCADE = [
    *[o for o in TINY_COMMON if not o.startswith("dataset.size")],
    "experiment=xray2ct_cascade",
    *TINY_MODEL["xray2ct"],
    "test=false",
    "cascade.stages=[1,2]",
    "cascade.stage1={dataset:{size:8,spacing:24.0,batch_size:2},trainer:{max_epochs:2}}",
    "cascade.stage2={dataset:{size:16,spacing:12.0,batch_size:2},trainer:{max_epochs:1}}",
]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _network(checkpoint: Path, prefix: str) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def cascade_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cascade")
    cfg = compose_cfg(root, TINY_CASCADE, tiny=False)
    metrics = run(cfg)
    # Where train.py saves the run's config (predict.py reads it).
    (root / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save({k: v for k, v in cfg.items() if k != "hydra"}, root / ".hydra" / "config.yaml")
    return root, metrics


def test_cascade_runs_every_stage_in_one_command(cascade_run):
    root, metrics = cascade_run
    for stage in (1, 2):
        assert (root / f"stage{stage}" / "best.ckpt").is_file()
        assert (root / f"stage{stage}" / "tensorboard").is_dir()
        assert f"stage{stage}/val/psnr" in metrics
    assert "val/physics_loss" in metrics and np.isfinite(metrics["val/physics_loss"])
    # Beside PSNR/SSIM over the cube, the body's (true CT above -500 HU) MAE in HU, PSNR and SSIM.
    for name in ("body_mae_hu", "body_psnr", "body_ssim"):
        assert np.isfinite(metrics[f"val/{name}"]) and metrics[f"val/{name}"] != 0.0, name
    assert 1.0 < metrics["val/body_mae_hu"] < 4095.0
    stage2 = OmegaConf.load(root / "stage2" / "config.yaml")
    assert stage2.model.init_from == str(root / "stage1" / "best.ckpt")
    assert list(stage2.model.previous_stages) == [str(root / "stage1" / "best.ckpt")]
    # Stage 2 holds stage 1's network, frozen, so its checkpoint generates from X-rays alone.
    stage1_ema = _network(root / "stage1" / "best.ckpt", "ema.module.")
    stage2_previous = _network(root / "stage2" / "best.ckpt", "previous.0.")
    assert stage1_ema.keys() == stage2_previous.keys()
    assert all(torch.equal(stage1_ema[k], stage2_previous[k]) for k in stage1_ema)


def test_stage_two_starts_from_stage_one_best_weights(cascade_run):
    root, _ = cascade_run
    best = root / "stage1" / "best.ckpt"
    stage1 = _network(best, "ema.module.")
    module = XrayToCT(
        stage=2, size=16, xray_size=(16, 16), channels=(8, 16), attention_levels=(False, True), num_head_channels=8,
        encoder_channels=(8, 16), token_dim=16, timesteps=4, previous_stages=[str(best)], init_from=str(best),
    )
    started = module.network.state_dict()
    first_conv = "unet.conv_in.conv.weight"
    for name, tensor in stage1.items():
        if name == first_conv:
            # Input channels are [previous, z, y, x, x_t]: x_t's filters carry over, the new channels start at zero.
            assert torch.equal(started[name][:, -1:], tensor)
            assert torch.count_nonzero(started[name][:, :-1]) == 0
        elif name.startswith("unet.out.2."):
            # A residual stage's output layer starts at zero (stage 1's predicts a whole CT, not a correction).
            assert torch.count_nonzero(started[name]) == 0 < torch.count_nonzero(tensor), name
        else:
            assert torch.equal(started[name], tensor), name


def test_resume_in_stage_two_continues_stage_two_and_never_touches_stage_one(cascade_run, tmp_path):
    root, _ = cascade_run
    stage1_best = _digest(root / "stage1" / "best.ckpt")
    stage1_last = _digest(root / "stage1" / "checkpoints" / "last.ckpt")
    last = root / "stage2" / "checkpoints" / "last.ckpt"
    before = torch.load(last, map_location="cpu", weights_only=True)
    overrides = [
        *[o for o in TINY_CASCADE if not o.startswith("cascade.stage2=")],
        "cascade.stage2={dataset:{size:16,spacing:12.0,batch_size:2},trainer:{max_epochs:2}}",
        f"ckpt_path={last}",
    ]
    metrics = run(compose_cfg(tmp_path / "elsewhere", overrides, tiny=False))
    after = torch.load(last, map_location="cpu", weights_only=True)
    assert (before["epoch"], after["epoch"]) == (0, 1)
    assert after["global_step"] > before["global_step"]
    assert _digest(root / "stage1" / "best.ckpt") == stage1_best
    assert _digest(root / "stage1" / "checkpoints" / "last.ckpt") == stage1_last
    assert "stage1/val/psnr" not in metrics and "stage2/val/psnr" in metrics
    assert not (tmp_path / "elsewhere" / "stage1").exists()


def test_test_time_ct_is_written_in_hounsfield_units_on_the_subject_grid(tmp_path):
    overrides = [*TINY_CASCADE, "cascade.stages=[1]", "test=true"]
    run(compose_cfg(tmp_path, overrides, tiny=False))
    files = sorted((tmp_path / "stage1" / "predictions").glob("*_ct.nii.gz"))
    assert files
    image = nib.load(files[0])
    assert image.shape == (8, 8, 8)
    assert np.allclose(np.diag(image.affine)[:3], 24.0)
    data = np.asarray(image.dataobj)
    # HU, unclamped: a tiny model's voxel may leave the window (tested by hand elsewhere).
    assert np.isfinite(data).all()
    assert data.max() - data.min() > 50.0  # HU, not model units in [-1, 1]
    target = np.asarray(nib.load(str(files[0]).replace("_ct.", "_target.")).dataobj)
    assert target.min() == pytest.approx(-1000.0, abs=1.0)  # air around the head


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dataset.views=[]", "has no `xray` views"),
        ("model.views=[ap]", "X-ray views, model.views lists 1"),
        ("cascade.stage2={dataset:{size:8,spacing:24.0},trainer:{max_epochs:1}}", "does not grow from stage 1"),
        ("cascade.stage1={dataset:{size:9,spacing:20.0},trainer:{max_epochs:1}}",
         "must divide by the network's downsampling"),
    ],
)
def test_bad_input_gets_one_clear_line(tmp_path, override, message):
    with pytest.raises(MedvolError, match=message):
        run(compose_cfg(tmp_path, [*TINY_CASCADE, override], tiny=False))


def test_a_view_count_other_than_the_previous_stage_is_refused(cascade_run):
    root, _ = cascade_run
    with pytest.raises(MedvolError, match="differ from the views"):
        XrayToCT(stage=2, size=16, views=("ap",), previous_stages=[str(root / "stage1" / "best.ckpt")])


def test_a100_preset_has_the_seed_stage_table(tmp_path):
    cfg = compose_cfg(tmp_path, ["experiment=xray2ct_a100x4", "dataset.root=/data/ct"], tiny=False)
    assert cfg.trainer.devices == 4 and cfg.trainer.precision == "bf16-mixed"
    assert cfg.model.prediction_type == "v" and cfg.model.num_train_timesteps == 1000
    table = []
    for stage in (1, 2, 3):
        merged = OmegaConf.merge(cfg, cfg.cascade[f"stage{stage}"])
        size = list(OmegaConf.to_container(merged.model, resolve=True)["size"])
        table.append((size[0], merged.dataset.batch_size, merged.trainer.max_epochs, merged.model.prediction_type))
    # Stages 2 and 3 predict the clean residual over the upsampled previous stage (they start at identity).
    assert table == [(64, 16, 100, "v"), (128, 8, 100, "sample"), (256, 4, 100, "sample")]
    assert cfg.model.residual is True


def test_a_bad_value_in_a_later_stage_stops_the_cascade_before_stage_one_trains(tmp_path):
    bad = "cascade.stage2={dataset:{size:16,spacing:12.0},trainer:{max_epochs:-5}}"
    with pytest.raises(MedvolError, match="max_epochs"):
        run(compose_cfg(tmp_path, [*TINY_CASCADE, bad], tiny=False))
    assert not (tmp_path / "stage1").exists()


def _radiographs_alone(tmp_path: Path, subjects: int = 2, size: int = 16, seed: int = 5) -> Path:
    """Example radiographs of 16 px (the fixture's views) over a 192 mm field of view, their CTs moved away."""
    folder = write_xray_ct(tmp_path / "xr", subjects, size=size, field_of_view=192.0, xray_size=(16, 16), seed=seed)
    for ct in folder.glob("*_ct.nii.gz"):
        ct.rename(tmp_path / ct.name)
    return folder


def test_a_ct_from_radiographs_alone_is_the_test_time_ct_of_the_same_views(cascade_run, tmp_path):
    root, _ = cascade_run
    folder = _radiographs_alone(tmp_path)
    out = tmp_path / "out"
    checkpoint = root / "stage2" / "best.ckpt"
    predict(predict_cfg(f"ckpt_path={checkpoint}", f"input={folder}", f"output_dir={out}"))
    # The reference: the views dataset=synthetic computes for the same phantoms (seed 5) on stage 2's grid,
    # generated through every stage as test=true generates them.
    cfg = OmegaConf.load(root / "stage2" / "config.yaml")
    datamodule = build(OmegaConf.merge(cfg.dataset, {"seed": 5, "num_subjects": 2, "split_file": None}))
    dataset = datamodule.build_dataset(datamodule.subjects(), "test")
    module = XrayToCT.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True).eval()
    assert sorted(p.name for p in out.iterdir()) == ["phantom-5-0000_ct.nii.gz", "phantom-5-0001_ct.nii.gz",
                                                     "predict.log"]
    # The views predict.py reads from the files, in the model's range and order, are the dataset's.
    read = model_views(folder, view_geometry(predict_config.run_config(str(checkpoint))))
    for item in dataset:
        torch.testing.assert_close(read[item["subject"]], item["xray"], atol=1e-5, rtol=0)
        written = nib.load(str(out / f"{item['subject']}_ct.nii.gz"))
        expected = module.generate(item["xray"][None], [16, 16, 16], [item["subject"]])["ct"][0, 0]
        # The preset's window [-1000, 1000] HU mapped onto [-1, 1], undone by hand, unclamped.
        np.testing.assert_allclose(written.get_fdata(), expected.numpy() * 1000.0, atol=2e-2)
        # Stage 2's grid: 16^3 voxels of 12 mm, RAS, centred on the origin as the training phantoms.
        np.testing.assert_allclose(written.affine,
                                   np.diag([12.0, 12.0, 12.0, 1.0]) + np.array([[0, 0, 0, -90]] * 3 + [[0, 0, 0, 0]]))


def test_num_samples_from_radiographs_writes_the_seeded_draws_their_mean_and_std(cascade_run, tmp_path):
    root, _ = cascade_run
    folder = _radiographs_alone(tmp_path, subjects=1)
    out = tmp_path / "out"
    checkpoint = root / "stage2" / "best.ckpt"
    predict(predict_cfg(f"ckpt_path={checkpoint}", f"input={folder}", f"output_dir={out}", "num_samples=3"))
    names = ["ct_0", "ct_1", "ct_2", "ct_mean", "ct_std"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*(f"phantom-5-0000_{n}.nii.gz" for n in names),
                                                            "predict.log"])
    module = XrayToCT.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True).eval()
    views = model_views(folder, view_geometry(predict_config.run_config(str(checkpoint))))["phantom-5-0000"][None]
    # Draw k is seeded sample_seed + k; HU by the preset's window, undone by hand.
    draws = np.stack([
        module.generate(views, [16, 16, 16], ["phantom-5-0000"], seed=module.sample_seed + k)["ct"][0,
                                                                                                    0].numpy() * 1000.0
        for k in range(3)
    ])
    assert np.abs(draws[0] - draws[1]).max() > 1.0  # seeded draws differ
    for k in range(3):
        np.testing.assert_allclose(nib.load(str(out / f"phantom-5-0000_ct_{k}.nii.gz")).get_fdata(), draws[k],
                                   atol=2e-2)
    np.testing.assert_allclose(nib.load(str(out / "phantom-5-0000_ct_mean.nii.gz")).get_fdata(), draws.mean(0),
                               atol=2e-2)
    np.testing.assert_allclose(nib.load(str(out / "phantom-5-0000_ct_std.nii.gz")).get_fdata(), draws.std(0, ddof=1),
                               atol=2e-2)


def test_a_moved_cascade_run_predicts_from_its_checkpoint_alone(cascade_run, tmp_path):
    root, _ = cascade_run
    folder = _radiographs_alone(tmp_path)
    predict(predict_cfg(f"ckpt_path={root / 'stage2' / 'best.ckpt'}", f"input={folder}",
                        f"output_dir={tmp_path / 'here'}"))
    # The run copied to another machine: its config and its checkpoint's hyperparameters still name the earlier
    # stage's files where it was trained, which do not exist here.
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    elsewhere = "/cluster/runs/gone/stage1/best.ckpt"
    config = OmegaConf.load(moved / "stage2" / "config.yaml")
    config.model.previous_stages, config.model.init_from = [elsewhere], elsewhere
    OmegaConf.save(config, moved / "stage2" / "config.yaml")
    checkpoint = torch.load(moved / "stage2" / "best.ckpt", map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"].update(previous_stages=[elsewhere], init_from=elsewhere)
    torch.save(checkpoint, moved / "stage2" / "best.ckpt")
    shutil.rmtree(moved / "stage1")

    predict(predict_cfg(f"ckpt_path={moved / 'stage2' / 'best.ckpt'}", f"input={folder}",
                        f"output_dir={tmp_path / 'there'}"))
    for name in ("phantom-5-0000_ct.nii.gz", "phantom-5-0001_ct.nii.gz"):
        assert np.array_equal(nib.load(str(tmp_path / "there" / name)).get_fdata(),
                              nib.load(str(tmp_path / "here" / name)).get_fdata())
    # Lightning's own loading builds the same stage: stage 1's network from the checkpoint, equal to stage 1's EMA.
    module = XrayToCT.load_from_checkpoint(moved / "stage2" / "best.ckpt", map_location="cpu", weights_only=True)
    stage1_ema = _network(root / "stage1" / "best.ckpt", "ema.module.")
    assert all(torch.equal(module.previous[0].state_dict()[k], v) for k, v in stage1_ema.items())
    assert module.previous_settings[0]["stage"] == 1 and "previous_settings" not in module.previous_settings[0]


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("missing", r"subject phantom-5-0001 has no lateral view \(phantom-5-0001_lateral.nii.gz\)"),
        ("size", r"phantom-5-0001_ap.nii.gz is a 8x8 image; the model was trained on 16x16 ap radiographs"),
        ("spacing", r"phantom-5-0001_ap.nii.gz has pixels of 6 x 6 mm; the model's ap radiographs have 12 x 12 mm"),
    ],
)
def test_bad_radiographs_are_one_clear_line_and_nothing_is_written(cascade_run, tmp_path, breakage, message):
    root, _ = cascade_run
    folder = _radiographs_alone(tmp_path)
    view = folder / "phantom-5-0001_ap.nii.gz"
    image = nib.load(str(view))
    if breakage == "missing":
        (folder / "phantom-5-0001_lateral.nii.gz").unlink()
    elif breakage == "size":
        # Every other pixel, the header's orientation kept and its pixels twice the size.
        nib.save(nib.Nifti1Image(np.asarray(image.dataobj)[::2, ::2], image.affine @ np.diag([2.0, 2.0, 1.0, 1.0])),
                 str(view))
    else:
        nib.save(nib.Nifti1Image(np.asarray(image.dataobj), image.affine @ np.diag([0.5, 0.5, 1.0, 1.0])), str(view))
    with pytest.raises(MedvolError, match=message):
        predict(predict_cfg(f"ckpt_path={root / 'stage2' / 'best.ckpt'}", f"input={folder}",
                            f"output_dir={tmp_path / 'out'}"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
# Stage 1 is the preset's 30 epochs: 102 s for the test on 2 idle cores (2026-11-24).
@pytest.mark.timeout(1500)
def test_a_crop_trained_stage_beats_its_identity_baseline_on_the_cpu_preset(tmp_path):
    # The CPU preset's stages 1 and 2 as they are (stage 2: 16^3 crops of 24^3, sampled by 16^3 windows).
    cfg = compose_cfg(tmp_path, ["experiment=xray2ct_cascade", "cascade.stages=[1,2]", "test=false", "logger=none",
                                 "callbacks.volume_slices=null"], tiny=False)
    run(cfg)
    stage2 = OmegaConf.load(tmp_path / "stage2" / "config.yaml")
    assert stage2.model.crop_size == 16 and stage2.dataset.size == 24
    module = XrayToCT.load_from_checkpoint(tmp_path / "stage2" / "best.ckpt", map_location="cpu", weights_only=True)
    datamodule = build(stage2.dataset)
    datamodule.setup("test")
    subjects = [datamodule.datasets["test"][i] for i in range(len(datamodule.datasets["test"]))]
    views = torch.stack([s["xray"] for s in subjects])
    generated = module.eval().generate(views, [24, 24, 24], [str(s["subject"]) for s in subjects])
    # The identity baseline: stage 1's CT of the same views, upsampled trilinearly (half-pixel centres).
    identity = torch.nn.functional.interpolate(generated["stage1"], size=(24, 24, 24), mode="trilinear",
                                               align_corners=False)

    def body_errors(guesses: torch.Tensor) -> np.ndarray:
        # HU by the preset's window [-1000, 1000]; the body: the true CT above -500 HU, over every test subject.
        truth = np.stack([s["image"][0].numpy() for s in subjects]) * 1000.0
        return np.abs(guesses[:, 0].numpy() * 1000.0 - truth)[truth > -500.0]

    # Judged where the patient is: the residual stage's corrections show in the body (the air around it is
    # nearly all of the cube, where the identity baseline is already exact).
    stage_two, baseline = body_errors(generated["ct"]).mean(), body_errors(identity).mean()
    assert stage_two < baseline - 2.0, (stage_two, baseline)
