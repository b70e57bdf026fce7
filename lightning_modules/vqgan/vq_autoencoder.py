"""3D convolutional encoder and decoder of the VQ-GAN (after medicaldiffusion's VQ-GAN 3D)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from medvol.core.errors import MedvolError


def _groups(channels: int, max_groups: int = 32) -> int:
    return math.gcd(channels, max_groups)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(_groups(channels), channels, eps=1e-6, affine=True)


class ResBlock3d(nn.Module):
    """GroupNorm-SiLU-Conv twice with a residual connection; convolutions pad by replication."""

    def __init__(self, channels: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.block = nn.Sequential(
            _norm(channels),
            nn.SiLU(),
            nn.Conv3d(channels, channels, 3, padding=1, padding_mode="replicate"),
            _norm(channels),
            nn.SiLU(),
            nn.Dropout(dropout),
            nn.Conv3d(channels, channels, 3, padding=1, padding_mode="replicate"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


def _halvings(downsample: Sequence[int]) -> list[int]:
    """The halvings of each axis (log2 of its factor); a factor that is no power of two is refused."""
    # `f < 1` first: log2 has no value at 0 or below.
    if any(f < 1 or 2 ** round(math.log2(f)) != f for f in downsample):
        raise MedvolError(f"`downsample` factors must be powers of two, got {list(downsample)}")
    return [round(math.log2(f)) for f in downsample]


class Encoder3d(nn.Module):
    """Strided convolutions that halve each axis until its `downsample` factor is reached.

    Args:
        in_channels: image channels.
        n_hiddens: channels after the first convolution; doubled at every halving.
        downsample: per-axis reduction factor (powers of two), e.g. (4, 4, 4).
        embedding_dim: channels of the latent that the codebook quantises.
    """

    def __init__(self, in_channels: int, n_hiddens: int, downsample: Sequence[int], embedding_dim: int) -> None:
        super().__init__()
        steps = _halvings(downsample)
        self.conv_in = nn.Conv3d(in_channels, n_hiddens, 3, padding=1, padding_mode="replicate")
        blocks = []
        channels = n_hiddens
        for level in range(max(steps)):
            stride = tuple(2 if s > level else 1 for s in steps)
            kernel = tuple(4 if s == 2 else 3 for s in stride)
            out = channels * 2
            blocks += [
                nn.Conv3d(channels, out, kernel, stride=stride, padding=1, padding_mode="replicate"),
                ResBlock3d(out),
            ]
            channels = out
        self.down = nn.Sequential(*blocks)
        self.out = nn.Sequential(_norm(channels), nn.SiLU(), nn.Conv3d(channels, embedding_dim, 1))
        self.out_channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.down(self.conv_in(x)))


class Decoder3d(nn.Module):
    """Transposed convolutions that undo `Encoder3d`'s halvings."""

    def __init__(self, out_channels: int, n_hiddens: int, downsample: Sequence[int], embedding_dim: int) -> None:
        super().__init__()
        steps = _halvings(downsample)
        levels = max(steps)
        channels = n_hiddens * 2**levels
        self.conv_in = nn.Conv3d(embedding_dim, channels, 1)
        blocks = []
        for level in reversed(range(levels)):
            stride = tuple(2 if s > level else 1 for s in steps)
            kernel = tuple(4 if s == 2 else 3 for s in stride)
            out = channels // 2
            blocks += [
                _norm(channels),
                nn.SiLU(),
                nn.ConvTranspose3d(channels, out, kernel, stride=stride, padding=1),
                ResBlock3d(out),
                ResBlock3d(out),
            ]
            channels = out
        self.up = nn.Sequential(*blocks)
        self.out = nn.Conv3d(channels, out_channels, 3, padding=1, padding_mode="replicate")

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.out(self.up(self.conv_in(z)))
