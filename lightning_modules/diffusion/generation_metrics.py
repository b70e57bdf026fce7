"""Generation metrics over the sets of generated and real volumes of an epoch: what a user of a generator fears.

- `VolumeSetMMD`: the maximum mean discrepancy (Gretton et al. 2012) with a Gaussian kernel, a characteristic
  one, so it compares whole distributions, not only their means (a linear kernel scores a generator that
  always outputs the mean volume as perfect).
- `VolumeSetDiversity`: the mean MS-SSIM over pairs of distinct volumes of one set (1: all alike), reported
  for the samples beside the real set's own: a collapsed generator stands out against the real spread.
- `NearestTrainingCorrelation`, `CloserThanReal`: how close each volume is to its nearest training volume
  (Pearson correlation), and the share of samples closer to a training volume than any held-out real
  volume is: a generator that copies its training set scores 1 (not a collapse detector: the training mean
  volume repeated scored 0 on the real-anatomy brains, blurred past every training brain;
  docs/benchmarks/generation.md).
- `VolumeSetFID` (3D, a user's TorchScript network) and `VolumeSetFID2p5D` (MAISI's 2.5D FID: the
  axial, coronal and sagittal slices through a user's 2D network), only where the user gives a network.

Every set metric keeps its volumes average-pooled (a 512^3 CT would not fit in a state) and gathers them
over ranks, so its value is that of the whole validation set; NaN with fewer than two volumes.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from monai.metrics import MultiScaleSSIMMetric
from torchmetrics import Metric

from medvol.core.errors import MedvolError

# MONAI's default MS-SSIM scale weights (Wang et al. 2003); fewer scales where a volume is too small for five.
MSSSIM_WEIGHTS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)
# MAISI's 2.5D FID planes: slices across each spatial axis of a RAS (x, y, z) volume.
PLANES = {"sagittal": 0, "coronal": 1, "axial": 2}
# MAISI's RadImageNet preprocessing subtracts these channel means (BGR) from slices scaled to [0, 1].
IMAGENET_BGR_MEAN = (0.406, 0.456, 0.485)
NAN = float("nan")


def pooled(volumes: torch.Tensor, size: int) -> torch.Tensor:
    """(B, C, D, H, W) -> (B, C * d * h * w): average-pooled to at most `size` voxels per axis, flattened, fp32."""
    target = [min(int(size), s) for s in volumes.shape[2:]]
    return F.adaptive_avg_pool3d(volumes.float(), target).flatten(1)


def gathered(state: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """A list state (one process) or its concatenation over ranks (torchmetrics' sync) as one tensor (empty: none)."""
    if isinstance(state, list):
        return torch.cat(state) if state else torch.zeros(0)
    return state


def median_heuristic(points: torch.Tensor) -> torch.Tensor:
    """The median Euclidean distance between distinct rows of `points` (Gretton et al.'s bandwidth choice)."""
    distances = torch.cdist(points, points)
    above = torch.triu_indices(len(points), len(points), offset=1, device=points.device)
    return distances[above[0], above[1]].median()


def gaussian_mmd(real: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
    """Unbiased MMD^2 between the rows of `real` (m, F) and `generated` (n, F), in float64.

    k(a, b) = exp(-|a - b|^2 / (2 s^2)) with s the median distance between distinct rows of the two sets
    together (the median heuristic). Near 0 (within about 1/n either way) when the sets are draws of one
    distribution; up to 2 when they share nothing.
    """
    real, generated = real.double(), generated.double()
    bandwidth = median_heuristic(torch.cat([real, generated])).clamp_min(1e-12)

    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.exp(-torch.cdist(a, b).square() / (2 * bandwidth.square()))

    def within(a: torch.Tensor) -> torch.Tensor:
        gram = kernel(a, a)
        return (gram.sum() - gram.diagonal().sum()) / (len(a) * (len(a) - 1))

    return within(real) + within(generated) - 2 * kernel(real, generated).mean()


class VolumeSetMMD(Metric):
    """`gaussian_mmd` between the epoch's real and generated volumes, each average-pooled to at most `size`^3."""

    full_state_update = False

    def __init__(self, size: int = 16) -> None:
        super().__init__()
        self.size = int(size)
        self.add_state("generated", default=[], dist_reduce_fx="cat")
        self.add_state("real", default=[], dist_reduce_fx="cat")

    def update(self, generated: torch.Tensor, real: torch.Tensor) -> None:
        self.generated.append(pooled(generated, self.size))
        self.real.append(pooled(real, self.size))

    def compute(self) -> torch.Tensor:
        generated, real = gathered(self.generated), gathered(self.real)
        if min(len(generated), len(real)) < 2:
            return torch.tensor(NAN, device=generated.device)
        return gaussian_mmd(real, generated).float()


def msssim_weights(size: int, kernel_size: int) -> tuple[float, ...]:
    """MONAI's scale weights for as many scales as a volume of `size` voxels per axis allows, renormalised."""
    scales = max(
        1, max(n for n in range(1, 6) if size > (kernel_size - 1) * 2 ** (n - 1)) if size > kernel_size - 1 else 1
    )
    weights = MSSSIM_WEIGHTS[:scales]
    return tuple(w / sum(weights) for w in weights)


def sample_msssim(first: torch.Tensor, second: torch.Tensor, kernel_size: int, data_range: float = 2.0) -> torch.Tensor:
    """(B,) MS-SSIM between two samples of the same conditions (MONAI `MultiScaleSSIMMetric`): 1 is no diversity."""
    weights = msssim_weights(min(first.shape[2:]), kernel_size)
    metric = MultiScaleSSIMMetric(spatial_dims=3, data_range=data_range, kernel_size=kernel_size, weights=weights)
    return metric(first.float(), second.float()).view(-1)


def distinct_pairs(count: int, most: int) -> list[tuple[int, int]]:
    """Every pair i < j of `count` items, or `most` of them drawn without replacement by a fixed seed."""
    pairs = list(itertools.combinations(range(count), 2))
    if len(pairs) <= most:
        return pairs
    chosen = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0))[:most]
    return [pairs[int(i)] for i in sorted(chosen.tolist())]


