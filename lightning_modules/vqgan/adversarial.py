"""Patch-discriminator losses, computed where the logits are.

The formulas are MONAI's `PatchAdversarialLoss` (reduction `mean`, one discriminator output),
term for term: hinge on `tanh` of the logits, least squares on a leaky ReLU (slope 0.05) of
them, binary cross-entropy on their sigmoid. MONAI builds its targets with `torch.tensor(...)`
on the host and copies them to the logits' device at every call; on a GPU each such copy waits
for the device to finish its queued work, twelve times per VQ-GAN step. Here the targets are
made on the logits' device, so a step never stops to wait for the GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CRITERIA = ("hinge", "least_squares", "bce")


class AdversarialLoss:
    """Generator and discriminator losses on patch logits.

    Args:
        criterion: `hinge`, `least_squares` or `bce`.
    """

    def __init__(self, criterion: str) -> None:
        if criterion not in CRITERIA:
            raise ValueError(f"`criterion` must be one of {CRITERIA}, got {criterion!r}")
        self.criterion = criterion

    def _real(self, logits: torch.Tensor) -> torch.Tensor:
        """The loss that pulls `logits` towards "real"."""
        if self.criterion == "hinge":
            return -torch.clamp(torch.tanh(logits) - 1, max=0).mean()
        if self.criterion == "least_squares":
            activated = F.leaky_relu(logits, 0.05)
            return F.mse_loss(activated, activated.new_ones(()).expand_as(activated))
        return self._cross_entropy(logits, 1.0)

    def _fake(self, logits: torch.Tensor) -> torch.Tensor:
        """The loss that pushes `logits` towards "fake"."""
        if self.criterion == "hinge":
            return -torch.clamp(-torch.tanh(logits) - 1, max=0).mean()
        if self.criterion == "least_squares":
            activated = F.leaky_relu(logits, 0.05)
            return F.mse_loss(activated, activated.new_zeros(()).expand_as(activated))
        return self._cross_entropy(logits, 0.0)

    @staticmethod
    def _cross_entropy(logits: torch.Tensor, target: float) -> torch.Tensor:
        # binary_cross_entropy refuses to run under CUDA autocast; in float32 it is the same arithmetic.
        with torch.autocast(device_type=logits.device.type, enabled=False):
            probability = torch.sigmoid(logits.float())
            return F.binary_cross_entropy(probability, probability.new_full((), target).expand_as(probability))

    def generator(self, fake_logits: torch.Tensor) -> torch.Tensor:
        """What the generator minimises: the discriminator's verdict on its output, as if it were real."""
        return self._real(fake_logits)

    def discriminator(self, real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
        """The mean of the real and the fake terms."""
        return 0.5 * (self._real(real_logits) + self._fake(fake_logits))
