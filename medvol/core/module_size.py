"""A network built from settings a file holds is sized before any of it is allocated.

A checkpoint's hyper-parameters (a VQ-GAN's `n_codes`, a cascade stage's channels, a segmentation run's restored
classes) say how large the network they build is; a crafted file of a kilobyte (`n_codes=2**28`) would have it
allocate GiBs before a single weight is compared. So the network is first built on PyTorch's meta device (every
shape, no memory, no random numbers drawn), each of its weights compared with the state dict the file carries, and
its parameters and buffers held against the memory budget (`medvol.volumes.volume_budget`); only then is it built
for real, as it always was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn

from medvol.core.errors import MedvolError
from medvol.volumes.volume_budget import BUDGET_ENV, GIB, volume_budget_bytes


@dataclass(frozen=True)
class Mismatch:
    """A weight the network needs that the state dict holds in another shape (`saved`), or not at all (None)."""

    key: str
    saved: tuple[int, ...] | None
    built: tuple[int, ...]


def on_meta(build: Callable[[], nn.Module], source: str) -> nn.Module:
    """What `build` makes, built on the meta device; settings that build no network (or that it refuses) are refused
    naming `source`."""
    try:
        with torch.device("meta"):
            return build()
    except MedvolError as err:
        # A setting the file gave may be what is refused (a checkpoint's class count): the line names the file.
        raise MedvolError(f"{source}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a wrong type or value in a file's settings, whichever the layer raises
        reason = " ".join(str(err).split())[:120]
        raise MedvolError(f"{source}: its settings do not build the network ({type(err).__name__}: {reason})") from None


def load_weights(module: nn.Module, weights: Mapping[str, Any], strict: bool = True) -> Any:
    """`module.load_state_dict(weights, strict)`, but on the meta device (where a shape check builds a model whose
    constructor loads weights: a resumed LDM's first stage, a cascade stage's earlier stages) nothing is copied:
    PyTorch would warn once a tensor that the copy is a no-op (74 lines on a resumed LDM run). The keys are compared as
    `load_state_dict` compares them, a strict mismatch raised as it raises it."""
    if not any(t.is_meta for t in chain(module.parameters(), module.buffers())):
        return module.load_state_dict(weights, strict=strict)
    own = set(module.state_dict())
    missing, unexpected = sorted(own - set(weights)), sorted(set(weights) - own)
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def first_mismatch(module: nn.Module, weights: Mapping[str, Any]) -> Mismatch | None:
    """The first weight of `module` that `weights` holds in another shape, else the first (by name) it lacks."""
    own = module.state_dict()
    for key, value in own.items():
        saved = getattr(weights.get(key), "shape", None)
        if key in weights and (saved is None or tuple(saved) != tuple(value.shape)):
            return Mismatch(key, tuple(saved) if saved is not None else (), tuple(value.shape))
    missing = sorted(set(own) - set(weights))
    return Mismatch(missing[0], None, tuple(own[missing[0]].shape)) if missing else None


def check_module_bytes(module: nn.Module, source: str) -> None:
    """Refuse, naming `source`, a network whose parameters and buffers (shapes only: built `on_meta`) would take
    more than the memory budget."""
    total = sum(t.numel() * t.element_size() for t in chain(module.parameters(), module.buffers()))
    budget = volume_budget_bytes()
    if total > budget:
        raise MedvolError(
            f"{source}: the network its settings build holds {total / GIB:.3g} GiB of weights and buffers, more than "
            f"the memory budget ({budget / GIB:.3g} GiB, a quarter of this machine's memory; {BUDGET_ENV} sets "
            "another); refused before building it"
        )
