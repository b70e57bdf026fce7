"""Coordinate channels of latent crops (lightning_modules/ldm/positions.py) and the latent model's use of them: a
crop's place in its whole volume, written out by hand; a whole volume sampled window by window gives each window its
own cut of the whole volume's coordinates."""

from __future__ import annotations

import numpy as np
import torch

from lightning_modules.ldm.positions import latent_coordinates
from tests.lightning_modules.ldm.test_ldm import tiny_ldm, vqgan_ckpt  # noqa: F401 - the fixture


def test_a_latent_voxels_coordinate_is_the_centre_of_its_image_voxels_scaled_over_the_whole_volume():
    origin, volume = torch.tensor([[4, 8, 0]]), torch.tensor([[32, 40, 16]])
    grid = latent_coordinates(origin, volume, (2, 3, 4), (4, 4, 2)).numpy()
    assert grid.shape == (1, 3, 2, 3, 4)
    # Latent voxel (1, 2, 3) covers image voxels 8..11 (axis 0), 16..19 (axis 1), 6..7 (axis 2).
    centres = np.array([4 + 4 + 1.5, 8 + 8 + 1.5, 0 + 6 + 0.5])
    np.testing.assert_allclose(grid[0, :, 1, 2, 3], 2 * centres / (np.array([32, 40, 16]) - 1) - 1, rtol=1e-6)
    # Each channel varies along its own axis only.
    assert np.ptp(grid[0, 0], axis=0).max() > 0 and np.ptp(grid[0, 0], axis=(1, 2)).max() == 0
    whole = latent_coordinates(torch.zeros(1, 3), torch.tensor([[16, 16, 16]]), (4, 4, 4), (4, 4, 4)).numpy()
    np.testing.assert_allclose(whole[0, 0, :, 0, 0], 2 * np.array([1.5, 5.5, 9.5, 13.5]) / 15 - 1, rtol=1e-6)


def test_the_network_sees_a_patchs_place_in_training_and_each_window_its_cut_of_the_whole_sample(vqgan_ckpt):  # noqa: F811
    module = tiny_ldm(vqgan_ckpt, position_channels=True, ema_decay=None, sampling_window=[2, 2, 2],
                      sample_size=[16, 16, 16])
    assert module.network.conv_in.conv.in_channels == 4 + 3
    x = torch.rand(2, 1, 16, 16, 16) * 2 - 1
    module.set_scale_factor([{"image": x}])
    seen = []
    module.network.register_forward_pre_hook(lambda _, args: seen.append(args[0][:, :3].clone()))
    module.log = lambda *args, **kwargs: None
    # Two 16^3 patches of a 32 x 48 x 16 volume, at (16, 0, 0) and (0, 32, 0).
    batch = {"image": x, "patch_origin": torch.tensor([[16, 0, 0], [0, 32, 0]]),
             "volume_shape": torch.tensor([[32, 48, 16], [32, 48, 16]])}
    module.training_step(batch, 0)
    by_hand = 2 * (16 + 4 * np.arange(4) + 1.5) / 31 - 1
    np.testing.assert_allclose(seen[0][0, 0, :, 0, 0].numpy(), by_hand, rtol=1e-6)
    np.testing.assert_allclose(seen[0][1, 1, 0, :, 0].numpy(), 2 * (32 + 4 * np.arange(4) + 1.5) / 47 - 1, rtol=1e-6)
    # A whole 16^3 sample (a 4^3 latent) in 2^3 windows: every window's coordinates are a cut of the whole grid's.
    seen.clear()
    module.generate_volumes({"subject": ["a"], "affine": torch.eye(4)[None]})
    whole = latent_coordinates(torch.zeros(1, 3), torch.tensor([[16, 16, 16]]), (4, 4, 4), (4, 4, 4))
    cuts = {(i, j, k): whole[0, :, i:i + 2, j:j + 2, k:k + 2] for i in range(3) for j in range(3) for k in range(3)}
    windows = [w for call in seen for w in call]
    assert windows and all(any(torch.allclose(w, cut) for cut in cuts.values()) for w in windows)
    assert {key for key, cut in cuts.items() if any(torch.allclose(w, cut) for w in windows)} >= {(0, 0, 0), (2, 2, 2)}
