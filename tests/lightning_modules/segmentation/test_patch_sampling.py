"""Segmentation's training patches: corners drawn uniformly over every place a patch fits, a `pos_ratio` share centred
on a foreground voxel of any label channel (clamped into the volume), and cuts equal to numpy's slices."""

from __future__ import annotations

import numpy as np
import torch

from lightning_modules.segmentation.patch_sampling import cut_patches, patch_origins


def _one_voxel_label(shape: tuple[int, int, int], voxel: tuple[int, int, int], channel: int = 0) -> torch.Tensor:
    """A (1, 3, *shape) label whose only foreground voxel is `voxel` in `channel`."""
    label = torch.zeros(1, 3, *shape)
    label[(0, channel, *voxel)] = 1
    return label


def test_cut_patches_are_numpys_slices_at_each_samples_corner():
    volume = torch.arange(2 * 3 * 6 * 7 * 8, dtype=torch.float32).reshape(2, 3, 6, 7, 8)
    origins, size = [[0, 2, 5], [4, 0, 1]], (2, 5, 3)
    patches = cut_patches(volume, origins, size)
    array = volume.numpy()
    expected = np.stack([array[0, :, 0:2, 2:7, 5:8], array[1, :, 4:6, 0:5, 1:4]])
    np.testing.assert_array_equal(patches.numpy(), expected)


def test_random_corners_cover_every_place_a_patch_fits_uniformly():
    torch.manual_seed(0)
    origins = np.array([o for _ in range(500) for o in patch_origins(4, None, (10, 6, 5), (7, 3, 5), 0.5)])
    assert origins.shape == (2000, 3)
    # 10 - 7 = 3, 6 - 3 = 3 and 5 - 5 = 0: corners 0..3, 0..3 and only 0, each of the four with a quarter of draws.
    assert origins[:, 2].tolist() == [0] * 2000
    for axis in (0, 1):
        counts = np.bincount(origins[:, axis], minlength=4)
        assert len(counts) == 4, counts
        assert np.all(np.abs(counts / 2000 - 0.25) < 0.04), counts


def test_a_foreground_centred_patch_puts_the_voxel_at_its_centre_and_is_clamped_at_the_borders():
    size = (4, 4, 4)
    # Inside: corner = voxel - size // 2 = 5 - 2. At the borders: 0 - 2 -> 0, 9 - 2 = 7 -> 10 - 4 = 6, 1 - 2 -> 0.
    for voxel, corner in (((5, 5, 5), [3, 3, 3]), ((0, 9, 1), [0, 6, 0])):
        origins = patch_origins(1, _one_voxel_label((10, 10, 10), voxel), (10, 10, 10), size, pos_ratio=1.0)
        assert origins == [corner]


def test_the_foreground_of_any_label_channel_counts():
    for channel in (0, 1, 2):
        label = _one_voxel_label((12, 12, 12), (8, 4, 6), channel)
        assert patch_origins(1, label, (12, 12, 12), (4, 4, 4), pos_ratio=1.0) == [[6, 2, 4]]


def test_a_pos_ratio_share_of_the_patches_centre_on_the_foreground():
    torch.manual_seed(1)
    label = _one_voxel_label((20, 20, 20), (5, 5, 5)).expand(8, 3, 20, 20, 20)
    draws = 1200
    origins = [o for _ in range(draws // 8) for o in patch_origins(8, label, (20, 20, 20), (4, 4, 4), pos_ratio=0.8)]
    # A uniform corner is (3, 3, 3) once in 17^3 draws, so nearly every (3, 3, 3) is a centred patch.
    centred = sum(o == [3, 3, 3] for o in origins) / draws
    assert abs(centred - 0.8) < 0.04, centred


def test_a_label_without_foreground_gives_uniform_corners_and_the_draws_follow_torchs_seed():
    empty = torch.zeros(2, 1, 8, 8, 8)
    torch.manual_seed(7)
    first = patch_origins(2, empty, (8, 8, 8), (4, 4, 4), pos_ratio=1.0)
    torch.manual_seed(7)
    assert patch_origins(2, empty, (8, 8, 8), (4, 4, 4), pos_ratio=1.0) == first
    assert all(0 <= c <= 4 for corner in first for c in corner)
