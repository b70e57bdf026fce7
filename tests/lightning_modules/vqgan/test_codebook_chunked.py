"""The chunked codebook (nearest codes in chunks, EMA statistics by scatter-add) equals the full computation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_modules.vqgan.codebook import EMACodebook


def full_forward(codebook: EMACodebook, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre-chunking computation: one (N x n_codes) distance matrix and a one-hot for the EMA sums.

    Returns the quantised volume, the code indices and the perplexity; updates the EMA state
    (without restarts) when the codebook is training.
    """
    flat = z.movedim(1, -1).reshape(-1, codebook.embedding_dim)
    distances = (
        flat.pow(2).sum(1, keepdim=True) - 2 * flat @ codebook.embeddings.t() + codebook.embeddings.pow(2).sum(1)[None]
    )
    indices = distances.argmin(1)
    onehot = F.one_hot(indices, codebook.n_codes).type_as(flat)
    quantized = F.embedding(indices, codebook.embeddings).view_as(z.movedim(1, -1)).movedim(-1, 1)
    if codebook.training:
        decay = codebook.decay
        codebook.cluster_size.mul_(decay).add_(onehot.sum(0), alpha=1 - decay)
        codebook.embedding_sum.mul_(decay).add_(onehot.t() @ flat, alpha=1 - decay)
        total = codebook.cluster_size.sum()
        smoothed = (codebook.cluster_size + codebook.eps) / (total + codebook.n_codes * codebook.eps) * total
        codebook.embeddings.copy_(codebook.embedding_sum / smoothed[:, None])
    usage = onehot.mean(0)
    return quantized, indices, torch.exp(-(usage * torch.log(usage + 1e-10)).sum())


def test_chunked_codebook_equals_the_full_distance_matrix_and_one_hot_over_training_steps():
    torch.manual_seed(0)
    # 7 latents per chunk: 210 latents give 30 chunks, with codes that several chunks share.
    chunked = EMACodebook(n_codes=64, embedding_dim=8, decay=0.9, random_restart=False, chunk_elements=64 * 7)
    chunked.train()(torch.randn(2, 8, 5, 3, 7))
    full = EMACodebook(n_codes=64, embedding_dim=8, decay=0.9, random_restart=False)
    full.load_state_dict(chunked.state_dict())
    full.train()
    for step in range(4):
        z = torch.randn(2, 8, 5, 3, 7) * (1 + step)
        out = chunked(z)
        with torch.no_grad():
            quantized, indices, perplexity = full_forward(full, z)
        assert torch.equal(out.encodings.flatten(), indices)
        assert torch.equal(out.embeddings, z + (quantized - z))  # the straight-through output
        assert torch.allclose(out.perplexity, perplexity, rtol=1e-6)
        assert torch.equal(chunked.cluster_size, full.cluster_size)
        assert torch.allclose(chunked.embedding_sum, full.embedding_sum, rtol=1e-6, atol=1e-6)
        assert torch.allclose(chunked.embeddings, full.embeddings, rtol=1e-6, atol=1e-6)
    # Enough codes in use that a wrong chunk boundary or scatter index would change the result.
    assert int((indices.bincount(minlength=64) > 0).sum()) > 20

    chunked.eval()
    full.eval()
    z = torch.randn(1, 8, 4, 4, 4)
    assert torch.equal(chunked(z).encodings.flatten(), full_forward(full, z)[1])


def test_codebook_initialisation_follows_a_loaded_state_after_the_cached_flag_is_set():
    torch.manual_seed(0)
    codebook = EMACodebook(n_codes=8, embedding_dim=2).train()
    codebook(torch.randn(1, 2, 4, 4, 4))
    fresh = EMACodebook(n_codes=8, embedding_dim=2).state_dict()
    codebook.load_state_dict(fresh)
    # The loaded state is uninitialised, so the next training step initialises from the data again.
    codebook(torch.randn(1, 2, 4, 4, 4) + 50)
    assert bool(codebook.initialized) and codebook.embeddings.mean().item() > 40
