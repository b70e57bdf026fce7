"""The LDM's set metrics on their own: MMD and 3D FID against formulas worked in numpy/scipy, MS-SSIM's scales,
and the refusals of a feature network file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import linalg

from lightning_modules.ldm.metrics import (
    MSSSIM_WEIGHTS,
    VolumeSetFID,
    VolumeSetMMD,
    load_feature_network,
    msssim_weights,
    sample_msssim,
)
from medvol.core.errors import MedvolError


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


def test_mmd_pools_large_volumes_to_the_size_asked_and_is_nan_for_one_volume():
    volumes = torch.arange(2 * 8**3, dtype=torch.float32).view(2, 1, 8, 8, 8)
    metric = VolumeSetMMD(size=4)
    metric.update(volumes, volumes.flip(0))
    pooled = volumes.view(2, 1, 4, 2, 4, 2, 4, 2).mean((3, 5, 7)).reshape(2, -1).double().numpy()
    assert float(metric.compute()) == pytest.approx(unbiased_linear_mmd(pooled[::-1], pooled), rel=1e-4)
    single = VolumeSetMMD()
    single.update(volumes[:1], volumes[:1])
    assert torch.isnan(single.compute())


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


def test_a_missing_or_non_torchscript_feature_network_is_one_line_naming_the_key(tmp_path):
    for path, message in ((tmp_path / "absent.pt", "no file at"), (tmp_path / "plain.pt", "is not a TorchScript file")):
        if path.name == "plain.pt":
            torch.save({"weights": torch.zeros(1)}, path)
        with pytest.raises(MedvolError) as caught:
            load_feature_network(str(path))
        assert str(caught.value).startswith("`model.fid_network`") and message in str(caught.value)
        assert "\n" not in str(caught.value)


def test_msssim_uses_as_many_scales_as_the_volume_allows_renormalised():
    # Kernel 3 at 16 voxels: scale n needs 16 > 2 * 2^(n-1), so scales 1-3.
    three = msssim_weights(16, 3)
    assert len(three) == 3 and sum(three) == pytest.approx(1.0)
    assert three[0] / three[2] == pytest.approx(MSSSIM_WEIGHTS[0] / MSSSIM_WEIGHTS[2])
    assert msssim_weights(4, 7) == (1.0,)
    assert len(msssim_weights(512, 7)) == 5


def test_two_identical_samples_have_msssim_one_and_different_ones_less():
    torch.manual_seed(0)
    first = torch.rand(2, 1, 16, 16, 16) * 2 - 1
    assert torch.allclose(sample_msssim(first, first, 3), torch.ones(2), atol=1e-5)
    assert (sample_msssim(first, torch.rand(2, 1, 16, 16, 16) * 2 - 1, 3) < 0.5).all()
