"""The VQ-GAN's 3D encoder and decoder: per-axis halvings, widths, residual blocks and replicate padding."""

from __future__ import annotations

import pytest
import torch

from lightning_modules.vqgan.vq_autoencoder import Decoder3d, Encoder3d, ResBlock3d
from medvol.core.errors import MedvolError


@pytest.mark.parametrize(("downsample", "latent", "width"), [
    ((4, 4, 4), (4, 4, 4), 32),
    # Anisotropic: depth halved twice, height once, width kept; the widest axis sets the levels.
    ((4, 2, 1), (4, 8, 16), 32),
    ((8, 8, 2), (2, 2, 8), 64),
])
def test_the_encoder_divides_each_axis_by_its_factor_and_the_decoder_restores_it(downsample, latent, width):
    encoder = Encoder3d(in_channels=2, n_hiddens=8, downsample=downsample, embedding_dim=5)
    decoder = Decoder3d(out_channels=2, n_hiddens=8, downsample=downsample, embedding_dim=5)
    volume = torch.randn(1, 2, 16, 16, 16)
    with torch.no_grad():
        z = encoder(volume)
        assert z.shape == (1, 5, *latent)
        assert decoder(z).shape == volume.shape
    # 8 channels doubled at every level (log2 of the largest factor).
    assert encoder.out_channels == width
    assert decoder.conv_in.out_channels == width


@pytest.mark.parametrize("downsample", [
    (3, 4, 4), (4, 4, 6),
    # Zero and negative factors: refused before log2 is taken (no 'math domain error').
    (4, 0, 4), (-2, 4, 4),
])
def test_factors_that_are_not_powers_of_two_are_refused(downsample):
    try:
        Encoder3d(1, 8, downsample, 4)
    except MedvolError as err:
        assert str(err).startswith("`downsample` factors must be powers of two, got ["), str(err)
    else:
        pytest.fail(f"{downsample} was accepted")


def test_a_residual_block_whose_last_convolution_is_zero_is_the_identity():
    block = ResBlock3d(6)
    with torch.no_grad():
        block.block[-1].weight.zero_()
        block.block[-1].bias.zero_()
    x = torch.randn(2, 6, 4, 4, 4)
    assert torch.equal(block(x), x)
    # Six channels: GroupNorm takes gcd(6, 32) = 2 groups.
    assert block.block[0].num_groups == 2


def test_a_constant_volume_stays_constant_through_the_first_convolution():
    # Replicate padding sees the volume continue at its border; zero padding would darken the edges.
    encoder = Encoder3d(1, 8, (2, 2, 2), 4)
    with torch.no_grad():
        out = encoder.conv_in(torch.full((1, 1, 6, 6, 6), 3.0))
    per_channel = out.flatten(2)
    torch.testing.assert_close(per_channel, per_channel[:, :, :1].expand_as(per_channel))
