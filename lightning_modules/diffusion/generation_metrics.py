"""Generation metrics over sets of volumes: MMD and 3D FID between generated and real (MONAI), sample diversity
(MS-SSIM)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from monai.metrics import FIDMetric, MMDMetric, MultiScaleSSIMMetric
from torchmetrics import Metric

from medvol.core.errors import MedvolError

# MONAI's default MS-SSIM scale weights (Wang et al. 2003); fewer scales where a volume is too small for five.
MSSSIM_WEIGHTS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)


class VolumeSetMMD(Metric):
    """MMD (MONAI `MMDMetric`, linear kernel) between the set of generated and the set of real volumes of an epoch.

    Volumes are average-pooled to at most `size` voxels per axis before they are kept (a 512^3 CT would
    not fit in a state), and gathered over ranks, so the value is that of the whole validation set.
    NaN with fewer than two volumes.
    """

    full_state_update = False

    def __init__(self, size: int = 16) -> None:
        super().__init__()
        self.size = int(size)
        self.add_state("generated", default=[], dist_reduce_fx="cat")
        self.add_state("real", default=[], dist_reduce_fx="cat")

    def _pooled(self, volumes: torch.Tensor) -> torch.Tensor:
        target = [min(self.size, s) for s in volumes.shape[2:]]
        return F.adaptive_avg_pool3d(volumes.float(), target).flatten(1)

    def update(self, generated: torch.Tensor, real: torch.Tensor) -> None:
        self.generated.append(self._pooled(generated))
        self.real.append(self._pooled(real))

    def compute(self) -> torch.Tensor:
        generated = torch.cat(self.generated) if isinstance(self.generated, list) else self.generated
        real = torch.cat(self.real) if isinstance(self.real, list) else self.real
        if generated.shape[0] < 2:
            return torch.tensor(float("nan"), device=generated.device)
        return MMDMetric()(real, generated)


def load_feature_network(path: str) -> torch.jit.ScriptModule:
    """The user's TorchScript feature network for 3D FID (`model.fid_network`), frozen, else one `MedvolError` line."""
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise MedvolError(
            f"`model.fid_network`: no file at {file}; expected a TorchScript 3D feature network saved with "
            "torch.jit.save (e.g. MedicalNet weights you have; medvol downloads none), or null for no FID"
        )
    try:
        network = torch.jit.load(str(file), map_location="cpu")
    except Exception as err:  # noqa: BLE001 - any load failure is the same user error
        raise MedvolError(
            f"`model.fid_network`: {file} is not a TorchScript file ({type(err).__name__}); expected a network saved "
            "with torch.jit.save"
        ) from err
    return network.eval()


class VolumeSetFID(Metric):
    """3D FID (MONAI `FIDMetric`) between the features of the epoch's generated and real volumes.

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
        out = network(volumes.float())
        return (out.flatten(2).mean(2) if out.ndim > 2 else out).double()

    def update(self, generated: torch.Tensor, real: torch.Tensor) -> None:
        self.generated.append(self.features(generated))
        self.real.append(self.features(real))

    def compute(self) -> torch.Tensor:
        generated = torch.cat(self.generated) if isinstance(self.generated, list) else self.generated
        real = torch.cat(self.real) if isinstance(self.real, list) else self.real
        if generated.shape[0] < 2:
            return torch.tensor(float("nan"), device=generated.device)
        return FIDMetric()(generated, real)


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
