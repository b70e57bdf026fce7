"""Exponential moving average of a network's weights, as a module (so it is saved in checkpoints)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


class EMA(nn.Module):
    """An averaged copy of `network`: after each optimizer step, ema <- decay * ema + (1 - decay) * weights.

    Buffers (e.g. normalisation statistics) are copied, not averaged. With `warmup`, the decay
    is min(decay, (1 + n) / (10 + n)) after n updates, so a short run is not dominated by the
    random initialisation; Fast-DDPM's reference uses a fixed 0.999 (warmup=false).

    Args:
        network: the trained network (copied; the copy never receives gradients).
        decay: the EMA decay.
        warmup: ramp the decay up over the first updates.
    """

    def __init__(self, network: nn.Module, decay: float = 0.999, warmup: bool = False) -> None:
        super().__init__()
        self.module = copy.deepcopy(network).eval().requires_grad_(False)
        self.decay = float(decay)
        self.warmup = warmup
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))
        # Python copy of `updates`, kept beside the buffer: reading the buffer on a GPU is a host sync per step.
        self._updates: int | None = 0

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._updates = None
        super()._load_from_state_dict(*args, **kwargs)

    def read_updates(self) -> int:
        """The number of updates so far, read from the buffer once after a state dict is loaded (a host sync on a
        GPU; a diffusion module reads it before its first training step) and counted in Python after that."""
        if self._updates is None:
            self._updates = int(self.updates)
        return self._updates

    def current_decay(self) -> float:
        if not self.warmup:
            return self.decay
        n = self.read_updates()
        return min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self, network: nn.Module) -> None:
        decay = self.current_decay()
        for ema_param, param in zip(self.module.parameters(), network.parameters(), strict=True):
            ema_param.lerp_(param.detach().to(ema_param.dtype), 1.0 - decay)
        for ema_buffer, buffer in zip(self.module.buffers(), network.buffers(), strict=True):
            ema_buffer.copy_(buffer)
        self.updates += 1
        if self._updates is not None:
            self._updates += 1

    def train(self, mode: bool = True) -> EMA:
        # The averaged copy is only ever evaluated.
        super().train(mode)
        self.module.eval()
        return self
