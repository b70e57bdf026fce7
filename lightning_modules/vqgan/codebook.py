"""Vector-quantisation codebook with EMA updates and dead-code restarts (VQ-VAE-2 / medicaldiffusion style)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Quantized(NamedTuple):
    embeddings: torch.Tensor
    encodings: torch.Tensor
    commitment_loss: torch.Tensor
    perplexity: torch.Tensor


def nearest_codes(flat: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of `embeddings` (n_codes, dim) for each row of `flat` (N, dim), from one (N x n_codes)
    matrix: `EMACodebook.nearest` calls it chunk by chunk, an exported network (export.py) on every row at once."""
    # |x|^2 - 2 x.e + |e|^2 in place (one matrix-sized buffer): x + (-2 m) is exactly x - 2 m, so every row's
    # distances, and their argmin, are those of any other chunking.
    distances = (flat @ embeddings.t()).mul_(-2).add_(flat.pow(2).sum(1, keepdim=True))
    return distances.add_(embeddings.pow(2).sum(1).unsqueeze(0)).argmin(1)


def snapped_to_codes(z: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """A (B, dim, D, H, W) latent with every voxel replaced by its nearest code (the quantizer's forward without
    its statistics), in explicit permutes that an ONNX export keeps (export.py)."""
    channels_last = z.permute(0, 2, 3, 4, 1)
    codes = nearest_codes(channels_last.reshape(-1, channels_last.shape[-1]), embeddings)
    return F.embedding(codes, embeddings).reshape(channels_last.shape).permute(0, 4, 1, 2, 3)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class EMACodebook(nn.Module):
    """Codebook of `n_codes` vectors of size `embedding_dim`, learnt by exponential moving averages.

    The codebook is initialised from encoder outputs on the first training batch; that
    state lives in the persistent `initialized` buffer, so a resumed run never re-initialises.
    Under DDP the EMA statistics are summed over ranks and random restarts are broadcast
    from rank 0, so every rank holds the same codebook.

    Args:
        n_codes: number of code vectors.
        embedding_dim: size of each code vector (the encoder's output channels).
        decay: EMA decay of the cluster sizes and sums.
        commitment_weight: weight of the commitment loss ||z - sg(e)||^2.
        restart_threshold: codes whose EMA usage falls below this are restarted from encoder outputs.
        random_restart: whether dead codes are restarted at all.
        chunk_elements: most (latent x code) distances held at once; nearest codes are found in
            chunks of `chunk_elements // n_codes` latents, so memory does not grow with the
            latent grid (a 128^3 patch at downsample 4 and 16384 codes would need 2 GiB at once)..
    """

    def __init__(
        self,
        n_codes: int,
        embedding_dim: int,
        decay: float = 0.99,
        commitment_weight: float = 0.25,
        restart_threshold: float = 1.0,
        random_restart: bool = True,
        eps: float = 1e-5,
        chunk_elements: int = 2**24,
    ) -> None:
        super().__init__()
        if n_codes < 2:
            raise ValueError(f"`n_codes` must be >= 2, got {n_codes}")
        self.n_codes = n_codes
        self.embedding_dim = embedding_dim
        self.decay = decay
        self.commitment_weight = commitment_weight
        self.restart_threshold = restart_threshold
        self.random_restart = random_restart
        self.eps = eps
        self.chunk_elements = chunk_elements
        self.register_buffer("embeddings", torch.randn(n_codes, embedding_dim))
        self.register_buffer("cluster_size", torch.zeros(n_codes))
        self.register_buffer("embedding_sum", self.embeddings.clone())
        self.register_buffer("initialized", torch.tensor(False))
        # Python copy of `initialized`, None until read: reading the buffer on a GPU is a host sync.
        self._known_initialized: bool | None = None

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._known_initialized = None
        super()._load_from_state_dict(*args, **kwargs)

    def read_initialized(self) -> bool:
        """Whether the codebook is initialised: its buffer read (a host sync on a GPU) and kept, so that later calls
        read nothing. The VQ-GAN reads it before its first training step (`on_train_start`), so no step waits."""
        self._known_initialized = bool(self.initialized)
        return self._known_initialized

    def _random_vectors(self, flat: torch.Tensor) -> torch.Tensor:
        """`n_codes` encoder vectors drawn on rank 0 (tiled if there are fewer), identical on every rank."""
        n = flat.shape[0]
        if n < self.n_codes:
            repeats = (self.n_codes + n - 1) // n
            std = 0.01 / max(self.embedding_dim, 1) ** 0.5
            flat = flat.repeat(repeats, 1)
            flat = flat + torch.randn_like(flat) * std
        picked = flat[torch.randperm(flat.shape[0], device=flat.device)[: self.n_codes]].contiguous()
        if _distributed():
            dist.broadcast(picked, src=0)
        return picked

    @torch.no_grad()
    def _initialise(self, flat: torch.Tensor) -> None:
        vectors = self._random_vectors(flat)
        self.embeddings.copy_(vectors)
        self.embedding_sum.copy_(vectors)
        self.cluster_size.fill_(1.0)
        self.initialized.fill_(True)
        self._known_initialized = True

    @torch.no_grad()
    def nearest(self, flat: torch.Tensor) -> torch.Tensor:
        """Index of the nearest code for each row of `flat` (N, embedding_dim), in chunks of rows."""
        rows = max(1, self.chunk_elements // self.n_codes)
        return torch.cat([nearest_codes(chunk, self.embeddings) for chunk in flat.split(rows)])

    @torch.no_grad()
    def _ema_update(self, flat: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor) -> None:
        # Scatter-adds instead of a one-hot matmul: O(N x dim) memory instead of O(N x n_codes).
        sums = torch.zeros_like(self.embedding_sum).index_add_(0, indices, flat)
        if _distributed():
            dist.all_reduce(counts)
            dist.all_reduce(sums)
        self.cluster_size.mul_(self.decay).add_(counts, alpha=1 - self.decay)
        self.embedding_sum.mul_(self.decay).add_(sums, alpha=1 - self.decay)
        total = self.cluster_size.sum()
        smoothed = (self.cluster_size + self.eps) / (total + self.n_codes * self.eps) * total
        self.embeddings.copy_(self.embedding_sum / smoothed.unsqueeze(1))
        if self.random_restart:
            dead = (self.cluster_size < self.restart_threshold).unsqueeze(1)
            replacement = self._random_vectors(flat)
            self.embeddings.copy_(torch.where(dead, replacement, self.embeddings))

    def forward(self, z: torch.Tensor) -> Quantized:
        """Quantise `z` of shape (B, C, *spatial) with C == embedding_dim."""
        if z.shape[1] != self.embedding_dim:
            raise ValueError(f"`z` must have {self.embedding_dim} channels, got shape {tuple(z.shape)}")
        # Distances and EMA statistics in float32 even under AMP: bf16 argmin picks wrong codes.
        with torch.autocast(device_type=z.device.type, enabled=False):
            z = z.float()
            channels_last = z.movedim(1, -1)
            flat = channels_last.reshape(-1, self.embedding_dim)
            known = self._known_initialized
            if self.training and not (self.read_initialized() if known is None else known):
                self._initialise(flat.detach())
            indices = self.nearest(flat.detach())
            # Counted on the device: CUDA's bincount reads the indices' extremes back to the host (two syncs).
            counts = flat.new_zeros(self.n_codes).index_add_(0, indices, flat.new_ones(()).expand(indices.shape[0]))
            quantized = F.embedding(indices, self.embeddings).view_as(channels_last).movedim(-1, 1)
            commitment = self.commitment_weight * F.mse_loss(z, quantized.detach())
            if self.training:
                self._ema_update(flat.detach(), indices, counts.clone())
            straight_through = z + (quantized - z).detach()
            usage = counts / flat.shape[0]
            perplexity = torch.exp(-(usage * torch.log(usage + 1e-10)).sum())
        return Quantized(straight_through, indices.view(channels_last.shape[:-1]), commitment, perplexity)
