"""Generation metrics over sets of volumes: MMD between generated and real (MONAI) and sample diversity (MS-SSIM)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from monai.metrics import MMDMetric, MultiScaleSSIMMetric
from torchmetrics import Metric

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


def msssim_weights(size: int, kernel_size: int) -> tuple[float, ...]:
    """MONAI's scale weights for as many scales as a volume of `size` voxels per axis allows, renormalised."""
    scales = max(1, max(n for n in range(1, 6) if size > (kernel_size - 1) * 2 ** (n - 1)) if size > kernel_size - 1 else 1)
    weights = MSSSIM_WEIGHTS[:scales]
    return tuple(w / sum(weights) for w in weights)


def sample_msssim(first: torch.Tensor, second: torch.Tensor, kernel_size: int, data_range: float = 2.0) -> torch.Tensor:
    """(B,) MS-SSIM between two samples of the same conditions (MONAI `MultiScaleSSIMMetric`): 1 is no diversity."""
    weights = msssim_weights(min(first.shape[2:]), kernel_size)
    metric = MultiScaleSSIMMetric(spatial_dims=3, data_range=data_range, kernel_size=kernel_size, weights=weights)
    return metric(first.float(), second.float()).view(-1)
