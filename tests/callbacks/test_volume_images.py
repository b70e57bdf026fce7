"""What a user sees in TensorBoard: anatomical planes in radiological view, one step axis, hparams, lr names."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from callbacks.learning_rates import LearningRates
from callbacks.slice_grid import GAP, HEADER, LEGEND_HEIGHT, ROW_LABEL, Sample, slice_grid
from callbacks.volume_slices import TAG, VolumeSliceLogger
from medvol.run.training import run
from medvol.volumes.anatomical_planes import mid_planes

# World extent in voxels: 12 from right to left, 8 from anterior to posterior, 6 from inferior to superior.
R_L, A_P, I_S = 12, 8, 6


def _ras_volume() -> torch.Tensor:
    """A RAS-ordered volume (index grows to the Right, Anterior, Superior) with landmarks off every mid-plane axis."""
    volume = torch.zeros(R_L, A_P, I_S)
    volume[R_L - 2 :, A_P - 2 :, I_S // 2] = 1.0  # right-anterior corner of the axial mid-plane
    volume[R_L - 2 :, A_P // 2, I_S - 1] = 0.5  # right-superior corner of the coronal mid-plane
    volume[R_L // 2, A_P - 2 :, I_S - 1] = 0.25  # anterior-superior corner of the sagittal mid-plane
    return volume


def _affine(columns: list[tuple[int, int]]) -> np.ndarray:
    """Voxel-to-world matrix whose array axis i runs along world axis columns[i][0] with sign columns[i][1]."""
    affine = np.eye(4)
    affine[:3, :3] = 0
    for i, (world, sign) in enumerate(columns):
        affine[world, i] = 2.0 * sign
    return affine


CASES = {
    "RAS": (lambda v: v, [(0, 1), (1, 1), (2, 1)]),
    "LPS": (lambda v: v.flip(0).flip(1), [(0, -1), (1, -1), (2, 1)]),
    # Array axis 0 is superior-inferior, as in DICOM-derived arrays stored slice-first.
    "SIPL": (lambda v: v.flip(2).flip(1).flip(0).permute(2, 1, 0), [(2, -1), (1, -1), (0, -1)]),
}


@pytest.mark.parametrize("case", CASES)
def test_planes_are_named_by_anatomy_and_shown_in_radiological_view(case):
    to_array, columns = CASES[case]
    planes = {p.name: p for p in mid_planes(to_array(_ras_volume()), _affine(columns))}
    axial, coronal, sagittal = planes["axial"], planes["coronal"], planes["sagittal"]
    # Rows top -> bottom, columns left -> right, whatever the array order on disk.
    assert (axial.top, axial.left, coronal.top, coronal.left, sagittal.top, sagittal.left) == ("A", "R", "S", "R", "S",
                                                                                               "A")
    assert axial.image.shape == (A_P, R_L) and coronal.image.shape == (I_S, R_L) and sagittal.image.shape == (I_S, A_P)
    # Patient's right on the image's left, anterior / superior at the top.
    assert axial.image[0, 0] == 1.0 and axial.image[-1, -1] == 0.0
    assert coronal.image[0, 0] == 0.5 and coronal.image[-1, -1] == 0.0
    assert sagittal.image[0, 0] == 0.25 and sagittal.image[-1, -1] == 0.0
    assert axial.spacing == (2.0, 2.0)


def test_on_ras_data_the_first_array_axis_is_sagittal_not_axial():
    to_array, columns = CASES["RAS"]
    volume = to_array(_ras_volume())
    planes = {p.name: p for p in mid_planes(volume, _affine(columns))}
    # `vol[d // 2]` (the old "axial" tile) fixes the right-left axis: a sagittal plane.
    first_axis = volume[volume.shape[0] // 2]
    assert first_axis.shape == (A_P, I_S) and planes["axial"].image.shape == (A_P, R_L)
    assert torch.equal(first_axis.T.flip(0).flip(1), planes["sagittal"].image)


def test_grid_has_the_documented_size_layout_and_overlays():
    volume = _ras_volume() * 2 - 1
    labels = (volume > 0).long() * 2
    sample = Sample("sub-007", {"input": volume, "output": volume * 0.5, "label": labels}, None, ("output", "input"))
    panel = 256
    image = slice_grid([sample, sample], panel_size=panel, colorbar=True)
    columns = 4  # input, output, label, |output - input|
    # The legend strip under the grid names the label map's structures.
    assert image.shape == (HEADER + 2 * 3 * (panel + GAP) + LEGEND_HEIGHT, ROW_LABEL + columns * (panel + GAP) + 70, 3)
    # Axial panel of the input: the right-anterior landmark fills the top-left of the picture (nearest upsampling).
    top, left = HEADER, ROW_LABEL
    axial_input = image[top : top + panel, left : left + panel]
    assert (axial_input[60, 30] == 255).all() and (axial_input[200, 200] == 0).all()
    # The label column shows label 2 in colour over the grey image; the error column is coloured, not grey.
    label_pixel = image[top + 60, left + 2 * (panel + GAP) + 30]
    assert len(set(label_pixel.tolist())) > 1
    error_pixel = image[top + 60, left + 3 * (panel + GAP) + 30]
    assert len(set(error_pixel.tolist())) > 1


def _fake_trainer(epoch: int) -> SimpleNamespace:
    return SimpleNamespace(
        sanity_checking=False, current_epoch=epoch, loggers=[],
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=epoch * 4)),
    )


def test_the_same_subjects_are_shown_every_epoch_in_any_batch_order():
    logger = VolumeSliceLogger(max_samples=2, panel_size=16)
    volumes = {"input": torch.zeros(2, 1, 4, 4, 4)}
    orders = [[["a", "b"], ["c", "d"]], [["d", "c"], ["b", "a"]]]
    for epoch, batches in enumerate(orders):
        trainer = _fake_trainer(epoch)
        logger.on_validation_epoch_start(trainer, None)
        for i, subjects in enumerate(batches):
            logger.on_validation_batch_end(trainer, None, {"volumes": volumes}, {"subject": subjects}, i)
        assert sorted(logger._found) == ["a", "b"]
        logger.on_validation_epoch_end(trainer, None)
    assert logger.subjects == ["a", "b"]
    restored = VolumeSliceLogger()
    restored.load_state_dict(logger.state_dict())
    assert restored.subjects == ["a", "b"]


def test_images_scalars_and_checkpoints_share_one_step_and_hparams_name_the_optimized_metric(tiny_cfg, tmp_path):
    # Discriminators start at batch 2, so global_step (both optimizers) runs ahead of the batch count.
    scheduler = "model.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:1,gamma:0.5}"
    run(tiny_cfg("trainer.max_epochs=2", "dataset.val_fraction=0.25", "trainer.log_every_n_steps=1", scheduler))
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    psnr_steps = [e.step for e in events.Scalars("val/psnr")]
    image_steps = [e.step for e in events.Images(TAG)]
    assert len(psnr_steps) == 2 and image_steps == psnr_steps
    checkpoint_steps = {int(m.group(1)) for p in (tmp_path / "checkpoints").iterdir() if (m := re.search(r"step(\d+)",
                                                                                                         p.name))}
    assert checkpoint_steps and checkpoint_steps <= set(psnr_steps)
    train_steps = [e.step for e in events.Scalars("train/recon_loss_step")]
    assert max(train_steps) < max(psnr_steps) + 1 and len(set(train_steps)) == len(train_steps)

    first = Image.open(io.BytesIO(events.Images(TAG)[0].encoded_image_string))
    # Two subjects x three planes of 256 px; the label column widens for long subject ids.
    assert first.size[1] == HEADER + 2 * 3 * (256 + GAP) and first.size[0] >= ROW_LABEL + 3 * (256 + GAP) + 70

    assert {"lr/generator", "lr/discriminator"} <= set(tags["scalars"])
    assert [e.value for e in events.Scalars("lr/generator")] == pytest.approx([3e-4, 1.5e-4])
    assert "epoch" not in tags["scalars"]
    assert {"train/loss_step", "train/generator_loss_step", "train/gan_discriminator_step"} <= set(tags["scalars"])
    assert [e.value for e in events.Scalars("hp_metric")] == [e.value for e in events.Scalars("val/psnr")]
    session = plugin_data_pb2.HParamsPluginData.FromString(
        events.summary_metadata["_hparams_/experiment"].plugin_data.content
    )
    metric_tags = {m.name.tag for m in session.experiment.metric_infos}
    assert metric_tags == {"hp_metric", "val/psnr"}
    assert "model/n_codes" in {h.name for h in session.experiment.hparam_infos}


def test_vqgan_training_total_does_not_jump_when_the_discriminators_start(tiny_cfg, tmp_path):
    metrics = run(tiny_cfg("trainer.max_epochs=1", "logger=csv"))
    assert metrics["train/generator_loss_step"] > metrics["train/loss_step"]
    assert metrics["train/loss_step"] == pytest.approx(
        metrics["train/recon_loss_step"] + metrics["train/commitment_loss_step"], rel=1e-5
    )


def test_a_constant_learning_rate_draws_no_chart():
    logged = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append(metrics))
    trainer = SimpleNamespace(lr_scheduler_configs=[], loggers=[logger], optimizers=[])
    LearningRates().on_train_epoch_start(trainer, None)
    assert logged == []
