"""LPIPS-style perceptual loss on 2D slices, from a feature network stored at a local path (never downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from medvol.core.errors import MedvolError


class SlicePerceptualLoss(nn.Module):
    """Distance between unit-normalised feature maps of a frozen 2D network, averaged over its outputs.

    Args:
        model_path: a TorchScript file (`torch.jit.save`) of a network mapping (N, 3, H, W) images
            in [-1, 1] to a feature map or a list/tuple of feature maps.
    """

    def __init__(self, model_path: str) -> None:
        super().__init__()
        path = Path(model_path).expanduser()
        if not path.is_file():
            raise MedvolError(
                f"`model.perceptual_model_path`: no file at {path}; expected a TorchScript feature network "
                "saved with torch.jit.save (medvol downloads no weights)"
            )
        try:
            self.net = torch.jit.load(str(path), map_location="cpu")
        except Exception as err:  # noqa: BLE001 - any load failure is the same user error
            raise MedvolError(
                f"`model.perceptual_model_path`: {path} is not a TorchScript file ({type(err).__name__}); "
                "expected a network saved with torch.jit.save"
            ) from err
        self.net.eval()
        for p in self.net.parameters():
            p.requires_grad_(False)

    def train(self, mode: bool = True) -> SlicePerceptualLoss:
        super().train(mode)
        self.net.eval()
        return self

    def _features(self, x: torch.Tensor) -> list[torch.Tensor]:
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        elif x.shape[1] != 3:
            x = x.mean(1, keepdim=True).expand(-1, 3, -1, -1)
        out = self.net(x)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def forward(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        total = prediction.new_zeros(())
        pairs = list(zip(self._features(prediction), self._features(target), strict=True))
        for fp, ft in pairs:
            fp = fp / (fp.norm(dim=1, keepdim=True) + 1e-10)
            ft = ft / (ft.norm(dim=1, keepdim=True) + 1e-10)
            total = total + (fp - ft).pow(2).sum(1).mean()
        return total / len(pairs)
