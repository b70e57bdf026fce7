"""A 2D encoder shared by every X-ray view, turning V radiographs into tokens a 3D denoiser attends to."""

from __future__ import annotations

import torch
from torch import nn


class ViewEncoder(nn.Module):
    """One CNN for all views plus a learned embedding per view; output tokens (B, V * N, dim).

    Each view (H, W) goes through strided convolutions (GroupNorm + SiLU) down to an
    (H / 2**levels, W / 2**levels) grid of `dim`-channel features; every grid cell becomes a
    token, to which a learned position embedding and the view's embedding are added. The view
    embedding lets cross-attention tell the AP tokens from the lateral ones.

    Args:
        num_views: V, the number of radiographs per subject.
        image_size: (H, W) of each view.
        dim: token width (the denoiser's `cross_attention_dim`).
        channels: channels of the strided stages (one halving each).
    """

    def __init__(
        self, num_views: int, image_size: tuple[int, int], dim: int, channels: tuple[int, ...] = (16, 32, 64)
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        previous = 1
        for width in channels:
            layers += [
                nn.Conv2d(previous, width, 3, stride=2, padding=1), nn.GroupNorm(min(8, width), width), nn.SiLU()
            ]
            previous = width
        layers.append(nn.Conv2d(previous, dim, 1))
        self.backbone = nn.Sequential(*layers)
        grid = [int(s) for s in image_size]
        for _ in channels:
            grid = [(g + 1) // 2 for g in grid]
        self.num_views = int(num_views)
        self.tokens_per_view = grid[0] * grid[1]
        self.position = nn.Parameter(torch.randn(1, 1, self.tokens_per_view, dim) * 0.02)
        self.view_embedding = nn.Parameter(torch.randn(1, num_views, 1, dim) * 0.02)
        self.norm = nn.LayerNorm(dim)

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        """(B, V, H, W) radiographs -> (B, V * N, dim) tokens."""
        b, v = views.shape[:2]
        if v != self.num_views:
            raise ValueError(f"`xray` has {v} views, the encoder was built for {self.num_views}")
        features = self.backbone(views.reshape(b * v, 1, *views.shape[2:]))
        tokens = features.flatten(2).transpose(1, 2).reshape(b, v, self.tokens_per_view, -1)
        tokens = tokens + self.position + self.view_embedding
        return self.norm(tokens.reshape(b, v * self.tokens_per_view, -1))
