"""Whole volumes of any size through a network trained on smaller windows (MONAI's sliding-window inference)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from monai.inferers import sliding_window_inference

BLEND_MODES = ("gaussian", "constant")


@dataclass(frozen=True)
class SlidingWindow:
    """Runs a volume-to-volume network over a whole (B, C, D, H, W) volume window by window.

    Windows of `roi` voxels (the training patch or volume), `overlap` apart, go to `device` in
    groups of `batch_size`; the blended whole-volume output is kept on the CPU, so only the
    windows need to fit on the device. Volumes smaller than `roi` along an axis are padded and the
    output is cropped back to the input's shape.

    Args:
        roi: window size (D, H, W).
        overlap: fraction of a window shared with its neighbour, in [0, 1).
        mode: `gaussian` (window centres weigh most) or `constant` blending.
        batch_size: windows per network call.
        device: where the network runs.
    """

    roi: tuple[int, int, int]
    overlap: float = 0.25
    mode: str = "gaussian"
    batch_size: int = 4
    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        if self.mode not in BLEND_MODES:
            raise ValueError(f"`mode` must be one of {list(BLEND_MODES)}, got {self.mode!r}")
        if not 0.0 <= self.overlap < 1.0:
            raise ValueError(f"`overlap` must be in [0, 1), got {self.overlap}")

    @classmethod
    def of(cls, roi: Sequence[int], **kwargs: object) -> SlidingWindow:
        return cls(tuple(int(r) for r in roi), **kwargs)  # type: ignore[arg-type]

    def __call__(self, network: Callable[[torch.Tensor], torch.Tensor], volume: torch.Tensor) -> torch.Tensor:
        """`network` applied to `volume` (B, C, D, H, W) window by window; the output on the CPU."""
        output = sliding_window_inference(
            volume.cpu(), list(self.roi), self.batch_size, network, overlap=self.overlap, mode=self.mode,
            sw_device=self.device, device=torch.device("cpu"),
        )
        assert isinstance(output, torch.Tensor)
        return output
