"""Saves and restores every random number generator, so a resumed run continues exactly."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch


class RNGState(pl.Callback):
    """Python, NumPy, torch CPU and CUDA generator states, stored in each checkpoint per rank."""

    @property
    def state_key(self) -> str:
        return "RNGState"

    def state_dict(self) -> dict[str, Any]:
        # NumPy's key array as a tensor: a checkpoint holds tensors and plain values only (read as data).
        kind, keys, position, has_gauss, cached = np.random.get_state()
        numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached)
        state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.setstate(state_dict["python"])
        kind, keys, *rest = state_dict["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])
