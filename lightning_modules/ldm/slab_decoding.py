"""The VQ-GAN decoder run on a whole volume one slab of depth at a time: exactly the whole-volume output, no seams.

Windows decoded apart and blended differ from the whole: the decoder's GroupNorms normalise each
window by its own statistics, and its convolutions pad at each window's edge (a phantom's latent
through an untrained first stage, decoded by 8^3 Gaussian-blended windows of its 12^3 latent, was
off by 0.07 on average where the output's std was 0.3). Here the decoder runs layer by layer over the whole volume, as
MAISI's split convolutions do: each convolution sees one slab along the depth axis plus the rows its
kernel reaches beyond it (so it pads only at the volume's true edges), and each GroupNorm takes
its statistics over the whole volume (summed slab by slab) before it normalises slab by slab.

Only a slab and its halo are computed at a time, on `device`; each layer's whole activation is kept where its input
is: on the device, or (offloaded) in pinned host memory, laid out depth-major so that a slab is one contiguous block,
each copied with one non-blocking transfer. Residual sums are taken slab by slab on the device, into the block's
output. `decoding_bytes` predicts what the whole activations need on the device, to decide whether to offload.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_modules.vqgan.vq_autoencoder import Decoder3d, ResBlock3d

ELEMENTWISE = (nn.SiLU, nn.Dropout, nn.Identity)
# A report of progress: (what is decoded, its slabs).
Report = Callable[[str, int], None]


def slab_rows(x: torch.Tensor, elements: int) -> int:
    """Depth rows of `x` per slab so a slab holds at most `elements` values (at least one row)."""
    per_row = x.shape[0] * x.shape[1] * x.shape[3] * x.shape[4]
    return max(1, int(elements) // max(per_row, 1))


def whole_like(x: torch.Tensor, channels: int, length: int, width: Sequence[int] | None = None) -> torch.Tensor:
    """An empty whole activation of `channels` x `length` depth rows (x's batch, x's height and width unless `width`
    says) laid out as `x` is: depth-major and pinned like an offloaded `x`, else as PyTorch lays it out."""
    n, _, _, h, w = x.shape
    h, w = (h, w) if width is None else width
    if depth_major(x):
        whole = torch.empty((length, n, channels, h, w), dtype=x.dtype, device=x.device, pin_memory=x.is_pinned())
        return whole.permute(1, 2, 0, 3, 4)
    return x.new_empty((n, channels, length, h, w))


def depth_major(x: torch.Tensor) -> bool:
    """Whether (N, C, D, H, W) `x` is stored depth slab after depth slab (as offloaded activations are)."""
    return x.shape[2] > 1 and x.stride(2) >= max(x.stride(0), x.stride(1))


def to_storage(z: torch.Tensor, offload: bool) -> torch.Tensor:
    """The latent where the whole activations will live: itself, or with `offload` a host copy, depth-major (a
    depth slab one contiguous block, copied in one transfer) and pinned where CUDA is (nothing pins without it)."""
    if not offload:
        return z
    n, c, d, h, w = z.shape
    host = torch.empty((d, n, c, h, w), dtype=z.dtype, pin_memory=torch.cuda.is_available()).permute(1, 2, 0, 3, 4)
    host.copy_(z)
    return host


def _slab(x: torch.Tensor, start: int, stop: int, device: torch.device) -> torch.Tensor:
    return x[:, :, start:stop].to(device, non_blocking=True)


def _store(out: torch.Tensor, start: int, stop: int, slab: torch.Tensor) -> None:
    out[:, :, start:stop].copy_(slab, non_blocking=True)


def _each_slab(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int, device: torch.device
) -> torch.Tensor:
    out = whole_like(x, x.shape[1], x.shape[2])
    for start in range(0, x.shape[2], rows):
        _store(out, start, start + rows, fn(_slab(x, start, start + rows, device)))
    return out


def _add_in_slabs(y: torch.Tensor, x: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """y + x, summed slab by slab on the device into `y` (a residual block's output, which nothing else holds)."""
    for start in range(0, y.shape[2], rows):
        _store(y, start, start + rows, _slab(y, start, start + rows, device) + _slab(x, start, start + rows, device))
    return y


def _group_norm(norm: nn.GroupNorm, x: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """GroupNorm with statistics over the whole volume, applied slab by slab (float64 sums)."""
    batch, groups = x.shape[0], norm.num_groups
    sums = torch.zeros(2, batch, groups, dtype=torch.float64, device=device)
    for start in range(0, x.shape[2], rows):
        slab = _slab(x, start, start + rows, device).double()
        grouped = slab.reshape(batch, groups, slab.shape[1] // groups, -1)
        sums += torch.stack([grouped.sum((2, 3)), grouped.square().sum((2, 3))])
    count = x[0, : x.shape[1] // groups].numel()
    mean = sums[0] / count
    inv_std = ((sums[1] / count - mean.square()).clamp_min(0) + norm.eps).rsqrt()
    # (x - mean) * inv_std * weight + bias as one scale and shift a channel, computed in float64 and applied in the
    # activation's precision: two slab-sized temporaries, none in float64.
    per_channel = x.shape[1] // groups
    scale = (inv_std.repeat_interleave(per_channel, dim=1) * norm.weight.double())
    shift = norm.bias.double() - mean.repeat_interleave(per_channel, dim=1) * scale
    scale, shift = (v.to(x.dtype)[:, :, None, None, None] for v in (scale, shift))
    return _each_slab(lambda slab: slab * scale + shift, x, rows, device)


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


def _output_length(conv: nn.Conv3d | nn.ConvTranspose3d, length: int) -> int:
    if isinstance(conv, nn.ConvTranspose3d):
        return (length - 1) * conv.stride[0] - 2 * conv.padding[0] + conv.kernel_size[0] + conv.output_padding[0]
    return length


def _convolution(
    conv: nn.Conv3d | nn.ConvTranspose3d, x: torch.Tensor, rows: int, device: torch.device
) -> torch.Tensor:
    """`conv` over the whole volume, slab by slab with the halo its kernel reaches: the whole-volume output."""
    if isinstance(conv, nn.Conv3d) and conv.stride[0] != 1:
        raise ValueError(f"slab decoding runs stride-1 convolutions along the depth axis, got {conv}")
    length = x.shape[2]
    out_length = _output_length(conv, length)
    out_rows = max(1, rows * (out_length // length))
    out: torch.Tensor | None = None
    for start in range(0, out_length, out_rows):
        stop = min(start + out_rows, out_length)
        lo, hi = _input_rows(conv, start, stop, length)
        offset = start - _output_offset(conv, lo)
        slab = conv(_slab(x, lo, hi, device))[:, :, offset : offset + stop - start]
        if out is None:
            out = whole_like(x, slab.shape[1], out_length, slab.shape[3:])
        _store(out, start, stop, slab)
        del slab  # before the next slab's convolution, not after it
    assert out is not None
    return out


def run_in_slabs(
    module: nn.Module, x: torch.Tensor, elements: int, device: torch.device, report: Report | None = None
) -> torch.Tensor:
    """`module(x)` computed layer by layer in depth slabs of at most `elements` values on `device`, each layer's
    whole activation kept where `x` is; `report(part, slabs)` hears of each of a decoder's parts as it starts."""
    if isinstance(module, Decoder3d):
        parts = [("conv_in", module.conv_in), *(("upsampling", layer) for layer in module.up), ("out", module.out)]
        for name, part in parts:
            # Each part that starts a resolution: the input convolution, each upsampling, the output convolution.
            if report is not None and (name != "upsampling" or isinstance(part, nn.ConvTranspose3d)):
                report(f"{name} from {'x'.join(map(str, x.shape[2:]))}", -(-x.shape[2] // slab_rows(x, elements)))
            x = run_in_slabs(part, x, elements, device)
        return x
    if isinstance(module, nn.Sequential):
        for child in module:
            x = run_in_slabs(child, x, elements, device)
        return x
    rows = slab_rows(x, elements)
    if isinstance(module, ResBlock3d):
        return _add_in_slabs(run_in_slabs(module.block, x, elements, device), x, rows, device)
    if isinstance(module, nn.GroupNorm):
        return _group_norm(module, x, rows, device)
    if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
        return _convolution(module, x, rows, device)
    if isinstance(module, ELEMENTWISE):
        return _each_slab(module, x, rows, device)
    raise TypeError(f"slab decoding does not know how to run {type(module).__name__}")


def decoding_bytes(module: nn.Module, shape: Sequence[int], elements: int, element_size: int = 4) -> int:
    """The most bytes `run_in_slabs(module, x, elements, ...)` holds at once when every whole activation is on the
    device, for `x` of `shape` (N, C, D, H, W) in values of `element_size` bytes: the whole activations alive
    together (a layer's input and output, and a residual block's input beside its block) and the slab working set
    (GroupNorm's float64 sums, a convolution's input slab with its halo and its output slab), and the small tensors
    beside them."""
    peak, _ = _bytes(module, list(shape), 0, elements, element_size)
    return peak + SMALL_TENSORS


# What a decoding's small tensors (GroupNorm's sums, scales and shifts) may hold beside its activations.
SMALL_TENSORS = 2**16
# The share of the device's free memory a decoding may plan to fill (the rest: the allocator's rounding and
# fragmentation, and what the caller still holds).
FREE_SHARE = 0.9


def fits_on_device(decoder: nn.Module, shape: Sequence[int], elements: int, free_bytes: int) -> bool:
    """Whether decoding a latent of `shape` in slabs of `elements` values, every whole activation (float32) kept on
    the device, fits in `free_bytes` with room to spare."""
    return decoding_bytes(decoder, shape, elements) <= FREE_SHARE * free_bytes


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def _bytes(module: nn.Module, shape: list[int], held: int, elements: int, size: int) -> tuple[int, list[int]]:
    """(peak bytes while `module` runs on an input of `shape`, its output's shape); `held`: the bytes others keep
    alive besides the input."""
    inp = _numel(shape) * size
    if isinstance(module, Decoder3d):
        module = nn.Sequential(module.conv_in, module.up, module.out)
    if isinstance(module, nn.Sequential):
        # The sequence's input stays alive (its caller holds it) while the later layers run.
        peak, first = held + inp, True
        for child in module:
            child_peak, shape = _bytes(child, shape, held + (0 if first else inp), elements, size)
            peak, first = max(peak, child_peak), False
        return peak, shape
    row = _numel(shape) // shape[2]
    slab = max(1, elements // max(row, 1)) * row
    if isinstance(module, ResBlock3d):
        # The block's input stays alive beside the block (as a sequence's input does); the sum is taken slab by slab
        # into the block's output.
        peak, out_shape = _bytes(module.block, shape, held, elements, size)
        return max(peak, held + 2 * inp + 3 * slab * size), out_shape
    out_shape = _convolved(module, shape) if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)) else list(shape)
    out = _numel(out_shape) * size
    slab_out = slab * _numel(out_shape) // _numel(shape)
    if isinstance(module, nn.GroupNorm):
        # Float64 sums: the slab and its square; then the scale and the shift in the activation's precision.
        working = max(2 * 8 * slab, 2 * size * slab)
    elif isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
        # The input slab with the rows the kernel reaches (moved to the device, and padded in height and width where
        # the convolution pads by copying), and the output computed over those rows.
        reach = 1 + (module.kernel_size[0] - 1) / max(slab // row, 1)
        padded = math.prod(s + 2 * p for s, p in zip(shape[3:], module.padding[1:], strict=True)) / math.prod(shape[3:])
        working = int(size * reach * (slab * (1 + padded) + slab_out))
    else:
        working = 2 * slab_out * size
    return held + inp + out + working, out_shape


def _convolved(conv: nn.Conv3d | nn.ConvTranspose3d, shape: Sequence[int]) -> list[int]:
    """The output shape of `conv` on an input of `shape` (N, C, D, H, W)."""
    sizes = []
    for s, stride, padding, kernel, extra in zip(shape[2:], conv.stride, conv.padding, conv.kernel_size,
                                                  getattr(conv, "output_padding", (0, 0, 0)), strict=True):
        if isinstance(conv, nn.ConvTranspose3d):
            sizes.append((s - 1) * stride - 2 * padding + kernel + extra)
        else:
            sizes.append((s + 2 * padding - kernel) // stride + 1)
    return [int(shape[0]), conv.out_channels, *sizes]
