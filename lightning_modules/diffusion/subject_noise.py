"""Per-subject noise: N(0, 1) streams seeded by the subject's name, for sampling in validation, test and predict.

A stream is named by (seed, subject, salt). The same subject draws the same noise on any rank,
in any batch position or batch, and in every epoch, so sampled metrics do not depend on how the
data was split over ranks; the salt tells apart the streams one subject needs (a cascade's
stages, the noise added to a condition).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch


def subject_names(batch: dict[str, Any], batch_idx: int, size: int) -> list[str]:
    """The batch's `subject` names, or names made from the batch and position when it has none."""
    return [str(name) for name in batch.get("subject") or [f"batch{batch_idx}-{i}" for i in range(size)]]


def subject_seed(seed: int, subject: str, salt: str = "") -> int:
    """The generator seed of one subject's stream (crc32 of seed, name and salt: the same on every machine)."""
    return zlib.crc32(f"{int(seed)}/{subject}/{salt}".encode())


class SubjectNoise:
    """One CPU generator per subject; each call draws every subject's next noise (the same on any device).

    Calls continue the streams, so draws made in the same order give the same values whatever
    else is in the batch.

    Args:
        subjects: the names of the batch's samples, in batch order.
        seed: the run's sampling seed (`model.sample_seed`).
        salt: the name of the stream.
    """

    def __init__(self, subjects: Sequence[str], seed: int = 0, salt: str = "") -> None:
        self.generators = [torch.Generator().manual_seed(subject_seed(seed, str(s), salt)) for s in subjects]

    def draw(self, shape: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """(B, *shape) float32 noise: row i from subject i's stream."""
        return torch.stack([torch.randn(tuple(shape), generator=g) for g in self.generators]).to(device)

    def __call__(self, like: torch.Tensor) -> torch.Tensor:
        """Noise shaped like the batch `like` (B, ...), on its device (a sampler's `noise_like`)."""
        return self.draw(like.shape[1:], like.device)

    def integers(self, high: int) -> torch.Tensor:
        """(B,) int64 in [0, high): row i from subject i's stream."""
        return torch.tensor([int(torch.randint(high, (1,), generator=g)) for g in self.generators])
