"""A cascade hands each stage on as that stage samples alone: the same radiographs, its own sampling plan and
hand-off noise, its EMA or (without one) its raw weights; HU beyond the window keeps its value and its gradient;
figures over the body in HU."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch
from scipy.ndimage import gaussian_filter

from datamodules.sources.phantom import make_phantom
from datamodules.sources.synthetic import SyntheticDataModule
from lightning_modules.xray2ct.body_metrics import BodyMAE, BodyPSNR, BodySSIM
from lightning_modules.xray2ct.module import XrayToCT
from lightning_modules.xray2ct.physics import ProjectionLoss
from medvol.core.errors import MedvolError
from medvol.volumes.prediction_writer import PredictionWriter
from tests.lightning_modules.diffusion.test_windowed_sampling import TINY_XRAY, _live_xray_stage


def _save(module: XrayToCT, path) -> str:
    """The stage as its checkpoint holds it: hyperparameters and state dict."""
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict()}, path)
    return str(path)


def _views(seed: int = 5) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.rand(2, 2, 16, 16) * 2 - 1


def test_each_stage_inside_the_cascade_is_that_stage_sampled_alone_with_its_own_plan_and_noise(tmp_path):
    # Stage 2 hands off with noise 0.3 and walks 3 DDIM steps with eta 0.5; stage 3 with 0.05 and its own 4 steps.
    one = _live_xray_stage(1, 4)
    first = _save(one, tmp_path / "stage1.ckpt")
    two = _live_xray_stage(2, 8, previous_stages=[first], previous_sampling_noise=0.3, sampling_timesteps=3, eta=0.5)
    second = _save(two, tmp_path / "stage2.ckpt")
    three = _live_xray_stage(3, 12, previous_stages=[first, second], previous_sampling_noise=0.05, crop_size=None)
    views = _views()
    cascade = three.generate(views, [12, 12, 12], ["a", "b"])
    torch.testing.assert_close(cascade["stage1"], one.generate(views, [4, 4, 4], ["a", "b"])["ct"], rtol=0, atol=1e-6)
    torch.testing.assert_close(cascade["stage2"], two.generate(views, [8, 8, 8], ["a", "b"])["ct"], rtol=0, atol=1e-6)
    # Restored from its own checkpoint (predict.py), stage 3 still samples stage 2 as stage 2 did.
    restored = XrayToCT(**{**dict(three.hparams), "previous_stages": []})
    restored.load_state_dict(three.state_dict())
    again = restored.generate(views, [12, 12, 12], ["a", "b"])
    torch.testing.assert_close(again["stage2"], cascade["stage2"], rtol=0, atol=1e-6)


def test_a_stage_whose_recorded_sampling_cannot_be_honoured_is_one_clear_line(tmp_path):
    one = _live_xray_stage(1, 8)
    state = {"hyper_parameters": {**dict(one.hparams), "sampler": "plms"}, "state_dict": one.state_dict()}
    torch.save(state, tmp_path / "stage1.ckpt")
    with pytest.raises(MedvolError, match=r"stage 1 \(.*stage1.ckpt\) cannot be sampled .*`model.sampler` 'plms'"):
        XrayToCT(stage=2, size=16, previous_stages=[str(tmp_path / "stage1.ckpt")], **TINY_XRAY)


def test_a_stage_trained_without_ema_hands_off_its_raw_weights(tmp_path):
    torch.manual_seed(3)
    one = XrayToCT(stage=1, size=4, ema_decay=None, **TINY_XRAY)
    for weight in one.network.parameters():
        torch.nn.init.normal_(weight, std=0.1)
    first = _save(one, tmp_path / "stage1.ckpt")
    two = XrayToCT(stage=2, size=8, previous_stages=[first], init_from=first, **TINY_XRAY)
    views = _views()
    torch.testing.assert_close(
        two.generate(views, [8, 8, 8], ["a", "b"])["stage1"], one.generate(views, [4, 4, 4], ["a", "b"])["ct"],
        rtol=0, atol=1e-6,
    )


def test_every_stage_grid_of_a_phantom_gets_the_radiographs_of_the_patient_at_one_resolution():
    def views(size: int) -> torch.Tensor:
        data = SyntheticDataModule(num_subjects=1, size=size, spacing=192.0 / size, image_modalities=["ct"],
                                   views=["ap", "lateral"], xray_size=[32, 32], xray_grid=32, cache="none")
        return data.build_dataset(data.subjects(), "test")[0]["xray"]

    small, large = views(16), views(24)
    torch.testing.assert_close(small, large, rtol=0, atol=0)
    # The reference: the phantom at 32^3 (6 mm voxels) projected by hand, rows from the head down (z descending),
    # AP integrating along y, lateral along x.
    mu = 0.02 * np.clip(1 + make_phantom(0, 0, (32, 32, 32)).channels["ct"].astype(np.float64) / 1000, 0, None)
    ap = 1 - np.exp(-mu.sum(axis=1) * 6.0)  # (x, z)
    lateral = 1 - np.exp(-mu.sum(axis=0) * 6.0)  # (y, z)
    expected = np.stack([ap[::-1, ::-1].T, lateral[::-1, ::-1].T]) * 2 - 1  # columns: patient's right, front first
    np.testing.assert_allclose(small.numpy(), expected, atol=1e-5)


class Constant(torch.nn.Module):
    """A 'network' that predicts the same clean volume value everywhere (`prediction_type=sample`)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x_t, t, views, previous=None, coordinates=None):
        return torch.full_like(x_t, self.value)