class VolumeSetDiversity(Metric):
    """Mean MS-SSIM between distinct volumes of one set (1: no diversity), the volumes average-pooled to at most
    `size`^3 (the same for samples and real volumes, so the two compare).

    Over every pair, or `max_pairs` of them (a fixed draw over the volumes sorted by content, so the value does
    not depend on which rank held which volume). NaN with fewer than two volumes.
    """

    full_state_update = False

    def __init__(self, size: int = 32, kernel_size: int = 7, max_pairs: int = 64, data_range: float = 2.0) -> None:
        super().__init__()
        self.size, self.kernel_size, self.max_pairs = int(size), int(kernel_size), int(max_pairs)
        self.data_range = float(data_range)
        self.add_state("volumes", default=[], dist_reduce_fx="cat")

    def update(self, volumes: torch.Tensor) -> None:
        target = [min(self.size, s) for s in volumes.shape[2:]]
        self.volumes.append(F.adaptive_avg_pool3d(volumes.float(), target))

    def compute(self) -> torch.Tensor:
        volumes = gathered(self.volumes)
        if len(volumes) < 2:
            return torch.tensor(NAN, device=volumes.device)
        volumes = volumes[torch.argsort(volumes.double().flatten(1).sum(1))]
        first, second = zip(*distinct_pairs(len(volumes), self.max_pairs), strict=True)
        return sample_msssim(volumes[list(first)], volumes[list(second)], self.kernel_size, self.data_range).mean()


