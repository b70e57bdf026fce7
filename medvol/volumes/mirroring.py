"""Test-time mirroring (nnU-Net's default inference): a network's logits averaged over mirrored copies of its input.

Every combination of the mirror axes is run (2^3 = 8 calls for all three spatial axes): the input flipped
along those axes, the network's logits flipped back, so each copy speaks about the same voxel, then the copies
averaged, as nnU-Net v2's predictor does (`_internal_maybe_mirror_and_predict`). The logits stay logits through the
sliding window's blending, the folds' mean and the resampling onto the scan's grid; the softmax or sigmoid comes
last, as in nnU-Net (v1 averaged softmax probabilities instead; the two differ where the copies disagree strongly).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

SPATIAL_AXES = (0, 1, 2)


def mirror_combinations(axes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every subset of `axes`, the empty one (no flip) first: 2^len(axes) combinations."""
    axes = tuple(sorted(set(int(a) for a in axes)))
    return [combo for size in range(len(axes) + 1) for combo in itertools.combinations(axes, size)]


@dataclass(frozen=True)
class MirrorAveraged:
    """`network` (B, C, D, H, W) -> its logits averaged over the mirrored copies of its input.

    Args:
        network: a volume-to-volume network returning logits (a single tensor).
        axes: spatial axes (0, 1, 2 for D, H, W) to mirror along; empty: one plain call.
    """

    network: Callable[[torch.Tensor], torch.Tensor]
    axes: tuple[int, ...] = SPATIAL_AXES

    def __post_init__(self) -> None:
        if any(a not in SPATIAL_AXES for a in self.axes):
            raise ValueError(f"`axes` must be spatial axes among {list(SPATIAL_AXES)}, got {list(self.axes)}")

    @property
    def copies(self) -> int:
        return len(mirror_combinations(self.axes))

    def __call__(self, window: torch.Tensor) -> torch.Tensor:
        total: torch.Tensor | None = None
        for combo in mirror_combinations(self.axes):
            dims = [2 + a for a in combo]
            flipped = torch.flip(window, dims) if dims else window
            logits = self.network(flipped).float()
            logits = torch.flip(logits, dims) if dims else logits
            total = logits if total is None else total + logits
        assert total is not None
        return total / self.copies
