"""What the denoiser predicts (epsilon, v or the clean sample) and the algebra between them.

With a = alpha_bar_t: x_t = sqrt(a) x0 + sqrt(1 - a) eps, v = sqrt(a) eps - sqrt(1 - a) x0.
"""

from __future__ import annotations

import torch

from lightning_modules.diffusion.schedule import broadcast
from medvol.core.errors import MedvolError

PREDICTION_TYPES = ("epsilon", "v", "sample")


def check_prediction_type(kind: str) -> str:
    if kind not in PREDICTION_TYPES:
        raise MedvolError(f"`model.prediction_type`: got {kind!r}; expected one of {list(PREDICTION_TYPES)}")
    return kind


def training_target(kind: str, x0: torch.Tensor, noise: torch.Tensor, alpha_bar: torch.Tensor) -> torch.Tensor:
    """The regression target of the denoiser for prediction type `kind`."""
    a = broadcast(alpha_bar, x0).to(x0.dtype)
    if kind == "epsilon":
        return noise
    if kind == "v":
        return a.sqrt() * noise - (1 - a).sqrt() * x0
    return x0


def to_x0_and_epsilon(
    kind: str, output: torch.Tensor, x_t: torch.Tensor, alpha_bar: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0, eps) recovered from the denoiser's `output` at x_t, in fp32 (or fp64 when given fp64)."""
    dtype = torch.promote_types(torch.promote_types(output.dtype, x_t.dtype), torch.float32)
    output, x_t = output.to(dtype), x_t.to(dtype)
    a = broadcast(alpha_bar, x_t).to(dtype)
    sa, s1a = a.sqrt(), (1 - a).sqrt()
    if kind == "epsilon":
        x0 = (x_t - s1a * output) / sa
        return x0, output
    if kind == "v":
        x0 = sa * x_t - s1a * output
        return x0, s1a * x_t + sa * output
    # eps is undefined at alpha_bar = 1 (no noise); clamp the divisor so the clean end stays finite.
    return output, (x_t - sa * output) / s1a.clamp(min=1e-12)


def clip_x0(
    x0: torch.Tensor, x_t: torch.Tensor, alpha_bar: torch.Tensor, limit: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """x0 clamped to [-limit, limit] and the eps that goes with it at x_t (DDPM/DDIM's `clip_denoised`)."""
    a = broadcast(alpha_bar, x_t).to(x0.dtype)
    x0 = x0.clamp(-limit, limit)
    return x0, (x_t.to(x0.dtype) - a.sqrt() * x0) / (1 - a).sqrt().clamp(min=1e-12)