def nearest_correlations(volumes: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """(B,) the largest Pearson correlation of each row of `volumes` (B, F) with any row of `reference` (R, F)."""

    def standardised(rows: torch.Tensor) -> torch.Tensor:
        centred = rows.double() - rows.double().mean(1, keepdim=True)
        return centred / centred.norm(dim=1, keepdim=True).clamp_min(1e-12)

    return (standardised(volumes) @ standardised(reference.to(volumes.device)).T).amax(1)


class TrainingSetMetric(Metric):
    """A metric of volumes against the training set's (`reference`: (R, F) pooled volumes, set by the module before
    the first evaluation; NaN without it)."""

    full_state_update = False

    def __init__(self, size: int = 16) -> None:
        super().__init__()
        self.size = int(size)
        self.reference: torch.Tensor | None = None


class NearestTrainingCorrelation(TrainingSetMetric):
    """The mean over the epoch's volumes of their correlation with their nearest training volume (both
    average-pooled to at most `size`^3): reported for the samples and for the held-out real volumes."""

    def __init__(self, size: int = 16) -> None:
        super().__init__(size)
        self.add_state("volumes", default=[], dist_reduce_fx="cat")

    def update(self, volumes: torch.Tensor) -> None:
        self.volumes.append(pooled(volumes, self.size))

    def compute(self) -> torch.Tensor:
        volumes = gathered(self.volumes)
        if self.reference is None or len(volumes) < 1:
            return torch.tensor(NAN, device=volumes.device)
        return nearest_correlations(volumes, self.reference).mean().float()


class CloserThanReal(TrainingSetMetric):
    """The share of samples closer to a training volume than any held-out real volume is (nearest-training
    correlation above the real volumes' largest): 1 for a generator that copies its training set, near 1/(n + 1)
    for n held-out volumes when samples are new draws of the training distribution."""

    def __init__(self, size: int = 16) -> None:
        super().__init__(size)
        self.add_state("generated", default=[], dist_reduce_fx="cat")
        self.add_state("real", default=[], dist_reduce_fx="cat")

    def update(self, generated: torch.Tensor, real: torch.Tensor) -> None:
        self.generated.append(pooled(generated, self.size))
        self.real.append(pooled(real, self.size))

    def compute(self) -> torch.Tensor:
        generated, real = gathered(self.generated), gathered(self.real)
        if self.reference is None or len(generated) < 1 or len(real) < 1:
            return torch.tensor(NAN, device=generated.device)
        closest_real = nearest_correlations(real, self.reference).max()
        return (nearest_correlations(generated, self.reference) > closest_real).double().mean().float()


def load_feature_network(path: str, key: str = "model.fid_network") -> torch.jit.ScriptModule:
    """The user's TorchScript feature network (`key`), frozen, else one `MedvolError` line."""
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise MedvolError(
            f"`{key}`: no file at {file}; expected a TorchScript feature network saved with torch.jit.save (e.g. "
            "MedicalNet or RadImageNet weights you have; medvol downloads none), or null for no FID"
        )
    try:
        network = torch.jit.load(str(file), map_location="cpu")
    except Exception as err:  # noqa: BLE001 - any load failure is the same user error
        raise MedvolError(
            f"`{key}`: {file} is not a TorchScript file ({type(err).__name__}); expected a network saved "
            "with torch.jit.save"
        ) from err
    return network.eval()


def frechet_distance(generated: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The Fréchet distance between Gaussians fitted to two sets of feature rows (N, F) (the FID of Heusel et al.
    2017): |m_g - m_r|^2 + tr(S_g) + tr(S_r) - 2 tr((S_g S_r)^(1/2)), the covariances unbiased (N - 1), in float64
    on the features' device.

    tr((S_g S_r)^(1/2)) is the sum of the square roots of the eigenvalues of S_r^(1/2) S_g S_r^(1/2): that matrix is
    similar to S_g S_r, and symmetric positive semi-definite, so both roots come from symmetric eigendecompositions
    (`eigh`), the eigenvalues clamped at 0 against rounding. No general matrix square root (scipy's `sqrtm`, which
    MONAI's FIDMetric calls with an argument SciPy 1.18 removed), no complex parts to discard.
    """
    generated, real = generated.double(), real.double()
    offset = generated.mean(0) - real.mean(0)
    # atleast_2d: one feature's covariance is a 1x1 matrix, not torch.cov's scalar.
    cov_generated, cov_real = (torch.atleast_2d(torch.cov(rows.T)) for rows in (generated, real))
    values, vectors = torch.linalg.eigh(cov_real)
    root_real = (vectors * values.clamp_min(0).sqrt()) @ vectors.T
    inner = root_real @ cov_generated @ root_real
    # Symmetric up to rounding; eigvalsh reads one triangle, so average the two.
    roots = torch.linalg.eigvalsh((inner + inner.T) / 2).clamp_min(0).sqrt()
    return offset @ offset + cov_generated.trace() + cov_real.trace() - 2 * roots.sum()


def spatial_mean(features: torch.Tensor) -> torch.Tensor:
    """(B, F) features as they are; (B, F, ...) feature maps averaged over space."""
    return features.flatten(2).mean(2) if features.ndim > 2 else features


class VolumeSetFID(Metric):
    """3D FID (`frechet_distance`) between the features of the epoch's generated and real volumes.

    The features come from a local TorchScript network mapping (B, C, D, H, W) volumes in [-1, 1] to
    (B, F) vectors or feature maps (global-average-pooled to (B, F)); they are gathered over ranks.
    NaN with fewer than two volumes.
    """

    full_state_update = False

    def __init__(self, network_path: str) -> None:
        super().__init__()
        # In a list: the network's weights are the user's file, not this model's state.
        self._network = [load_feature_network(network_path)]
        self.add_state("generated", default=[], dist_reduce_fx="cat")
        self.add_state("real", default=[], dist_reduce_fx="cat")

    @torch.no_grad()
    def features(self, volumes: torch.Tensor) -> torch.Tensor:
        network = self._network[0].to(volumes.device)
        return spatial_mean(network(volumes.float())).double()

    def update(self, generated: torch.Tensor, real: torch.Tensor) -> None:
        self.generated.append(self.features(generated))
        self.real.append(self.features(real))

    def compute(self) -> torch.Tensor:
        generated, real = gathered(self.generated), gathered(self.real)
        if generated.shape[0] < 2:
            return torch.tensor(NAN, device=generated.device)
        return frechet_distance(generated, real)


def plane_slices(volume: torch.Tensor, axis: int) -> torch.Tensor:
    """(C, D, H, W) -> (N, 3, ., .): every slice across spatial `axis`, as MAISI's RadImageNet 2.5D FID prepares
    them: the volume min-max scaled to [0, 1] (one scale for all its slices), one channel repeated to three, the
    ImageNet channel means (BGR) subtracted."""
    low, high = volume.min(), volume.max()
    scaled = (volume.float() - low) / (high - low + 1e-10)
    slices = scaled[:1].movedim(axis + 1, 0)  # (N, 1, ., .)
    mean = torch.tensor(IMAGENET_BGR_MEAN, dtype=slices.dtype, device=slices.device).view(1, 3, 1, 1)
    return slices.expand(-1, 3, -1, -1) - mean


class VolumeSetFID2p5D(Metric):
    """MAISI's 2.5D FID: per plane (sagittal, coronal, axial: slices across x, y, z of RAS volumes), the FID
    (`frechet_distance`) between the 2D features of every slice of the epoch's generated volumes and every slice
    of its real ones, through the user's TorchScript 2D network (RadImageNet's ResNet-50 in MAISI; its feature
    maps averaged over space). `compute` gives the three and their mean (`fid_2p5d`); NaN below two volumes."""

    full_state_update = False

    def __init__(self, network_path: str, slices_per_call: int = 64) -> None:
        super().__init__()
        self._network = [load_feature_network(network_path, key="model.fid_network_2d")]
        self.slices_per_call = int(slices_per_call)
        for plane in PLANES:
            self.add_state(f"generated_{plane}", default=[], dist_reduce_fx="cat")
            self.add_state(f"real_{plane}", default=[], dist_reduce_fx="cat")
        self.add_state("volumes", default=torch.tensor(0), dist_reduce_fx="sum")

    @torch.no_grad()
    def features(self, volume: torch.Tensor, axis: int) -> torch.Tensor:
        """(N, F) features of the slices of one (C, D, H, W) volume across `axis`."""
        network = self._network[0].to(volume.device)
        slices = plane_slices(volume, axis)
        return torch.cat([spatial_mean(network(part)) for part in slices.split(self.slices_per_call)]).double()

    def update(self, generated: torch.Tensor, real: torch.Tensor) -> None:
        for plane, axis in PLANES.items():
            getattr(self, f"generated_{plane}").extend(self.features(v, axis) for v in generated)
            getattr(self, f"real_{plane}").extend(self.features(v, axis) for v in real)
        self.volumes += generated.shape[0]

    def compute(self) -> dict[str, torch.Tensor]:
        if int(self.volumes) < 2:
            values = {plane: torch.tensor(NAN) for plane in PLANES}
        else:
            values = {
                plane: frechet_distance(gathered(getattr(self, f"generated_{plane}")),
                                        gathered(getattr(self, f"real_{plane}"))).float()
                for plane in PLANES
            }
        return {**values, "mean": torch.stack(list(values.values())).mean()}


def generation_metrics(
    size: int, diversity_size: int, kernel_size: int, fid_network: str | None = None,
    fid_network_2d: str | None = None,
) -> dict[str, Metric]:
    """The set metrics of a generator, by name (`update_generation_metrics` feeds them)."""
    metrics: dict[str, Metric] = {
        "mmd": VolumeSetMMD(size),
        "sample_msssim": VolumeSetDiversity(diversity_size, kernel_size),
        "real_msssim": VolumeSetDiversity(diversity_size, kernel_size),
        "nearest_train_corr": NearestTrainingCorrelation(size),
        "real_nearest_train_corr": NearestTrainingCorrelation(size),
        "closer_than_real": CloserThanReal(size),
    }
    if fid_network:
        metrics["fid"] = VolumeSetFID(fid_network)
    if fid_network_2d:
        metrics["fid_2p5d"] = VolumeSetFID2p5D(fid_network_2d)
    return metrics


def update_generation_metrics(metrics: Any, prefix: str, sample: torch.Tensor, real: torch.Tensor) -> None:
    """Feed one batch of samples and their real counterparts to every generation metric in `metrics` (a
    `MetricCollection` with `prefix`: `in` would look for the names without it, so its keys are listed)."""
    present = set(metrics.keys())
    for name in ("mmd", "closer_than_real", "fid", "fid_2p5d"):
        if f"{prefix}{name}" in present:
            metrics[f"{prefix}{name}"].update(sample, real)
    for name, volumes in (("sample_msssim", sample), ("real_msssim", real), ("nearest_train_corr", sample),
                          ("real_nearest_train_corr", real)):
        if f"{prefix}{name}" in present:
            metrics[f"{prefix}{name}"].update(volumes)
