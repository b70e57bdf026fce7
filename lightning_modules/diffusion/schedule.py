"""The forward (noising) process: beta schedules and the alpha-bar table, kept in fp32 whatever the precision."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from medvol.core.errors import MedvolError

BETA_SCHEDULES = ("linear", "cosine")


def make_betas(kind: str, num_train_timesteps: int, beta_start: float = 1e-4, beta_end: float = 0.02) -> torch.Tensor:
    """Betas in float64: `linear` from beta_start to beta_end (DDPM, Fast-DDPM), or `cosine` (Nichol & Dhariwal)."""
    if kind == "linear":
        return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float64)
    if kind == "cosine":
        s = 0.008
        steps = torch.arange(num_train_timesteps + 1, dtype=torch.float64) / num_train_timesteps
        alpha_bar = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
        return (1 - alpha_bar[1:] / alpha_bar[:-1]).clamp(max=0.999)
    raise MedvolError(f"`model.beta_schedule`: got {kind!r}; expected one of {list(BETA_SCHEDULES)}")


def broadcast(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) per-sample values shaped (B, 1, 1, ...) to multiply a batch like `like`."""
    return values.reshape(-1, *([1] * (like.ndim - 1)))


class NoiseSchedule(nn.Module):
    """`betas` and `alphas_cumprod` as fp32 buffers (saved, moved with the module, never downcast).

    MONAI's schedulers keep the tables as plain tensors and `add_noise` casts them to the
    input's dtype; here `_apply` (what `.to()`, `.half()` and Lightning's precision plugins
    call) keeps the dtype at float32 while still moving the device, and `add_noise`
    computes in fp32 under autocast.

    Args:
        kind: `linear` or `cosine`.
        num_train_timesteps: steps of the forward process (1000).
        beta_start: first beta of the linear schedule.
        beta_end: last beta of the linear schedule.
    """

    def __init__(
        self, kind: str = "linear", num_train_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02
    ) -> None:
        super().__init__()
        if int(num_train_timesteps) < 1:
            raise MedvolError(f"`model.num_train_timesteps` must be >= 1, got {num_train_timesteps}")
        self.kind = kind
        self.num_train_timesteps = int(num_train_timesteps)
        betas = make_betas(kind, self.num_train_timesteps, beta_start, beta_end)
        self.register_buffer("betas", betas.float())
        self.register_buffer("alphas_cumprod", torch.cumprod(1 - betas, dim=0).float())

    def _apply(self, fn: Any, recurse: bool = True) -> NoiseSchedule:
        # Keep the original fp32 values (a round trip through bf16 would lose them); take only the new device.
        originals = {name: buffer for name, buffer in self._buffers.items() if buffer is not None}
        super()._apply(fn, recurse)
        for name, original in originals.items():
            moved = self._buffers[name]
            if moved is not None and moved.dtype != torch.float32:
                self._buffers[name] = original.to(device=moved.device)
        return self

    def alpha_bar(self, t: torch.Tensor) -> torch.Tensor:
        """alpha_bar at integer steps `t`; t = -1 means the clean end of the chain (alpha_bar = 1)."""
        t = t.to(self.alphas_cumprod.device).long()
        values = self.alphas_cumprod[t.clamp(min=0)]
        return torch.where(t < 0, torch.ones_like(values), values)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(alpha_bar_t) x0 + sqrt(1 - alpha_bar_t) noise, computed in fp32."""
        with torch.autocast(device_type=x0.device.type, enabled=False):
            ab = broadcast(self.alpha_bar(t), x0)
            return ab.sqrt() * x0.float() + (1 - ab).sqrt() * noise.float()
