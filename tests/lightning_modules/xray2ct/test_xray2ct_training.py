"""X-ray-to-CT against losses and hand-offs written out in the test: the training loss's gradient holds the
projection term of a hand-built loss (projector, views and spacing written here), and stage 2 sees stage 1's
output (sampling) or the degraded ground truth (training)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_modules.diffusion.subject_noise import SubjectNoise
from lightning_modules.xray2ct.module import XrayToCT
from tests.lightning_modules.diffusion.test_windowed_sampling import (
    TINY_XRAY,
    _live_xray_stage,
    _xray_stage_two,
)


class FixedOutput(nn.Module):
    """A 'network' whose output is one trainable tensor: the loss's gradient w.r.t. it is w.r.t. the output."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = nn.Parameter(value.clone())

    def forward(
        self, x_t: torch.Tensor, t: torch.Tensor, views: torch.Tensor, previous: torch.Tensor | None,
        coordinates: torch.Tensor | None,
    ) -> torch.Tensor:
        return self.value * 1.0


def _cosine_alpha_bar(t: int, steps: int = 1000, s: float = 0.008) -> float:
    """Nichol and Dhariwal's alpha_bar after step t (index t of the table: f(t + 1) / f(0)), away from the clip."""
    def f(u: float) -> float:
        return math.cos((u / steps + s) / (1 + s) * math.pi / 2) ** 2
    return f(t + 1) / f(0)


def _hand_views(volume: torch.Tensor, spacing: tuple[float, float, float], low_hu: float, high_hu: float,
                mu_water: float) -> torch.Tensor:
    """(B, 1, x, y, z) model units in [-1, 1] -> (B, 2, z, .) [ap, lateral] radiographs in [-1, 1].

    HU = low + (v + 1) / 2 (high - low), unclamped (a voxel beyond the window projects as predicted);
    mu = mu_water (1 + HU / 1000), no less than 0 (air); the AP view integrates along y (anterior-posterior), the
    lateral one along x (left-right), each times that axis's voxel size; a radiograph is 1 - exp(-integral), its
    rows run along z from the head (the highest z) down, its columns along the remaining axis from its high end
    down (radiological display).
    """
    hounsfield = low_hu + (volume[:, 0] + 1) / 2 * (high_hu - low_hu)
    mu = mu_water * torch.clamp(1 + hounsfield / 1000, min=0)
    depth = mu.shape[-1]
    images = []
    for integral in (mu.sum(dim=2) * spacing[1], mu.sum(dim=1) * spacing[0]):  # ap: (B, x, z); lateral: (B, y, z)
        rows = torch.stack([integral[:, :, depth - 1 - r] for r in range(depth)], dim=1)
        images.append(1 - torch.exp(-rows.flip(-1)))  # columns from the axis's high end: patient's right, front
    return torch.stack(images, dim=1) * 2 - 1


