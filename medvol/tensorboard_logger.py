"""A TensorBoard logger that flushes its event file every few seconds instead of at every logging step."""

from __future__ import annotations

import time
from typing import Any

from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities import rank_zero_only


class ThrottledTensorBoardLogger(TensorBoardLogger):
    """`TensorBoardLogger` whose `save()` (called by Lightning after every logging step) writes to disk
    at most every `flush_seconds`; the event writer also flushes on its own and at the end of the run.

    A flush cost about 30 ms on a busy shared disk, every `log_every_n_steps` steps: the largest
    fixed cost of medvol's training step (see benchmarks/overhead.py).

    Args:
        flush_seconds: least time between two flushes from `save()`.
        **kwargs: `TensorBoardLogger` arguments.
    """

    def __init__(self, *args: Any, flush_seconds: float = 10.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flush_seconds = flush_seconds
        self._last_flush = float("-inf")

    @rank_zero_only
    def save(self) -> None:
        now = time.monotonic()
        if now - self._last_flush >= self.flush_seconds:
            self._last_flush = now
            super().save()
