"""A 3D ResNet on the image, its pooled features joined with standardised covariates, and a linear head."""

from __future__ import annotations

import torch
from torch import nn

from lightning_modules.discriminative.backbone import build_backbone
from lightning_modules.discriminative.covariates import CovariateScaler


class ImageCovariateNet(nn.Module):
    """image (B, C, D, H, W) [+ covariates (B, K)] -> (B, outputs).

    Late fusion: the covariates are standardised and concatenated to the pooled image
    features before the head, so a covariate-only signal (age) needs no convolution to pass.

    Args:
        outputs: head outputs (1 log-risk, or one logit per class).
        backbone: resnet10, resnet18, resnet34 or resnet50.
        in_channels: image channels.
        num_covariates: K, 0 for image only.
        widen_factor: backbone width scale.
        dropout: dropout on the joined features.
        pretrained_path: local backbone weights, or None for random initialisation.
    """

    def __init__(
        self,
        outputs: int,
        backbone: str = "resnet18",
        in_channels: int = 1,
        num_covariates: int = 0,
        widen_factor: float = 1.0,
        dropout: float = 0.0,
        pretrained_path: str | None = None,
    ) -> None:
        super().__init__()
        self.backbone, features = build_backbone(backbone, in_channels, widen_factor, pretrained_path)
        self.covariates = CovariateScaler(num_covariates) if num_covariates else None
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(features + num_covariates, outputs)

    def forward(self, image: torch.Tensor, covariates: torch.Tensor | None = None) -> torch.Tensor:
        features = self.backbone(image)
        if self.covariates is not None:
            assert covariates is not None, "the network was built with covariates; the batch has none"
            features = torch.cat([features, self.covariates(covariates).to(features.dtype)], dim=1)
        return self.head(self.dropout(features))
