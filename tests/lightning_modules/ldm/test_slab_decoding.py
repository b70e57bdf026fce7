"""Slab decoding: the VQ-GAN decoder run layer by layer in depth slabs gives PyTorch's whole-volume output, for each
layer kind alone and for whole decoders, whatever the slab depth (remainders included)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_modules.ldm.slab_decoding import run_in_slabs, slab_rows
from lightning_modules.vqgan.vq_autoencoder import Decoder3d

CPU = torch.device("cpu")


def _same_as_whole(module: nn.Module, x: torch.Tensor, elements: int) -> None:
    with torch.no_grad():
        torch.testing.assert_close(run_in_slabs(module, x, elements, CPU), module(x), rtol=1e-5, atol=1e-5)


def test_a_slab_holds_as_many_depth_rows_as_fit_in_the_budget_and_at_least_one():
    x = torch.zeros(2, 3, 7, 4, 5)  # one depth row holds 2 * 3 * 4 * 5 = 120 values
    assert [slab_rows(x, elements) for elements in (1, 119, 120, 500, 10_000)] == [1, 1, 1, 4, 83]


def test_group_norm_takes_its_statistics_over_the_whole_volume_not_the_slab():
    torch.manual_seed(0)
    norm = nn.GroupNorm(2, 4, eps=1e-6)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    # Rows with different means and scales, so per-slab statistics would differ from the whole volume's.
    x = torch.randn(2, 4, 6, 3, 3) * torch.arange(1.0, 7.0).view(1, 1, 6, 1, 1) + torch.arange(6.0).view(1, 1, 6, 1, 1)
    for rows in (1, 4):
        _same_as_whole(norm, x, elements=rows * 2 * 4 * 3 * 3)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_convolutions_see_the_rows_their_kernel_reaches_beyond_each_slab(rows):
    torch.manual_seed(0)
    x = torch.randn(1, 3, 7, 4, 4)
    elements = rows * 3 * 4 * 4
    _same_as_whole(nn.Conv3d(3, 2, 3, padding=1), x, elements)
    _same_as_whole(nn.Conv3d(3, 2, 3, padding=1, padding_mode="replicate"), x, elements)
    _same_as_whole(nn.Conv3d(3, 2, 1), x, elements)
    _same_as_whole(nn.ConvTranspose3d(3, 2, 4, stride=2, padding=1), x, elements)
    _same_as_whole(nn.ConvTranspose3d(3, 2, (3, 4, 4), stride=(1, 2, 2), padding=1), x, elements)


@pytest.mark.parametrize("downsample", [[4, 4, 4], [2, 4, 4]])
def test_a_whole_decoder_in_slabs_is_the_decoder(downsample):
    torch.manual_seed(0)
    decoder = Decoder3d(out_channels=1, n_hiddens=8, downsample=downsample, embedding_dim=4).eval()
    latent = torch.randn(2, 4, 5, 3, 4)
    for elements in (1, 2 * 32 * 3 * 4 * 2, 10**9):  # one row, two rows with a remainder, the whole volume at once
        _same_as_whole(decoder, latent, elements)


def test_a_depth_strided_convolution_or_an_unknown_layer_is_refused():
    with pytest.raises(ValueError, match="stride-1 convolutions along the depth axis"):
        run_in_slabs(nn.Conv3d(1, 1, 3, stride=2, padding=1), torch.zeros(1, 1, 4, 4, 4), 16, CPU)
    with pytest.raises(TypeError, match="does not know how to run Linear"):
        run_in_slabs(nn.Linear(4, 4), torch.zeros(1, 1, 4, 4, 4), 16, CPU)


def test_an_offloaded_decoding_keeps_depth_major_host_activations_and_equals_the_whole_decoder():
    from lightning_modules.ldm.first_stage import FirstStage
    from lightning_modules.ldm.slab_decoding import depth_major, to_storage

    torch.manual_seed(0)
    first = FirstStage(in_channels=1, embedding_dim=4, n_codes=16, n_hiddens=8, downsample=[4, 4, 4])
    z = torch.randn(1, 4, 5, 3, 4)
    stored = to_storage(z, offload=True)
    # Each depth slab of the host copy is one contiguous block (one transfer a slab), the values the latent's.
    assert depth_major(stored) and stored[:, :, 1:3].permute(2, 0, 1, 3, 4).is_contiguous() and torch.equal(stored, z)
    assert stored.untyped_storage().nbytes() == z.numel() * 4
    with torch.no_grad():
        whole = first.decoder(z)
    kept = []
    original = first.decoder.up[2].forward
    first.decoder.up[2].forward = lambda x: kept.append(x) or original(x)  # a layer's slab inputs
    with torch.no_grad():
        offloaded = first.decode(z, quantized=False, slab_elements=2 * 32 * 3 * 4, offload=True)
    torch.testing.assert_close(offloaded, whole, rtol=1e-5, atol=1e-5)
    # The slabs the layer saw were cut from depth-major whole activations: each one block of memory (one transfer).
    assert kept and all(slab.permute(2, 0, 1, 3, 4).is_contiguous() for slab in kept)
    assert any(slab.shape[2] > 1 and not slab.is_contiguous() for slab in kept)


def test_the_decoders_device_need_bounds_what_slab_decoding_holds_and_decides_the_offload():
    from lightning_modules.ldm.slab_decoding import FREE_SHARE, decoding_bytes, fits_on_device
    from medvol.core.cuda_emulation import DeviceMemory

    torch.manual_seed(0)
    decoder = Decoder3d(out_channels=1, n_hiddens=8, downsample=[4, 4, 4], embedding_dim=4).eval()
    latent = torch.randn(1, 4, 8, 6, 6)
    elements = 16 * 24 * 24 * 4  # four rows of the full-resolution activations a slab
    memory = DeviceMemory()
    memory.track(latent)
    with torch.no_grad(), memory:
        run_in_slabs(decoder, latent, elements, CPU)
    need = decoding_bytes(decoder, latent.shape, elements)
    # Never less than what the decoding holds at once, and not far above it.
    assert memory.peak <= need <= 1.5 * memory.peak
    # The whole activations at full resolution: a residual block's input, a GroupNorm's output and its SiLU's.
    full = 8 * 32 * 24 * 24 * 4
    assert need >= 3 * full
    assert fits_on_device(decoder, latent.shape, elements, int(need / FREE_SHARE) + 1)
    assert not fits_on_device(decoder, latent.shape, elements, need)
