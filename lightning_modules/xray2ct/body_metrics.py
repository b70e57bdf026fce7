"""Figures over the body, in Hounsfield units: a generated CT judged where the patient is, not over the air around it.

The body is the true CT above `BODY_HU` (-500 HU: soft tissue and bone, not air or lung's emptiest parts).
Volumes come in model units, mapped linearly from the dataset's HU window, so a prediction beyond
the window is measured as predicted (nothing is clamped).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torchmetrics import Metric

BODY_HU = -500.0
# SSIM's Gaussian window: 5 voxels, sigma 1.5 (the kernel of the cube-wide SSIM the stages report).
SSIM_KERNEL, SSIM_SIGMA = 5, 1.5


def _gaussian_filter(volume: torch.Tensor) -> torch.Tensor:
    """(B, 1, D, H, W) smoothed by the separable SSIM window, borders mirrored so the map keeps the volume's shape."""
    offsets = torch.arange(SSIM_KERNEL, dtype=volume.dtype, device=volume.device) - SSIM_KERNEL // 2
    kernel = torch.exp(-(offsets**2) / (2 * SSIM_SIGMA**2))
    kernel = kernel / kernel.sum()
    out = volume
    for axis in range(3):
        shape = [1, 1, 1, 1, 1]
        shape[2 + axis] = SSIM_KERNEL
        pad = [0] * 6
        pad[4 - 2 * axis: 6 - 2 * axis] = [SSIM_KERNEL // 2] * 2
        out = F.conv3d(F.pad(out, pad, mode="reflect"), kernel.reshape(shape))
    return out


def ssim_map(preds: torch.Tensor, target: torch.Tensor, data_range: float) -> torch.Tensor:
    """The local SSIM (Wang et al. 2004, Gaussian-weighted) at every voxel of (B, 1, D, H, W) volumes."""
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    x, y = preds.double(), target.double()
    mu_x, mu_y = _gaussian_filter(x), _gaussian_filter(y)
    var_x = _gaussian_filter(x * x) - mu_x**2
    var_y = _gaussian_filter(y * y) - mu_y**2
    cov = _gaussian_filter(x * y) - mu_x * mu_y
    return ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))


def to_hounsfield(
    volume: torch.Tensor, window: Sequence[float], output_range: Sequence[float] = (-1.0, 1.0)
) -> torch.Tensor:
    """Model units -> HU by the window's linear map, unclamped (so values beyond the window stay beyond it)."""
    low, high = float(window[0]), float(window[1])
    out_low, out_high = float(output_range[0]), float(output_range[1])
    return low + (volume.float() - out_low) * (high - low) / (out_high - out_low)


class _BodyMetric(Metric):
    """Sums of a per-voxel figure over the body voxels of every subject, and their count."""

    full_state_update = False

    def __init__(self, window: Sequence[float] = (-1000.0, 1000.0)) -> None:
        super().__init__()
        self.window = (float(window[0]), float(window[1]))
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("voxels", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def body(self, target: torch.Tensor) -> torch.Tensor:
        return to_hounsfield(target, self.window) > BODY_HU

    @abstractmethod
    def voxel_figure(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The figure at every voxel, shaped like `target`."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        mask = self.body(target)
        self.total += self.voxel_figure(preds, target)[mask].double().sum()
        self.voxels += mask.sum()

    def compute(self) -> torch.Tensor:
        """The figure's mean over every body voxel seen."""
        return (self.total / self.voxels.clamp(min=1)).float()


class BodyMAE(_BodyMetric):
    """Mean absolute error in HU over the body voxels."""

    def voxel_figure(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (to_hounsfield(preds, self.window) - to_hounsfield(target, self.window)).abs()


class BodyPSNR(_BodyMetric):
    """PSNR (dB) over the body voxels, the peak being the HU window's width."""

    def voxel_figure(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (to_hounsfield(preds, self.window) - to_hounsfield(target, self.window)).square()

    def compute(self) -> torch.Tensor:
        width = self.window[1] - self.window[0]
        return 10.0 * torch.log10(width**2 / super().compute().clamp(min=1e-12))


class BodySSIM(_BodyMetric):
    """The local 3D SSIM (`ssim_map`, model units: the window's width as data range) averaged over the body voxels."""

    def voxel_figure(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ssim_map(preds, target, 2.0)
