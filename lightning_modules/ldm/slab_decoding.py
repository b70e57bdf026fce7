"""The VQ-GAN decoder run on a whole volume one slab of depth at a time: exactly the whole-volume output, no seams.

Windows decoded apart and blended differ from the whole: the decoder's GroupNorms normalise each
window by its own statistics, and its convolutions pad at each window's edge (a phantom's latent
through an untrained first stage, decoded by 8^3 Gaussian-blended windows of its 12^3 latent, was
off by 0.07 on average where the output's std was 0.3). Here the decoder runs layer by layer over the whole volume, as
MAISI's split convolutions do: each convolution sees one slab along the depth axis plus the rows its
kernel reaches beyond it (so it pads only at the volume's true edges), and each GroupNorm takes
its statistics over the whole volume (summed slab by slab) before it normalises slab by slab.
Only a slab and its halo are on `device`; the whole activations stay on the output's device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from lightning_modules.vqgan.vq_autoencoder import Decoder3d, ResBlock3d

ELEMENTWISE = (nn.SiLU, nn.Dropout, nn.Identity)


def slab_rows(x: torch.Tensor, elements: int) -> int:
    """Depth rows of `x` per slab so a slab holds at most `elements` values (at least one row)."""
    per_row = x.shape[0] * x.shape[1] * x.shape[3] * x.shape[4]
    return max(1, int(elements) // max(per_row, 1))


def _each_slab(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int, device: torch.device
) -> torch.Tensor:
    out = torch.empty_like(x)
    for start in range(0, x.shape[2], rows):
        out[:, :, start : start + rows] = fn(x[:, :, start : start + rows].to(device)).to(out.device)
    return out


def _group_norm(norm: nn.GroupNorm, x: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """GroupNorm with statistics over the whole volume, applied slab by slab (float64 sums)."""
    batch, groups = x.shape[0], norm.num_groups
    sums = torch.zeros(2, batch, groups, dtype=torch.float64, device=device)
    for start in range(0, x.shape[2], rows):
        slab = x[:, :, start : start + rows].to(device).double()
        grouped = slab.reshape(batch, groups, slab.shape[1] // groups, -1)
        sums += torch.stack([grouped.sum((2, 3)), grouped.square().sum((2, 3))])
    count = x[0, : x.shape[1] // groups].numel()
    mean = sums[0] / count
    inv_std = ((sums[1] / count - mean.square()).clamp_min(0) + norm.eps).rsqrt()

    def normalise(slab: torch.Tensor) -> torch.Tensor:
        grouped = slab.reshape(batch, groups, -1, *slab.shape[2:]).double()
        scaled = (grouped - mean[:, :, None, None, None, None]) * inv_std[:, :, None, None, None, None]
        scaled = scaled.reshape(slab.shape).to(slab.dtype)
        return scaled * norm.weight[None, :, None, None, None] + norm.bias[None, :, None, None, None]

    return _each_slab(normalise, x, rows, device)


def _input_rows(conv: nn.Conv3d | nn.ConvTranspose3d, start: int, stop: int, length: int) -> tuple[int, int]:
    """The input depth rows [lo, hi) that output rows [start, stop) of `conv` read (clipped to the volume)."""
    kernel, stride, padding = conv.kernel_size[0], conv.stride[0], conv.padding[0]
    if isinstance(conv, nn.ConvTranspose3d):
        lo = math.ceil((start + padding - kernel + 1) / stride)
        hi = (stop - 1 + padding) // stride + 1
    else:
        lo, hi = start - padding, stop - 1 - padding + kernel
    return max(lo, 0), min(hi, length)


def _output_offset(conv: nn.Conv3d | nn.ConvTranspose3d, lo: int) -> int:
    """The full-volume depth index of row 0 of `conv` run on the input rows from `lo` (with its own padding)."""
    if isinstance(conv, nn.ConvTranspose3d):
        return lo * conv.stride[0]
    return lo


def _convolution(
    conv: nn.Conv3d | nn.ConvTranspose3d, x: torch.Tensor, rows: int, device: torch.device
) -> torch.Tensor:
    """`conv` over the whole volume, slab by slab with the halo its kernel reaches: the whole-volume output."""
    if isinstance(conv, nn.Conv3d) and conv.stride[0] != 1:
        raise ValueError(f"slab decoding runs stride-1 convolutions along the depth axis, got {conv}")
    length = x.shape[2]
    if isinstance(conv, nn.ConvTranspose3d):
        out_length = (length - 1) * conv.stride[0] - 2 * conv.padding[0] + conv.kernel_size[0] + conv.output_padding[0]
    else:
        out_length = length
    out_rows = max(1, rows * (out_length // length))
    out: torch.Tensor | None = None
    for start in range(0, out_length, out_rows):
        stop = min(start + out_rows, out_length)
        lo, hi = _input_rows(conv, start, stop, length)
        offset = start - _output_offset(conv, lo)
        slab = conv(x[:, :, lo:hi].to(device))[:, :, offset : offset + stop - start]
        if out is None:
            out = x.new_empty((x.shape[0], slab.shape[1], out_length, *slab.shape[3:]))
        out[:, :, start:stop] = slab.to(out.device)
    assert out is not None
    return out


def run_in_slabs(module: nn.Module, x: torch.Tensor, elements: int, device: torch.device) -> torch.Tensor:
    """`module(x)` computed layer by layer in depth slabs of at most `elements` values on `device`."""
    if isinstance(module, Decoder3d):
        for part in (module.conv_in, module.up, module.out):
            x = run_in_slabs(part, x, elements, device)
        return x
    if isinstance(module, nn.Sequential):
        for child in module:
            x = run_in_slabs(child, x, elements, device)
        return x
    if isinstance(module, ResBlock3d):
        return x + run_in_slabs(module.block, x, elements, device)
    rows = slab_rows(x, elements)
    if isinstance(module, nn.GroupNorm):
        return _group_norm(module, x, rows, device)
    if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
        return _convolution(module, x, rows, device)
    if isinstance(module, ELEMENTWISE):
        return _each_slab(module, x, rows, device)
    raise TypeError(f"slab decoding does not know how to run {type(module).__name__}")
