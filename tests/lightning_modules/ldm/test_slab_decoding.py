"""Slab decoding on its own: each layer it runs slab by slab gives PyTorch's whole-volume output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_modules.ldm.slab_decoding import run_in_slabs, slab_rows
from lightning_modules.vqgan.vq_autoencoder import Decoder3d

CPU = torch.device("cpu")


def test_a_slab_holds_at_most_the_values_asked_and_at_least_one_row():
    x = torch.zeros(1, 2, 10, 3, 4)  # 24 values per depth row
    assert slab_rows(x, 100) == 4 and slab_rows(x, 24) == 1 and slab_rows(x, 10) == 1


@pytest.mark.parametrize(
    "layer",
    [
        nn.GroupNorm(2, 4),
        nn.Conv3d(4, 3, kernel_size=3, padding=1),
        nn.ConvTranspose3d(4, 3, kernel_size=4, stride=2, padding=1),
        nn.Sequential(nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv3d(4, 4, kernel_size=3, padding=1)),
    ],
    ids=["group-norm", "conv", "transposed-conv", "sequential"],
)
def test_each_layer_in_one_row_slabs_equals_the_layer_on_the_whole_volume(layer):
    torch.manual_seed(0)
    # Statistics off zero so a per-slab GroupNorm would differ from the whole-volume one.
    x = torch.randn(2, 4, 7, 5, 6) + torch.linspace(-2, 2, 7).view(1, 1, 7, 1, 1)
    with torch.no_grad():
        expected = layer(x)
        for elements in (1, 2 * 4 * 5 * 6 * 3, 10**9):
            torch.testing.assert_close(run_in_slabs(layer, x, elements, CPU), expected, rtol=0, atol=1e-5)


def test_a_vqgan_decoder_in_slabs_equals_its_whole_volume_output():
    torch.manual_seed(1)
    decoder = Decoder3d(out_channels=1, n_hiddens=8, downsample=(4, 4, 2), embedding_dim=4).eval()
    z = torch.randn(1, 4, 4, 4, 6)
    with torch.no_grad():
        torch.testing.assert_close(run_in_slabs(decoder, z, 256, CPU), decoder(z), rtol=0, atol=1e-5)


def test_a_strided_convolution_along_depth_and_an_unknown_layer_are_refused():
    x = torch.zeros(1, 1, 4, 4, 4)
    with pytest.raises(ValueError, match="stride-1"):
        run_in_slabs(nn.Conv3d(1, 1, 3, stride=2, padding=1), x, 16, CPU)
    with pytest.raises(TypeError, match="BatchNorm3d"):
        run_in_slabs(nn.BatchNorm3d(1), x, 16, CPU)
