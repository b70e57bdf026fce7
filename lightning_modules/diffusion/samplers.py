"""Reverse-process samplers over any timestep set: the DDIM update (Fast-DDPM, eta configurable) and DDPM ancestral.

MONAI's `DDIMScheduler.step` derives the previous step with a uniform stride, which is wrong
for a non-uniform set; these walk the given set backwards, the last step to alpha_bar = 1.
A sampler needs `denoise(x_t, t) -> (x0, eps)` and `noise_like(x) -> N(0, 1) tensor` (so callers
decide the random streams, e.g. one per subject).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_modules.diffusion.schedule import NoiseSchedule, broadcast

Denoise = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
NoiseLike = Callable[[torch.Tensor], torch.Tensor]
SAMPLERS = ("ddim", "ddpm")


def ddim_step(
    x0: torch.Tensor, eps: torch.Tensor, alpha_bar_t: torch.Tensor, alpha_bar_prev: torch.Tensor, eta: float,
    noise: torch.Tensor | None,
) -> torch.Tensor:
    """The generalised DDIM update from a step with alpha_bar_t to one with alpha_bar_prev (Song et al., eq. 12)."""
    a_t, a_prev = broadcast(alpha_bar_t, x0), broadcast(alpha_bar_prev, x0)
    sigma = eta * ((1 - a_prev) / (1 - a_t)).sqrt() * (1 - a_t / a_prev).sqrt()
    x_prev = a_prev.sqrt() * x0 + (1 - a_prev - sigma**2).clamp(min=0).sqrt() * eps
    if eta > 0 and noise is not None:
        x_prev = x_prev + sigma * noise
    return x_prev


def ddpm_posterior(
    x0: torch.Tensor, x_t: torch.Tensor, alpha_bar_t: torch.Tensor, alpha_bar_prev: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of q(x_{t-1} | x_t, x0) for consecutive steps (DDPM, Ho et al. eq. 7)."""
    a_t, a_prev = broadcast(alpha_bar_t, x0), broadcast(alpha_bar_prev, x0)
    alpha_t = a_t / a_prev
    beta_t = 1 - alpha_t
    mean = a_prev.sqrt() * beta_t / (1 - a_t) * x0 + alpha_t.sqrt() * (1 - a_prev) / (1 - a_t) * x_t
    variance = (1 - a_prev) / (1 - a_t) * beta_t
    return mean, variance


@torch.no_grad()
def sample_ddim(
    denoise: Denoise, x_T: torch.Tensor, schedule: NoiseSchedule, timesteps: torch.Tensor, eta: float = 0.0,
    noise_like: NoiseLike | None = None,
) -> torch.Tensor:
    """Walk `timesteps` (sorted ascending) from the last to the first with the DDIM update; return x0."""
    steps = timesteps.tolist()
    previous = [-1, *steps[:-1]]
    x = x_T.float()
    batch = x.shape[0]
    for t, s in zip(reversed(steps), reversed(previous), strict=True):
        t_batch = torch.full((batch,), t, dtype=torch.long, device=x.device)
        x0, eps = denoise(x, t_batch)
        a_t = schedule.alpha_bar(t_batch)
        a_prev = schedule.alpha_bar(torch.full_like(t_batch, s))
        noise = noise_like(x) if eta > 0 and s >= 0 and noise_like is not None else None
        x = ddim_step(x0, eps, a_t, a_prev, eta, noise)
    return x


@torch.no_grad()
def sample_ddpm(
    denoise: Denoise, x_T: torch.Tensor, schedule: NoiseSchedule, noise_like: NoiseLike
) -> torch.Tensor:
    """DDPM ancestral sampling over every step T-1 ... 0 with the posterior variance; return x0."""
    x = x_T.float()
    batch = x.shape[0]
    for t in reversed(range(schedule.num_train_timesteps)):
        t_batch = torch.full((batch,), t, dtype=torch.long, device=x.device)
        x0, _ = denoise(x, t_batch)
        mean, variance = ddpm_posterior(x0, x, schedule.alpha_bar(t_batch), schedule.alpha_bar(t_batch - 1))
        x = mean + variance.sqrt() * noise_like(x) if t > 0 else mean
    return x
