"""Crop-trained X-ray-to-CT stages: coordinates locate a crop, crops are cut jointly, windows sample, checkpointing,
learning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_modules.xray2ct.crops import coordinate_channels, random_crops
from lightning_modules.xray2ct.denoiser import ViewConditionedDenoiser
from lightning_modules.xray2ct.module import XrayToCT
from medvol.core.errors import MedvolError
from tests.lightning_modules.diffusion.test_windowed_sampling import TINY_XRAY, _xray_stage_two

GRID = (12, 16, 20)


def _index_volume(batch: int) -> torch.Tensor:
    """(B, 1, D, H, W) whose every voxel holds its own flat index on the grid (plus 10^4 per sample)."""
    flat = torch.arange(int(np.prod(GRID)), dtype=torch.float64).reshape(1, 1, *GRID)
    return torch.cat([flat + 10_000 * b for b in range(batch)])


def _start_of(crop: torch.Tensor) -> tuple[int, int, int]:
    """The grid position of a crop's first voxel, read back from the index volume."""
    index = int(crop.flatten()[0]) % 10_000
    return tuple(int(i) for i in np.unravel_index(index, GRID))  # type: ignore[return-value]


def test_a_crops_coordinate_channels_locate_it_and_shift_with_it():
    torch.manual_seed(0)
    target = _index_volume(6)
    previous = -target
    crop = (4, 8, 6)
    crops, previous_crops, coordinates = random_crops([target, previous, coordinate_channels(GRID, 6, None).double()],
                                                      crop)
    assert crops.shape == (6, 1, *crop) and coordinates.shape == (6, 3, *crop)
    starts = [_start_of(c) for c in crops]
    assert len(set(starts)) > 1, "the crops should land in different places"
    for sample, start in enumerate(starts):
        # The crop is a contiguous block of the sample's own volume; the condition is cut at the same place.
        d, h, w = start
        assert torch.equal(crops[sample, 0], target[sample, 0, d:d + 4, h:h + 8, w:w + 6])
        assert torch.equal(previous_crops[sample], -crops[sample])
        # Independently: voxel i of an axis of n voxels lies at -1 + 2 i / (n - 1).
        for axis, (first, n, length) in enumerate(zip(start, GRID, crop, strict=True)):
            expected = -1.0 + 2.0 * np.arange(first, first + length) / (n - 1)
            shape = [1, 1, 1]
            shape[axis] = length
            np.testing.assert_allclose(coordinates[sample, axis].numpy(),
                                       np.broadcast_to(expected.reshape(shape), crop), atol=1e-6)
    # Shift a crop by one voxel along W: its x channel shifts by 2 / (n - 1), the others stay.
    grid = coordinate_channels(GRID, 1)
    here, there = grid[..., 2:8, 3:9, 5:11], grid[..., 2:8, 3:9, 6:12]
    torch.testing.assert_close(there[:, 2] - here[:, 2], torch.full_like(here[:, 2], 2.0 / (GRID[2] - 1)))
    assert torch.equal(there[:, :2], here[:, :2])


def test_a_crop_trained_stage_feeds_its_network_crops_with_their_coordinates(tmp_path):
    module = _xray_stage_two(tmp_path, crop_size=8, physics_weight=0.1)
    module.log = module.log_dict = lambda *args, **kwargs: None
    seen: dict[str, torch.Tensor] = {}

    def spy(network, x_t, t, views, previous=None, coordinates=None):
        seen.update(x_t=x_t, previous=previous, coordinates=coordinates)
        return torch.zeros_like(x_t, requires_grad=True)

    module.network_output = spy  # type: ignore[method-assign]
    torch.manual_seed(0)
    batch = {"image": torch.rand(2, 1, 16, 16, 16) * 2 - 1, "xray": torch.rand(2, 2, 16, 16),
             "affine": torch.eye(4).expand(2, 4, 4)}
    module.training_step(batch, 0)
    assert seen["x_t"].shape == seen["previous"].shape == (2, 1, 8, 8, 8)
    assert seen["coordinates"].shape == (2, 3, 8, 8, 8)
    # Each crop's coordinates are a block of the whole 16^3 grid's.
    whole = coordinate_channels((16, 16, 16), 1)[0]
    for coordinates in seen["coordinates"]:
        start = [int(round((float(coordinates[a].min()) + 1) * 15 / 2)) for a in range(3)]
        d, h, w = start
        assert torch.equal(coordinates, whole[:, d:d + 8, h:h + 8, w:w + 8])


def test_the_default_window_of_a_crop_trained_stage_is_its_crop(tmp_path):
    torch.manual_seed(2)
    views = torch.rand(2, 2, 16, 16) * 2 - 1
    by_default = _xray_stage_two(tmp_path, crop_size=8).generate(views, [16, 16, 16], ["a", "b"])
    explicit = _xray_stage_two(tmp_path, crop_size=8, sampling_window=8).generate(views, [16, 16, 16], ["a", "b"])
    whole = _xray_stage_two(tmp_path, crop_size=8, sampling_window=16).generate(views, [16, 16, 16], ["a", "b"])
    assert torch.equal(by_default["ct"], explicit["ct"])
    assert not torch.allclose(by_default["ct"], whole["ct"], atol=1e-3)


def test_bad_crops_and_attention_at_full_resolution_are_one_clear_line():
    with pytest.raises(MedvolError, match=r"training crop \[7, 7, 7\] .* must divide by the network's downsampling 2"):
        XrayToCT(stage=2, size=16, crop_size=7, previous_stages=["unused"], **TINY_XRAY)
    with pytest.raises(MedvolError, match=r"`model.crop_size`: got \[8, 8\]"):
        XrayToCT(stage=2, size=16, crop_size=[8, 8], previous_stages=["unused"], **TINY_XRAY)
    with pytest.raises(MedvolError,
                       match=r"attention at level 0, where MONAI's transformer block self-attends over every voxel"):
        ViewConditionedDenoiser(channels=(8, 16), attention_levels=(True, True), num_head_channels=8, norm_num_groups=4)


def test_activation_checkpointing_keeps_fewer_activations_and_the_same_gradients():
    settings = {
        "channels": (8, 16, 16), "attention_levels": (False, False, True), "num_head_channels": 8, "norm_num_groups": 4,
        "encoder_channels": (8, 16), "token_dim": 16, "xray_size": (16, 16), "cascaded": True,
    }
    torch.manual_seed(0)
    plain = ViewConditionedDenoiser(**settings)
    for weight in plain.parameters():
        if not weight.any():
            torch.nn.init.normal_(weight, std=0.1)
    recomputing = ViewConditionedDenoiser(**settings, activation_checkpointing=True)
    recomputing.load_state_dict(plain.state_dict())
    inputs = (torch.randn(2, 1, 16, 16, 16), torch.tensor([3, 500]), torch.rand(2, 2, 16, 16),
              torch.randn(2, 1, 16, 16, 16), coordinate_channels((16, 16, 16), 2))
    kept, gradients = {}, {}
    for name, network in (("plain", plain), ("recomputing", recomputing)):
        sizes: list[int] = []

        def keep(tensor: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            loss = network(*inputs).square().sum()
        kept[name] = sum(sizes)
        gradients[name] = torch.autograd.grad(loss, list(network.parameters()))
    assert kept["recomputing"] < kept["plain"] / 2
    for plain_gradient, recomputed in zip(gradients["plain"], gradients["recomputing"], strict=True):
        torch.testing.assert_close(recomputed, plain_gradient)