def test_training_loss_gradient_holds_the_projection_term_of_a_hand_built_loss():
    window, mu_water, weight = (-1000.0, 2000.0), 0.03, 0.5
    module = XrayToCT(stage=1, size=16, physics_weight=weight, window=window, mu_water=mu_water, **TINY_XRAY)
    module.log = module.log_dict = lambda *args, **kwargs: None
    torch.manual_seed(0)
    x0 = torch.rand(2, 1, 16, 16, 16) * 2 - 1
    x0[:, :, :5, 10:, 2:9] = 0.8  # an off-centre block: no view is the other's mirror or transpose
    noise, t = torch.randn_like(x0), torch.tensor([100, 600])
    module.draw_timesteps = lambda batch_size, device: t
    module.noise_like = lambda x, subject_noise=None: noise
    a = torch.tensor([_cosine_alpha_bar(100), _cosine_alpha_bar(600)]).view(2, 1, 1, 1, 1)
    # Near the v target, so the recovered x0 lies mostly inside the window, where the projection has a gradient.
    output = a.sqrt() * noise - (1 - a).sqrt() * x0 + 0.3 * torch.randn_like(x0)
    module.network = FixedOutput(output)
    # An oblique grid of 1.5 x 2 x 3 mm voxels (the affine's columns), turned 30 degrees about z.
    c, s = math.cos(math.pi / 6), math.sin(math.pi / 6)
    affine = torch.eye(4)
    turn = torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
    affine[:3, :3] = turn @ torch.diag(torch.tensor([1.5, 2.0, 3.0]))
    views = torch.rand(2, 2, 16, 16) * 2 - 1
    batch = {"image": x0, "xray": views, "affine": affine.expand(2, 4, 4), "subject": ["a", "b"]}
    loss = module.training_step(batch, 0)
    loss.backward()

    # The loss written out: v-prediction MSE plus weight x L1 between the views and the DRRs of x0 recovered from v.
    out = output.clone().requires_grad_(True)
    x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
    diffusion = ((out - (a.sqrt() * noise - (1 - a).sqrt() * x0)) ** 2).mean()
    x0_hat = a.sqrt() * x_t - (1 - a).sqrt() * out
    physics = (_hand_views(x0_hat, (1.5, 2.0, 3.0), *window, mu_water) - views).abs().mean()
    diffusion_part, projection_part = (torch.autograd.grad(term, out, retain_graph=True)[0] for term in (diffusion,
                                                                                                         physics))
    assert float(loss.detach()) == pytest.approx(float((diffusion + weight * physics).detach()), rel=1e-5)
    # The projection term's share of the gradient is far above float noise, so leaving it out shows.
    expected = diffusion_part + weight * projection_part
    assert float((weight * projection_part).norm()) > 0.15 * float(expected.norm())
    torch.testing.assert_close(module.network.value.grad, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_stage_two_samples_from_stage_ones_output_upsampled_plus_its_conditioning_noise(tmp_path):
    module = _xray_stage_two(tmp_path)
    seen: list[torch.Tensor] = []
    module.ema.module.register_forward_pre_hook(lambda _, args: seen.append(args[3].clone()))
    torch.manual_seed(2)
    views = torch.rand(2, 2, 16, 16) * 2 - 1
    generated = module.generate(views, [16, 16, 16], ["a", "b"])
    upsampled = F.interpolate(generated["stage1"], size=(16, 16, 16), mode="trilinear", align_corners=False)
    expected = upsampled + module.hparams.previous_sampling_noise * SubjectNoise(["a", "b"], 0,
                                                                                 "stage2/previous").draw((1, 16, 16,
                                                                                                          16))
    assert generated["stage1"].abs().max() > 0.1
    for previous in seen:
        torch.testing.assert_close(previous, expected, rtol=0, atol=1e-6)


def test_stage_two_trains_on_the_ground_truth_degraded_to_stage_ones_grid(tmp_path):
    module = _xray_stage_two(tmp_path, previous_noise=0.0, physics_weight=0.0)
    module.log = module.log_dict = lambda *args, **kwargs: None
    seen: list[torch.Tensor] = []
    module.network.register_forward_pre_hook(lambda _, args: seen.append(args[3].clone()))
    torch.manual_seed(3)
    x0 = torch.rand(2, 1, 16, 16, 16) * 2 - 1
    batch = {"image": x0, "xray": torch.rand(2, 2, 16, 16) * 2 - 1, "affine": torch.eye(4).expand(2, 4, 4)}
    module.training_step(batch, 0)
    # Means of 2 x 2 x 2 blocks (stage 1's 8^3 grid), trilinearly resampled back onto stage 2's grid.
    blocks = x0.reshape(2, 1, 8, 2, 8, 2, 8, 2).mean(dim=(3, 5, 7))
    expected = F.interpolate(blocks, size=(16, 16, 16), mode="trilinear", align_corners=False)
    torch.testing.assert_close(seen[0], expected, rtol=0, atol=1e-6)


def test_a_residual_stage_diffuses_the_ct_minus_the_degraded_ground_truth_and_adds_that_back(tmp_path):
    window, mu_water, weight = (-1000.0, 2000.0), 0.03, 0.5
    module = _xray_stage_two(tmp_path, first={"window": window, "mu_water": mu_water}, physics_weight=weight,
                             window=window, mu_water=mu_water, crop_size=None)
    module.log = module.log_dict = lambda *args, **kwargs: None
    torch.manual_seed(4)
    x0 = torch.rand(2, 1, 16, 16, 16) * 2 - 1
    x0[:, :, :5, 10:, 2:9] = 0.8
    noise, t = torch.randn_like(x0), torch.tensor([100, 600])
    module.draw_timesteps = lambda batch_size, device: t
    module.noise_like = lambda x, subject_noise=None: noise
    a = torch.tensor([_cosine_alpha_bar(100), _cosine_alpha_bar(600)]).view(2, 1, 1, 1, 1)
    # The base: means of 2 x 2 x 2 blocks (stage 1's 8^3 grid) resampled trilinearly back, without the noise
    # the network's previous-stage input gets (previous_noise stays at its default).
    blocks = x0.reshape(2, 1, 8, 2, 8, 2, 8, 2).mean(dim=(3, 5, 7))
    base = F.interpolate(blocks, size=(16, 16, 16), mode="trilinear", align_corners=False)
    residual = x0 - base
    output = a.sqrt() * noise - (1 - a).sqrt() * residual + 0.3 * torch.randn_like(x0)
    module.network = FixedOutput(output)
    views = torch.rand(2, 2, 16, 16) * 2 - 1
    affine = torch.diag(torch.tensor([1.5, 2.0, 3.0, 1.0]))
    loss = module.training_step({"image": x0, "xray": views, "affine": affine.expand(2, 4, 4)}, 0)
    loss.backward()

    # v-prediction of the residual; the physics term projects the base plus the residual recovered from v.
    out = output.clone().requires_grad_(True)
    x_t = a.sqrt() * residual + (1 - a).sqrt() * noise
    diffusion = ((out - (a.sqrt() * noise - (1 - a).sqrt() * residual)) ** 2).mean()
    ct_hat = base + a.sqrt() * x_t - (1 - a).sqrt() * out
    physics = (_hand_views(ct_hat, (1.5, 2.0, 3.0), *window, mu_water) - views).abs().mean()
    expected = diffusion + weight * physics
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    gradient = torch.autograd.grad(expected, out)[0]
    torch.testing.assert_close(module.network.value.grad, gradient, rtol=1e-4, atol=1e-4 * float(gradient.abs().max()))


def test_an_untrained_residual_stage_is_its_identity_baseline_and_samples_stage_one_as_stage_one_predicts(tmp_path):
    stage_one = _live_xray_stage()
    path = tmp_path / "stage1.ckpt"
    torch.save({"hyper_parameters": dict(stage_one.hparams), "state_dict": stage_one.state_dict()}, path)
    torch.manual_seed(5)
    views = torch.rand(2, 2, 16, 16) * 2 - 1
    first = stage_one.generate(views, [8, 8, 8], ["a", "b"])["ct"]
    for residual in (True, False):
        # Stage 2 starts from stage 1's weights and predicts the clean volume; stage 1 predicts v.
        module = XrayToCT(stage=2, size=16, previous_stages=[str(path)], init_from=str(path), residual=residual,
                          prediction_type="sample", previous_sampling_noise=0.1, **TINY_XRAY)
        generated = module.generate(views, [16, 16, 16], ["a", "b"])
        torch.testing.assert_close(generated["stage1"], first, rtol=0, atol=1e-6)
        upsampled = F.interpolate(first, size=(16, 16, 16), mode="trilinear", align_corners=False)
        if residual:
            # Its output layer starts at zero: the residual is 0, the CT the upsampled stage 1 (without the
            # conditioning noise, which only the network's input gets).
            torch.testing.assert_close(generated["ct"], upsampled, rtol=0, atol=1e-6)
        else:
            assert (generated["ct"] - upsampled).abs().mean() > 0.05
