"""Latent diffusion's generation metrics (lightning_modules.diffusion.generation_metrics.py): MMD over the epoch's average-pooled
volumes, the user's TorchScript FID network or one line, and MS-SSIM scale weights for small volumes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from monai.metrics import MMDMetric
from scipy import linalg
from torch import nn

from lightning_modules.diffusion.generation_metrics import (
    MSSSIM_WEIGHTS,
    VolumeSetFID,
    VolumeSetMMD,
    load_feature_network,
    msssim_weights,
    sample_msssim,
)
from medvol.core.errors import MedvolError


def _block_means(volumes: torch.Tensor, block: int) -> np.ndarray:
    """(B, C, D, H, W) -> (B, C * D/b * H/b * W/b): the mean of each b^3 block, by numpy reshapes."""
    b, c, d, h, w = volumes.shape
    blocks = volumes.numpy().reshape(b, c, d // block, block, h // block, block, w // block, block)
    return blocks.mean(axis=(3, 5, 7)).reshape(b, -1)


def test_mmd_is_monais_over_the_whole_epoch_of_volumes_pooled_to_the_kept_size():
    torch.manual_seed(0)
    generated, real = torch.randn(6, 1, 8, 8, 8), 0.5 * torch.randn(6, 1, 8, 8, 8) + 0.2
    metric = VolumeSetMMD(size=4)
    for half in (slice(0, 3), slice(3, 6)):
        metric.update(generated[half], real[half])
    # 8 voxels per axis kept as 4: the means of 2^3 blocks, all six volumes of each set together.
    expected = MMDMetric()(torch.from_numpy(_block_means(real, 2)), torch.from_numpy(_block_means(generated, 2)))
    torch.testing.assert_close(metric.compute(), expected, rtol=1e-5, atol=1e-7)


def test_mmd_keeps_small_volumes_whole_and_is_nan_below_two_volumes():
    torch.manual_seed(1)
    generated, real = torch.randn(3, 1, 4, 4, 4), torch.randn(3, 1, 4, 4, 4)
    metric = VolumeSetMMD(size=16)
    metric.update(generated, real)
    expected = MMDMetric()(real.flatten(1), generated.flatten(1))
    torch.testing.assert_close(metric.compute(), expected, rtol=1e-5, atol=1e-7)
    alone = VolumeSetMMD()
    alone.update(generated[:1], real[:1])
    assert math.isnan(float(alone.compute()))


def test_a_missing_or_non_torchscript_fid_network_is_one_line(tmp_path):
    with pytest.raises(MedvolError, match=r"`model.fid_network`: no file at .*absent.pt; expected a TorchScript"):
        load_feature_network(str(tmp_path / "absent.pt"))
    (tmp_path / "weights.pt").write_bytes(b"not a TorchScript archive")
    with pytest.raises(MedvolError, match=r"weights.pt is not a TorchScript file"):
        VolumeSetFID(str(tmp_path / "weights.pt"))


def test_fid_features_are_the_networks_output_pooled_over_space_and_the_network_is_in_eval_mode(tmp_path):
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(nn.Sequential(nn.Conv3d(1, 3, 3), nn.Dropout(0.5))), str(tmp_path / "maps.pt"))
    network = load_feature_network(str(tmp_path / "maps.pt"))
    assert not network.training
    volumes = torch.randn(2, 1, 6, 6, 6)
    with torch.no_grad():
        maps = network(volumes)
    features = VolumeSetFID(str(tmp_path / "maps.pt")).features(volumes)
    torch.testing.assert_close(features, maps.mean(dim=(2, 3, 4)).double())
    one = VolumeSetFID(str(tmp_path / "maps.pt"))
    one.update(volumes[:1], volumes[1:])
    assert math.isnan(float(one.compute()))


def test_msssim_keeps_as_many_of_monais_scales_as_the_volume_allows_renormalised():
    # A scale n needs more than (kernel - 1) 2^(n - 1) voxels: 16 > 2, 4, 8 but not 16 with kernel 3.
    three = (0.0448, 0.2856, 0.3001)
    assert msssim_weights(16, 3) == pytest.approx([w / sum(three) for w in three])
    assert msssim_weights(100, 7) == pytest.approx([w / sum(MSSSIM_WEIGHTS) for w in MSSSIM_WEIGHTS])
    assert msssim_weights(2, 3) == pytest.approx([1.0])
    assert sum(msssim_weights(40, 5)) == pytest.approx(1.0)


def test_two_identical_samples_have_no_diversity_and_a_different_one_has_some():
    torch.manual_seed(0)
    first = torch.rand(2, 1, 16, 16, 16) * 2 - 1
    np.testing.assert_allclose(sample_msssim(first, first, kernel_size=3).numpy(), [1.0, 1.0], rtol=1e-5)
    other = sample_msssim(first, torch.rand(2, 1, 16, 16, 16) * 2 - 1, kernel_size=3)
    assert other.shape == (2,) and bool((other < 0.5).all())


# Against formulas written out here, not MONAI's classes the metrics call.


def unbiased_linear_mmd(real: np.ndarray, generated: np.ndarray) -> float:
    """Gretton et al.'s unbiased MMD^2 with the linear kernel, written out: pairs of distinct volumes only."""
    def within(a: np.ndarray) -> float:
        gram = a @ a.T
        return (gram.sum() - np.trace(gram)) / (len(a) * (len(a) - 1))
    return within(real) + within(generated) - 2 * (generated @ real.T).mean()


def test_mmd_over_the_epochs_batches_is_the_unbiased_linear_mmd_of_the_whole_set():
    rng = np.random.default_rng(0)
    generated, real = rng.normal(size=(5, 1, 4, 4, 4)), rng.normal(0.4, 1.2, size=(5, 1, 4, 4, 4))
    metric = VolumeSetMMD(size=4)
    for part in (slice(0, 2), slice(2, 5)):  # two validation batches of one epoch
        metric.update(torch.from_numpy(generated[part]).float(), torch.from_numpy(real[part]).float())
    expected = unbiased_linear_mmd(real.reshape(5, -1), generated.reshape(5, -1))
    assert float(metric.compute()) == pytest.approx(expected, rel=1e-4)


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    mean = np.square(a.mean(0) - b.mean(0)).sum()
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    return float(mean + np.trace(cov_a + cov_b - 2 * linalg.sqrtm(cov_a @ cov_b).real))


def test_fid_is_the_frechet_distance_of_the_networks_pooled_features(tmp_path):
    network = torch.jit.script(torch.nn.Conv3d(1, 3, kernel_size=2))
    path = tmp_path / "features.pt"
    torch.jit.save(network, str(path))
    torch.manual_seed(0)
    generated, real = torch.randn(6, 1, 4, 4, 4), 0.5 * torch.randn(6, 1, 4, 4, 4) + 0.3
    metric = VolumeSetFID(str(path))
    metric.update(generated[:3], real[:3])
    metric.update(generated[3:], real[3:])
    with torch.no_grad():
        a, b = (network(v).flatten(2).mean(2).double().numpy() for v in (generated, real))
    assert float(metric.compute()) == pytest.approx(frechet_distance(a, b), rel=1e-3)