def test_a_ct_generated_beyond_the_window_keeps_its_value_and_is_written_so(tmp_path):
    module = XrayToCT(stage=1, size=16, prediction_type="sample", ema_decay=None, window=(-1000.0, 1000.0), **TINY_XRAY)
    module.network = Constant(1.5)  # 1.5 model units: 500 HU above the window's top
    module.log = lambda *args, **kwargs: None
    ct = module.generate(_views(), [16, 16, 16], ["a", "b"])["ct"]
    torch.testing.assert_close(ct, torch.full_like(ct, 1.5))
    # Through test=true's writer: 1.5 model units are 1000 + 0.5 * 1000 HU in the file.
    batch = {"image": torch.zeros(2, 1, 16, 16, 16), "xray": _views(), "affine": torch.eye(4).expand(2, 4, 4),
             "subject": ["a", "b"]}
    outputs = module.test_step(batch, 0)
    PredictionWriter(tmp_path).write(outputs, batch)
    np.testing.assert_allclose(nib.load(str(tmp_path / "a_ct.nii.gz")).get_fdata(), 1500.0, atol=1e-3)


def test_a_voxel_predicted_above_the_window_still_gets_a_gradient_from_the_physics_loss():
    loss = ProjectionLoss(["ap", "lateral"], (-1024.0, 3071.0))
    volume = torch.zeros(1, 1, 8, 8, 8)
    volume[0, 0, 3, 4, 5] = 1.5  # above the window's top (model unit 1 = 3071 HU)
    volume.requires_grad_(True)
    views = torch.zeros(1, 2, 8, 8)
    loss(volume, views, torch.diag(torch.tensor([4.0, 4.0, 4.0, 1.0]))[None]).backward()
    assert float(volume.grad[0, 0, 3, 4, 5].abs()) > 0


def test_body_figures_are_in_hounsfield_units_over_the_true_ct_above_minus_500():
    torch.manual_seed(0)
    window = (-1024.0, 3071.0)
    target = torch.rand(2, 1, 10, 10, 10) * 2 - 1
    preds = target + 0.2 * torch.randn_like(target)
    preds[0, 0, 0, 0, 0] = 2.0  # beyond the window: measured as predicted
    hu = lambda v: -1024.0 + (v.double().numpy() + 1) / 2 * 4095.0  # noqa: E731
    truth, guess = hu(target), hu(preds)
    body = truth > -500
    figures = {}
    for name, metric in (("mae", BodyMAE(window)), ("psnr", BodyPSNR(window)), ("ssim", BodySSIM(window))):
        metric.update(preds[:1], target[:1])
        metric.update(preds[1:], target[1:])
        figures[name] = float(metric.compute())
    assert figures["mae"] == pytest.approx(np.abs(guess - truth)[body].mean(), rel=1e-5)
    assert figures["psnr"] == pytest.approx(10 * np.log10(4095.0**2 / np.square(guess - truth)[body].mean()), rel=1e-5)
    # Gaussian-weighted local SSIM (5 voxels, sigma 1.5, mirrored borders) in model units, averaged over the body.
    def smooth(v):
        return gaussian_filter(v, 1.5, truncate=2 / 1.5, mode="mirror")

    maps = []
    for x, y in zip(preds[:, 0].double().numpy(), target[:, 0].double().numpy(), strict=True):
        mx, my = smooth(x), smooth(y)
        vx, vy, cov = smooth(x * x) - mx**2, smooth(y * y) - my**2, smooth(x * y) - mx * my
        c1, c2 = 0.02**2, 0.06**2
        maps.append((2 * mx * my + c1) * (2 * cov + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2)))
    assert figures["ssim"] == pytest.approx(np.stack(maps)[body[:, 0]].mean(), rel=1e-5)
