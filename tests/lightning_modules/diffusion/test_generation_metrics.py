"""The generation metrics (lightning_modules/diffusion/generation_metrics.py) against formulas written out here with
numpy, scipy and scikit-learn: the Gaussian-kernel MMD sees mode collapse, the training-set metrics flag a copy,
the set MS-SSIM puts the samples' diversity beside the real set's, 3D and MAISI's 2.5D FID, one line for a bad
network file."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from monai.metrics import MultiScaleSSIMMetric
from scipy import linalg
from scipy.spatial.distance import pdist
from torch import nn

from datamodules.sources.phantom import make_phantom
from lightning_modules.diffusion.generation_metrics import (
    MSSSIM_WEIGHTS,
    CloserThanReal,
    NearestTrainingCorrelation,
    VolumeSetDiversity,
    VolumeSetFID,
    VolumeSetFID2p5D,
    VolumeSetMMD,
    distinct_pairs,
    frechet_distance,
    load_feature_network,
    msssim_weights,
    sample_msssim,
)
from medvol.core.errors import MedvolError


def _block_means(volumes: torch.Tensor, block: int) -> np.ndarray:
    """(B, C, D, H, W) -> (B, C * D/b * H/b * W/b): the mean of each b^3 block, by numpy reshapes."""
    b, c, d, h, w = volumes.shape
    blocks = volumes.numpy().reshape(b, c, d // block, block, h // block, block, w // block, block)
    return blocks.mean(axis=(3, 5, 7)).reshape(b, -1).astype(np.float64)


def gaussian_mmd_by_hand(real: np.ndarray, generated: np.ndarray) -> float:
    """Gretton et al.'s unbiased MMD^2, the kernel scikit-learn's RBF with the median heuristic's bandwidth s:
    gamma = 1 / (2 s^2), s the median distance between distinct points of the two sets together."""
    rbf_kernel = pytest.importorskip("sklearn.metrics.pairwise").rbf_kernel
    bandwidth = np.median(pdist(np.concatenate([real, generated])))
    gamma = 1.0 / (2.0 * bandwidth**2)

    def within(a: np.ndarray) -> float:
        gram = rbf_kernel(a, a, gamma=gamma)
        return (gram.sum() - np.trace(gram)) / (len(a) * (len(a) - 1))

    return within(real) + within(generated) - 2 * rbf_kernel(real, generated, gamma=gamma).mean()


def test_mmd_over_the_epochs_batches_is_the_gaussian_kernel_mmd_with_the_median_bandwidth_of_the_pooled_sets():
    rng = np.random.default_rng(0)
    generated, real = rng.normal(size=(6, 1, 8, 8, 8)), rng.normal(0.4, 1.2, size=(5, 1, 8, 8, 8))
    metric = VolumeSetMMD(size=4)
    metric.update(torch.from_numpy(generated[:3]).float(), torch.from_numpy(real[:2]).float())
    metric.update(torch.from_numpy(generated[3:]).float(), torch.from_numpy(real[2:]).float())
    # 8 voxels per axis kept as 4: the means of 2^3 blocks, every volume of each set together.
    real_blocks, generated_blocks = (_block_means(torch.from_numpy(v), 2) for v in (real, generated))
    expected = gaussian_mmd_by_hand(real_blocks, generated_blocks)
    assert float(metric.compute()) == pytest.approx(expected, rel=1e-4)
    alone = VolumeSetMMD()
    alone.update(torch.zeros(1, 1, 4, 4, 4), torch.zeros(1, 1, 4, 4, 4))
    assert math.isnan(float(alone.compute()))


def phantom_set(seed: int, count: int, size: int = 16) -> torch.Tensor:
    """`count` synthetic head phantoms (T1) of one seed, in [-1, 1]: independent draws of one distribution."""
    volumes = torch.from_numpy(np.stack([make_phantom(seed, i, size).channels["t1"] for i in range(count)]))[:, None]
    return volumes.float() / volumes.amax() * 2 - 1


@pytest.fixture(scope="module")
def sets() -> dict[str, torch.Tensor]:
    training, held_out = phantom_set(0, 12), phantom_set(1, 12)
    return {
        "training": training,
        "independent": phantom_set(2, 12),
        "held_out": held_out,
        # What users fear: the mean volume every time, one sample repeated, the training set given back.
        "mean": held_out.mean(0, keepdim=True).expand(12, -1, -1, -1, -1),
        "repeated": held_out[:1].expand(12, -1, -1, -1, -1),
        "copy": training,
    }


def set_value(metric, generated: torch.Tensor, real: torch.Tensor) -> float:
    metric.update(generated, real)
    return float(metric.compute())


def test_a_collapsed_generator_scores_clearly_worse_than_independent_real_draws(sets):
    training = sets["training"]
    independent = set_value(VolumeSetMMD(), sets["independent"], training)
    mean, repeated = (set_value(VolumeSetMMD(), sets[name], training) for name in ("mean", "repeated"))
    # Measured: 0.03 for independent phantoms against 0.26 (mean) and 0.42 (repeated); within 1/n of 0 is "alike".
    assert abs(independent) < 1 / 12
    assert mean > 3 * max(independent, 1 / 12) and repeated > 3 * max(independent, 1 / 12)


def test_a_copy_of_the_training_set_is_flagged_and_new_draws_are_not(sets):
    reference = torch.from_numpy(_block_means(sets["training"], 1)).float()

    def closeness(generated: torch.Tensor) -> tuple[float, float]:
        nearest, closer = NearestTrainingCorrelation(size=16), CloserThanReal(size=16)
        nearest.reference = closer.reference = reference
        nearest.update(generated)
        return float(nearest.compute()), set_value(closer, generated, sets["held_out"])

    copy, new = closeness(sets["copy"]), closeness(sets["independent"])
    assert copy == pytest.approx((1.0, 1.0))
    # Nearest-training correlation written out: the largest Pearson r of each volume with any training volume.
    r = np.corrcoef(_block_means(sets["independent"], 1), reference.numpy())[:12, 12:]
    assert new[0] == pytest.approx(r.max(1).mean(), rel=1e-5)
    assert new[1] <= 3 / 12
    without_reference = NearestTrainingCorrelation()
    without_reference.update(sets["independent"])
    assert math.isnan(float(without_reference.compute()))


def test_the_set_ms_ssim_is_monais_over_every_pair_and_shows_a_collapsed_set_beside_the_real_ones(sets):
    real = sets["held_out"][:6]
    metric = VolumeSetDiversity(size=16, kernel_size=3)
    metric.update(real[3:])
    metric.update(real[:3])
    monai = MultiScaleSSIMMetric(spatial_dims=3, data_range=2.0, kernel_size=3, weights=msssim_weights(16, 3))
    pairs = list(itertools.combinations(range(6), 2))
    expected = np.mean([float(monai(real[i:i + 1], real[j:j + 1])) for i, j in pairs])
    assert float(metric.compute()) == pytest.approx(expected, rel=1e-5)
    collapsed = VolumeSetDiversity(size=16, kernel_size=3)
    collapsed.update(sets["repeated"][:6])
    assert float(collapsed.compute()) == pytest.approx(1.0, abs=1e-5) and expected < 0.97


def test_a_capped_set_ms_ssim_takes_the_same_pairs_whatever_the_order_the_volumes_came_in(sets):
    volumes = sets["held_out"]
    assert len(distinct_pairs(12, 10)) == 10 and len(set(distinct_pairs(12, 10))) == 10
    forward, backward = VolumeSetDiversity(16, 3, max_pairs=10), VolumeSetDiversity(16, 3, max_pairs=10)
    forward.update(volumes)
    backward.update(volumes.flip(0))
    assert float(forward.compute()) == pytest.approx(float(backward.compute()), rel=1e-6)


def test_a_missing_or_non_torchscript_fid_network_is_one_line(tmp_path):
    with pytest.raises(MedvolError, match=r"`model.fid_network`: no file at .*absent.pt; expected a TorchScript"):
        load_feature_network(str(tmp_path / "absent.pt"))
    (tmp_path / "weights.pt").write_bytes(b"not a TorchScript archive")
    with pytest.raises(MedvolError, match=r"weights.pt is not a TorchScript file"):
        VolumeSetFID(str(tmp_path / "weights.pt"))
    with pytest.raises(MedvolError, match=r"`model.fid_network_2d`: .*weights.pt is not a TorchScript file"):
        VolumeSetFID2p5D(str(tmp_path / "weights.pt"))


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


def scipy_frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The FID as its paper writes it: scipy's general matrix square root of the covariances' product."""
    mean = np.square(a.mean(0) - b.mean(0)).sum()
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    return float(mean + np.trace(cov_a + cov_b - 2 * linalg.sqrtm(cov_a @ cov_b).real))


