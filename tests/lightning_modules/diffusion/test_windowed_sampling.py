"""Windowed sampling: every denoising step over overlapping Gaussian-blended windows, each with its own step,
its cut of the condition volumes and its sample's per-sample inputs; one window covering the volume is the
whole-volume call."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import pytest
import torch
from monai.data.utils import compute_importance_map
from torch import nn

from lightning_modules.diffusion.diffusion_module import Conditioning
from lightning_modules.diffusion.fast_ddpm import ConditionalDiffusion
from lightning_modules.diffusion.prediction import to_x0_and_epsilon
from lightning_modules.diffusion.samplers import sample_ddim
from lightning_modules.diffusion.subject_noise import SubjectNoise
from lightning_modules.xray2ct.crops import coordinate_channels
from lightning_modules.xray2ct.module import XrayToCT
from medvol.core.errors import MedvolError
from medvol.volumes.sliding_window import SlidingWindow

TINY_XRAY = {
    "xray_size": (16, 16), "channels": (8, 16), "attention_levels": (False, True), "num_head_channels": 8,
    "encoder_channels": (8, 16), "token_dim": 16, "timesteps": 4,
}


class ConvDenoiser(nn.Module):
    """A 3x3x3 convolution plus a per-sample step embedding: translation-equivariant away from window borders."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, 3, padding=1)
        self.step = nn.Embedding(1000, out_channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + self.step(t)[:, :, None, None, None]


def tokened_network(x: torch.Tensor, cond: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A window's output from its volume, its cut of `cond` and its sample's step and tokens (zero-padded 3^3 mean)."""
    local = nn.functional.avg_pool3d(torch.cat([x, cond], dim=1), 3, stride=1, padding=1, count_include_pad=True)
    return local.sum(1, keepdim=True) * tokens.mean((1, 2))[:, None, None, None, None] + t[:, None, None, None,
                                                                                           None] / 100


def window_starts(size: int, roi: int, overlap: float) -> list[int]:
    """Window corners along one axis: every int(roi * (1 - overlap)) voxels, the last one flush with the end."""
    step = max(int(roi * (1 - overlap)), 1)
    starts = list(range(0, size - roi + 1, step))
    return starts if starts[-1] == size - roi else [*starts, size - roi]


def hand_blended(
    call: Callable[..., torch.Tensor], volume: torch.Tensor, volumes: Mapping[str, torch.Tensor],
    per_sample: Mapping[str, torch.Tensor], roi: Sequence[int], overlap: float,
) -> torch.Tensor:
    """Each sample's windows enumerated by hand and run one at a time, blended with MONAI's Gaussian importance map."""
    weight = compute_importance_map(tuple(roi), mode="gaussian", sigma_scale=0.125)
    output = torch.zeros(volume.shape[0], 1, *volume.shape[2:])
    total = torch.zeros(volume.shape[0], 1, *volume.shape[2:])
    corners = itertools.product(*(window_starts(n, r, overlap) for n, r in zip(volume.shape[2:], roi, strict=True)))
    for corner in corners:
        for b in range(volume.shape[0]):
            region = (slice(b, b + 1), slice(None), *(slice(c, c + r) for c, r in zip(corner, roi, strict=True)))
            rows = {name: values[b:b + 1] for name, values in per_sample.items()}
            cut = {name: extra[region] for name, extra in volumes.items()}
            output[region] += call(volume[region], **cut, **rows) * weight
            total[region] += weight
    return output / total


def _inputs(batch: int = 2, size: int = 12) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    volume = torch.randn(batch, 1, size, size, size)
    volumes = {"cond": torch.randn(batch, 2, size, size, size)}
    per_sample = {"t": torch.tensor([999, 10])[:batch],
                  "tokens": torch.randn(batch, 5, 4) + torch.tensor([[[2.0]], [[-3.0]]])[:batch]}
    return volume, volumes, per_sample


def test_one_window_covering_the_volume_is_the_whole_volume_call_bit_for_bit():
    volume, volumes, per_sample = _inputs()
    window = SlidingWindow.of([12, 12, 12], overlap=0.5, mode="gaussian", batch_size=1)
    whole = tokened_network(volume, **volumes, **per_sample)
    assert torch.equal(window(tokened_network, volume, volumes, per_sample), whole)


def test_overlapping_windows_match_a_hand_blended_reference_and_the_whole_volume_inside():
    volume, volumes, per_sample = _inputs()
    # 8 windows a sample in groups of 3: groups mix the two samples, whose steps and tokens differ.
    window = SlidingWindow.of([8, 8, 8], overlap=0.5, mode="gaussian", batch_size=3)
    windowed = window(tokened_network, volume, volumes, per_sample)
    reference = hand_blended(tokened_network, volume, volumes, per_sample, (8, 8, 8), 0.5)
    torch.testing.assert_close(windowed, reference, rtol=1e-5, atol=1e-5)
    # Away from every window border the network sees what it sees in the whole volume.
    whole = tokened_network(volume, **volumes, **per_sample)
    torch.testing.assert_close(windowed[..., 5:7, 5:7, 5:7], whole[..., 5:7, 5:7, 5:7], rtol=1e-5, atol=1e-5)
    # Near the borders windows disagree, so the blend is not the whole-volume output.
    assert not torch.allclose(windowed, whole, atol=1e-3)


def test_extra_volumes_must_share_the_batch_and_the_grid():
    volume, volumes, per_sample = _inputs()
    window = SlidingWindow.of([8, 8, 8])
    with pytest.raises(ValueError, match=r"`volumes\['cond'\]` has shape"):
        window(tokened_network, volume, {"cond": volumes["cond"][..., :10]}, per_sample)


def _fast_ddpm(**settings) -> ConditionalDiffusion:
    torch.manual_seed(0)
    return ConditionalDiffusion(partial(ConvDenoiser), image_channels=1, cond_channels=1, prediction_type="v",
                                **settings)


def _live_xray_stage(stage: int = 1, size: int = 8, **settings) -> XrayToCT:
    """An X-ray-to-CT stage whose zero-initialised layers (the output, the attention projections) have random
    weights, so that its output depends on x_t, the views and the previous stage; its EMA the same."""
    torch.manual_seed(stage)
    module = XrayToCT(stage=stage, size=size, **TINY_XRAY, **settings)
    for weight in module.network.parameters():
        if weight.ndim > 1 and not weight.any():
            nn.init.normal_(weight, std=0.1)
    module.ema.module.load_state_dict(module.network.state_dict())
    return module


def _xray_stage_two(tmp_path, first: dict | None = None, **settings) -> XrayToCT:
    """Stage 2 (16^3) over a stage 1 (8^3) saved with the settings `first`."""
    stage_one = _live_xray_stage(**(first or {}))
    path = tmp_path / f"stage1-{len(list(tmp_path.iterdir()))}.ckpt"
    torch.save({"hyper_parameters": dict(stage_one.hparams), "state_dict": stage_one.state_dict()}, path)
    return _live_xray_stage(2, 16, previous_stages=[str(path)], **settings)


# Groups of 3 of the 8 windows a sample: groups mix the two samples.
def _fast_ddpm_case(tmp_path):
    module = _fast_ddpm(sampling_window_batch_size=3)
    torch.manual_seed(1)
    return module, Conditioning(volumes={"cond": torch.randn(2, 1, 16, 16, 16)})


def _xray_case(tmp_path):
    module = _xray_stage_two(tmp_path, sampling_window_batch_size=3)
    torch.manual_seed(1)
    volumes = {"previous": torch.randn(2, 1, 16, 16, 16), "coordinates": coordinate_channels((16, 16, 16), 2)}
    return module, Conditioning(volumes, {"views": torch.rand(2, 2, 16, 16) * 2 - 1})


@pytest.mark.parametrize("case", [_fast_ddpm_case, _xray_case], ids=["fast_ddpm", "xray2ct"])
def test_windowed_walk_matches_a_hand_blended_walk_and_one_window_is_the_whole_volume_walk(tmp_path, case):
    module, conditioning = case(tmp_path)
    network = module.network
    x_T = SubjectNoise(["a", "b"]).draw((1, 16, 16, 16))
    whole = module.sample(x_T, conditioning, network=network)
    assert torch.equal(module.sample(x_T, conditioning, network=network, window=(16, 16, 16)), whole)

    def reference_denoise(x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        call = partial(module.network_output, network)
        output = hand_blended(call, x_t, conditioning.volumes, {"t": t, **conditioning.per_sample}, (12, 12, 12), 0.5)
        return to_x0_and_epsilon(module.prediction_type, output, x_t, module.schedule.alpha_bar(t))

    windowed = module.sample(x_T, conditioning, network=network, window=(12, 12, 12))
    reference = sample_ddim(reference_denoise, x_T, module.schedule, module.sampling_timesteps)
    torch.testing.assert_close(windowed, reference, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(windowed, whole, atol=1e-2)


def test_configured_window_reaches_fast_ddpm_validation_and_one_window_is_whole_volume_sampling(tmp_path):
    torch.manual_seed(3)
    batch = {"image": torch.rand(2, 1, 16, 16, 16) * 2 - 1, "cond": torch.rand(2, 1, 16, 16, 16) * 2 - 1,
             "subject": ["sub-0", "sub-1"]}
    samples = {}
    for window in (None, [16, 16, 16], [12, 12, 12]):
        module = _fast_ddpm(sampling_window=window)
        module.log = lambda *args, **kwargs: None
        samples[str(window)] = module.validation_step(batch, 0)["volumes"]["sample"]
    assert torch.equal(samples["[16, 16, 16]"], samples["None"])
    noise = module.subject_generators(batch, 0)
    x_T = module.noise_like(batch["image"], noise)
    explicit = module.sample(x_T, module.conditioning(batch["cond"]), noise, window=(12, 12, 12)).clamp(-1, 1)
    assert torch.equal(samples["[12, 12, 12]"], explicit)
    assert not torch.allclose(samples["[12, 12, 12]"], samples["None"], atol=1e-3)


def test_a_cascade_stage_samples_with_its_configured_window_and_its_earlier_stages_with_theirs(tmp_path):
    torch.manual_seed(2)
    views = torch.rand(2, 2, 16, 16) * 2 - 1

    def generate(first: dict | None = None, **settings) -> dict[str, torch.Tensor]:
        return _xray_stage_two(tmp_path, first, **settings).generate(views, [16, 16, 16], ["a", "b"])

    whole = generate()
    one_window = generate(sampling_window=16)
    assert torch.equal(one_window["ct"], whole["ct"]) and torch.equal(one_window["stage1"], whole["stage1"])
    # Stage 1 samples as its own run was configured (whole), stage 2 window by window.
    windowed = generate(sampling_window=[12, 12, 12])
    assert torch.equal(windowed["stage1"], whole["stage1"])
    assert not torch.allclose(windowed["ct"], whole["ct"], atol=1e-3)
    # A stage 1 whose run sampled by windows is sampled by its windows inside stage 2.
    first_windowed = generate({"sampling_window": [6, 6, 6]})
    assert not torch.allclose(first_windowed["stage1"], whole["stage1"], atol=1e-3)


def test_a_window_the_network_cannot_take_or_larger_than_the_volume_is_one_clear_line():
    with pytest.raises(MedvolError,
                       match=r"`model.sampling_window` \[6, 6, 6\] must divide by the network's downsampling 4"):
        XrayToCT(stage=1, size=16, sampling_window=6,
                 **{**TINY_XRAY, "channels": (8, 16, 16), "attention_levels": (False, False, True)})
    with pytest.raises(MedvolError,
                       match=r"`model.sampling_window` \[32, 32, 32\] must divide .* fit in the stage's volume"):
        XrayToCT(stage=1, size=16, sampling_window=32, **TINY_XRAY)
    with pytest.raises(MedvolError, match=r"`model.sampling_window`: got \[8, 8\]"):
        _fast_ddpm(sampling_window=[8, 8])
    module = _fast_ddpm(sampling_window=[16, 16, 16])
    with pytest.raises(MedvolError, match=r"\[16, 16, 16\] is larger than the volume \[8, 8, 8\]"):
        module.sample(torch.zeros(1, 1, 8, 8, 8), module.conditioning(torch.zeros(1, 1, 8, 8, 8)))
