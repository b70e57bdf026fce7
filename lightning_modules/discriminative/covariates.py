"""Standardisation of tabular covariates with statistics of the training split, kept in the checkpoint."""

from __future__ import annotations

import torch
from torch import nn


class CovariateScaler(nn.Module):
    """(x - mean) / std per covariate, with mean and std fitted once on the training split.

    The statistics are buffers, so they travel in every checkpoint: a resumed or test-only run
    uses the statistics of the run that trained the weights, never those of other data.

    Args:
        count: number of covariates.
    """

    def __init__(self, count: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(count, dtype=torch.float64))
        self.register_buffer("std", torch.ones(count, dtype=torch.float64))
        self.register_buffer("fitted", torch.tensor(False))

    def fit(self, covariates: torch.Tensor) -> None:
        """Set mean and std from an (N, count) table; a constant column keeps std 1 (it is centred only)."""
        values = covariates.to(torch.float64)
        std = values.std(dim=0, unbiased=False) if len(values) > 1 else torch.ones_like(self.std)
        self.mean.copy_(values.mean(dim=0))
        self.std.copy_(torch.where(std > 1e-12, std, torch.ones_like(std)))
        self.fitted.fill_(True)

    def forward(self, covariates: torch.Tensor) -> torch.Tensor:
        return ((covariates.to(torch.float64) - self.mean) / self.std).to(covariates.dtype)