@pytest.mark.parametrize("seed", range(4))
def test_the_frechet_distance_equals_scipys_sqrtm_on_random_covariances(seed):
    rng = np.random.default_rng(seed)
    features = 2 + seed * 3
    # Correlated features, different covariances and means, more rows than features (both covariances full rank).
    a = rng.normal(size=(60, features)) @ rng.normal(size=(features, features)) + rng.normal(size=features)
    b = rng.normal(size=(45, features)) @ rng.normal(size=(features, features))
    value = frechet_distance(torch.from_numpy(a), torch.from_numpy(b))
    assert value.dtype == torch.float64
    assert float(value) == pytest.approx(scipy_frechet_distance(a, b), rel=1e-6)


def test_the_frechet_distance_of_diagonal_covariances_is_worked_by_hand():
    # Rows at the corners (+-u, +-v) around a mean: covariance diag(4u^2/3, 4v^2/3) (N - 1 = 3), no correlation.
    corners = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    generated = corners * torch.tensor([1.5, 3.0]) + torch.tensor([1.0, 2.0])  # diag(3, 12), mean (1, 2)
    real = corners * torch.tensor([3.0, 1.5])  # diag(12, 3), mean (0, 0)
    # |(1, 2)|^2 + (sqrt 3 - sqrt 12)^2 + (sqrt 12 - sqrt 3)^2 = 5 + 3 + 3.
    assert float(frechet_distance(generated, real)) == pytest.approx(11.0, rel=1e-12)
    assert float(frechet_distance(real, real)) == pytest.approx(0.0, abs=1e-12)


