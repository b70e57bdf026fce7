"""`ViewEncoder`: one CNN shared by every radiograph, a token per cell of its strided grid with its own position
embedding, view blocks in view order, and a learned view embedding that tells identical views apart."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_modules.xray2ct.view_encoder import ViewEncoder


def _encoder(image_size: tuple[int, int] = (16, 12), views: int = 2) -> ViewEncoder:
    torch.manual_seed(0)
    return ViewEncoder(num_views=views, image_size=image_size, dim=8, channels=(4, 8)).eval()


@pytest.mark.parametrize(("image_size", "grid"), [((16, 12), (4, 3)), ((15, 13), (4, 4)), ((8, 5), (2, 2))])
def test_each_view_gives_one_token_per_cell_of_its_twice_halved_grid(image_size, grid):
    # A 3x3 convolution with stride 2 and padding 1 maps n pixels to floor((n + 2 - 3) / 2) + 1 = ceil(n / 2).
    assert grid == tuple(math.ceil(math.ceil(n / 2) / 2) for n in image_size)
    encoder = _encoder(image_size, views=3)
    tokens = encoder(torch.randn(2, 3, *image_size))
    assert encoder.tokens_per_view == grid[0] * grid[1]
    assert tokens.shape == (2, 3 * grid[0] * grid[1], 8)


def test_a_change_to_one_view_changes_only_that_views_block_of_tokens():
    encoder, views = _encoder(), torch.randn(1, 2, 16, 12)
    changed = views.clone()
    changed[0, 1] += torch.randn(16, 12)
    n = encoder.tokens_per_view
    with torch.no_grad():
        before, after = encoder(views), encoder(changed)
    torch.testing.assert_close(after[:, :n], before[:, :n], rtol=0, atol=0)
    assert not torch.allclose(after[:, n:], before[:, n:])


def test_a_position_embedding_moves_its_own_token_in_every_view_and_no_other():
    encoder, views = _encoder(), torch.randn(2, 2, 16, 12)
    n, k = encoder.tokens_per_view, 5
    with torch.no_grad():
        before = encoder(views)
        encoder.position[0, 0, k] += 1.0
        moved = (encoder(views) - before).abs().amax(dim=(0, 2)) > 0
    assert moved.nonzero().flatten().tolist() == [k, n + k]


def test_the_same_cnn_encodes_every_view_and_only_the_view_embedding_tells_them_apart():
    encoder = _encoder()
    n, same = encoder.tokens_per_view, torch.randn(1, 1, 16, 12).expand(1, 2, 16, 12)
    with torch.no_grad():
        apart = encoder(same)
        encoder.view_embedding.copy_(encoder.view_embedding[:, :1].expand_as(encoder.view_embedding))
        alike = encoder(same)
    torch.testing.assert_close(alike[:, :n], alike[:, n:], rtol=0, atol=0)
    assert (apart[:, :n] - apart[:, n:]).abs().amax() > 1e-3


def test_tokens_are_layer_normalised_over_their_width():
    with torch.no_grad():
        tokens = _encoder()(torch.randn(2, 2, 16, 12))
    torch.testing.assert_close(tokens.mean(dim=-1), torch.zeros(tokens.shape[:2]), atol=1e-5, rtol=0)
    torch.testing.assert_close(tokens.var(dim=-1, unbiased=False), torch.ones(tokens.shape[:2]), atol=1e-3, rtol=0)


def test_another_number_of_views_than_built_for_is_refused():
    with pytest.raises(ValueError, match="`xray` has 3 views, the encoder was built for 2"):
        _encoder()(torch.randn(1, 3, 16, 12))
