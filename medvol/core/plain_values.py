"""What medvol writes into a checkpoint: tensors and plain values, so it can be read back as data.

`plain(value)` turns the objects a run's records hold into what PyTorch's `weights_only` unpickler accepts
without an allowlist: config nodes into dicts and lists, a partial optimizer into the config that describes
it, NumPy arrays into tensors, NumPy scalars and paths into Python numbers and strings.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

PLAIN_SCALARS = (str, int, float, bool, complex, bytes, type(None))


def _class_path(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _config_node(node: DictConfig | ListConfig) -> Any:
    try:
        return OmegaConf.to_container(node, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation that only resolves inside its Hydra job: keep it as written
        return OmegaConf.to_container(node, resolve=False)


def _partial(value: functools.partial) -> dict[str, Any]:
    """A partial (Hydra's `_partial_: true`, e.g. a model's optimizer) as the config that builds it."""
    described: dict[str, Any] = {"_target_": _class_path(value.func), "_partial_": True}
    if value.args:
        described["_args_"] = plain(list(value.args))
    described.update({k: plain(v) for k, v in value.keywords.items()})
    return described


def plain(value: Any) -> Any:
    """`value` with every container and leaf turned into tensors, dicts, lists, tuples and Python scalars.

    Tensors pass as they are (no copy). An object of another kind passes unchanged: a checkpoint holding one
    cannot be read as data, which `tests/medvol/core/test_plain_values.py` checks for every model family.
    """
    if isinstance(value, torch.Tensor) or type(value) in PLAIN_SCALARS:
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return _config_node(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(plain(v) for v in value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [plain(v) for v in items]
    if isinstance(value, functools.partial):
        return _partial(value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, PurePath):
        return str(value)
    for scalar in (bool, int, float, str):  # subclasses of the scalars
        if isinstance(value, scalar):
            return scalar(value)
    if isinstance(value, type):
        return _class_path(value)
    return value