def test_fid_is_the_frechet_distance_of_the_networks_pooled_features(tmp_path, sqrtm_without_disp):
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
    assert float(metric.compute()) == pytest.approx(scipy_frechet_distance(a, b), rel=1e-3)


def maisi_slice_features(network: torch.jit.ScriptModule, volumes: np.ndarray, axis: int) -> np.ndarray:
    """MAISI's 2.5D features written out: per volume, min-max to [0, 1], every slice across `axis` (0: x, sagittal;
    1: y, coronal; 2: z, axial) as three BGR channels less the ImageNet means, the 2D maps averaged over space."""
    rows = []
    for volume in volumes[:, 0]:
        scaled = (volume - volume.min()) / (volume.max() - volume.min() + 1e-10)
        slices = np.moveaxis(scaled, axis, 0)[:, None].repeat(3, axis=1)
        slices = slices - np.array([0.406, 0.456, 0.485]).reshape(1, 3, 1, 1)
        with torch.no_grad():
            maps = network(torch.from_numpy(slices).float()).double().numpy()
        rows.append(maps.mean(axis=(2, 3)))
    return np.concatenate(rows)


def test_the_2p5d_fid_is_maisis_per_plane_frechet_distance_over_every_slice_and_their_mean(tmp_path,
                                                                                            sqrtm_without_disp):
    torch.manual_seed(0)
    convolution = nn.Conv2d(3, 4, 3)
    with torch.no_grad():
        convolution.weight.mul_(10.0)
    network = torch.jit.script(nn.Sequential(convolution, nn.Tanh()))
    torch.jit.save(network, str(tmp_path / "radimagenet.pt"))
    # Anisotropic volumes (x, y, z) = (9, 10, 11): each plane has its own slice count and shape. The real ones
    # brighten along x (sagittal slices differ from each other, the others' less), the generated are noise.
    ramp = torch.linspace(0.0, 3.0, 9).view(1, 1, 9, 1, 1)
    generated, real = torch.randn(3, 1, 9, 10, 11), torch.randn(3, 1, 9, 10, 11) + ramp
    metric = VolumeSetFID2p5D(str(tmp_path / "radimagenet.pt"), slices_per_call=4)
    metric.update(generated[:2], real[:2])
    metric.update(generated[2:], real[2:])
    values = {k: float(v) for k, v in metric.compute().items()}
    expected = {
        plane: scipy_frechet_distance(maisi_slice_features(network, generated.numpy(), axis),
                                      maisi_slice_features(network, real.numpy(), axis))
        for plane, axis in (("sagittal", 0), ("coronal", 1), ("axial", 2))
    }
    for plane, value in expected.items():
        assert values[plane] == pytest.approx(value, rel=1e-3), plane
    assert values["mean"] == pytest.approx(np.mean(list(expected.values())), rel=1e-3)
    assert min(expected.values()) > 0.05 and len({round(v, 3) for v in expected.values()}) == 3
