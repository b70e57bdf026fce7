"""Whole volumes of any size through a network trained on smaller windows (MONAI's sliding-window inference)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from monai.data.utils import dense_patch_slices
from monai.inferers import sliding_window_inference

from medvol.volumes.volume_budget import check_volume_size

BLEND_MODES = ("gaussian", "constant")


@dataclass(frozen=True)
class SlidingWindow:
    """Runs a volume-to-volume network over a whole (B, C, D, H, W) volume window by window.

    Windows of `roi` voxels (the training patch or volume), `overlap` apart, go to `device` in
    groups of `batch_size` and are blended (Gaussian weights by default); the whole-volume output
    is kept on `output_device` (the CPU by default), so only the windows need to fit on the device.
    Volumes smaller than `roi` along an axis are padded (symmetrically, as MONAI pads) and the output
    is cropped back to the input's shape; the padding takes `pad_value` per channel, the value
    training gave the background (MONAI pads with 0, mid-grey for inputs in [-1, 1]). A window that is exactly the
    volume is the whole-volume call itself: nothing to blend, so the output is the network's own, bit for bit.
    The window may come from a file (a run's saved config or plan): a batch of windows and the padded volume are
    held against the memory budget first (`medvol.volumes.volume_budget`).

    The network may take more inputs than the volume: `volumes` (B, C', D, H, W) on the same grid
    are cut to each window alongside it (a condition volume, coordinate channels), and
    `per_sample` tensors (B, ...) give each window its own sample's row (a timestep, view tokens),
    since a group of windows can mix samples.

    Args:
        roi: window size (D, H, W).
        overlap: fraction of a window shared with its neighbour, in [0, 1).
        mode: `gaussian` (window centres weigh most) or `constant` blending.
        batch_size: windows per network call.
        device: where the network runs.
        output_device: where the whole volume is blended and returned.
        pad_value: per channel of `volume` (or one for all), the value padding takes; None: 0. The extra
            `volumes` are padded with 0.
        output_channels: the channels the network returns where the caller knows them (a segmentation's classes):
            the blended output and its weights are held against the memory budget with the padded input.
    """

    roi: tuple[int, int, int]
    overlap: float = 0.25
    mode: str = "gaussian"
    batch_size: int = 4
    device: torch.device = torch.device("cpu")
    output_device: torch.device = torch.device("cpu")
    pad_value: tuple[float, ...] | None = None
    output_channels: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in BLEND_MODES:
            raise ValueError(f"`mode` must be one of {list(BLEND_MODES)}, got {self.mode!r}")
        if not 0.0 <= self.overlap < 1.0:
            raise ValueError(f"`overlap` must be in [0, 1), got {self.overlap}")
        if len(self.roi) != 3 or min(self.roi) < 1:
            raise ValueError(f"`roi` must be three positive sizes (D, H, W), got {self.roi}")
        if self.batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {self.batch_size}")
        # The window may come from a run's saved config or plan: a batch of them is a volume like any other.
        check_volume_size("the sliding window", (self.batch_size, *self.roi), "a batch of windows", before="running it")

    @classmethod
    def of(cls, roi: Sequence[int], **kwargs: Any) -> SlidingWindow:
        return cls(tuple(int(r) for r in roi), **kwargs)  # type: ignore[arg-type]

    def windows(self, shape: Sequence[int]) -> int:
        """How many windows cover a (B, C, D, H, W) volume of `shape`, as MONAI places them (steps of `roi` x (1 -
        `overlap`), the last flush with the far edge; one along an axis the window spans), for every sample."""
        sizes = [max(int(s), r) for s, r in zip(shape[2:], self.roi, strict=True)]
        steps = [r if s == r else max(int(r * (1 - self.overlap)), 1) for s, r in zip(sizes, self.roi, strict=True)]
        return int(shape[0]) * len(dense_patch_slices(sizes, self.roi, steps))

    def __call__(
        self,
        network: Callable[..., torch.Tensor],
        volume: torch.Tensor,
        volumes: Mapping[str, torch.Tensor] | None = None,
        per_sample: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`network(window, **volume_windows, **sample_rows)` over `volume` window by window, blended.

        `volumes` are cast to `volume`'s dtype (they travel with it as extra channels).
        """
        volumes, per_sample = dict(volumes or {}), dict(per_sample or {})
        for name, extra in volumes.items():
            if extra.shape[0] != volume.shape[0] or extra.shape[2:] != volume.shape[2:]:
                raise ValueError(
                    f"`volumes[{name!r}]` has shape {tuple(extra.shape)}; expected {volume.shape[0]} samples on the "
                    f"grid {tuple(volume.shape[2:])}"
                )
        short = [max(r - int(s), 0) for r, s in zip(self.roi, volume.shape[2:], strict=True)]
        padded = [int(s) + n for s, n in zip(volume.shape[2:], short, strict=True)]
        # The padded input, the blended output (its channels where known) and the blending weights.
        channels = volume.shape[1] + sum(extra.shape[1] for extra in volumes.values()) + (self.output_channels or 0) + 1
        check_volume_size("the sliding window", (volume.shape[0], channels, *padded),
                          "the volume padded to its windows, with the output and its weights, is", before="running it")
        if self.pad_value is not None and any(short):
            return self._padded(short, network, volume, volumes, per_sample)
        if tuple(volume.shape[2:]) == self.roi:
            whole = {name: extra.to(self.device, volume.dtype) for name, extra in volumes.items()}
            rows = {name: values.to(self.device) for name, values in per_sample.items()}
            return network(volume.to(self.device), **whole, **rows).to(self.output_device)
        # The extra volumes ride along as channels, so MONAI pads and cuts them exactly as the volume.
        channels = [volume.shape[1], *(extra.shape[1] for extra in volumes.values())]
        stacked = torch.cat([volume, *(extra.to(volume) for extra in volumes.values())], dim=1)

        def window_call(window: torch.Tensor, coordinates: Sequence[Sequence[slice]]) -> torch.Tensor:
            own, *extras = window.split(channels, dim=1)
            samples = torch.tensor([coordinate[0].start for coordinate in coordinates])
            rows = {name: values[samples.to(values.device)].to(self.device) for name, values in per_sample.items()}
            return network(own, **dict(zip(volumes, extras, strict=True)), **rows)

        output = sliding_window_inference(
            stacked.to(self.output_device), list(self.roi), self.batch_size, window_call, overlap=self.overlap,
            mode=self.mode, sw_device=self.device, device=self.output_device, with_coord=True,
        )
        assert isinstance(output, torch.Tensor)
        return output

    def _padded(
        self, short: Sequence[int], network: Callable[..., torch.Tensor], volume: torch.Tensor,
        volumes: Mapping[str, torch.Tensor], per_sample: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """The volume padded up to the window with `pad_value` per channel, run, and cropped back."""
        before = [s // 2 for s in short]
        flat = [p for b, s in zip(reversed(before), reversed(short), strict=True) for p in (b, s - b)]
        values = (
            self.pad_value
            if len(self.pad_value or ()) == volume.shape[1]
            else (self.pad_value or (0.0,))[:1] * volume.shape[1]
        )
        padded = torch.stack([F.pad(volume[:, c], flat, value=float(v)) for c, v in enumerate(values)], dim=1)
        extras = {name: F.pad(extra, flat, value=0.0) for name, extra in volumes.items()}
        output = self(network, padded, extras, per_sample)
        crop = [slice(b, b + int(n)) for b, n in zip(before, volume.shape[2:], strict=True)]
        return output[(slice(None), slice(None), *crop)]
