"""Effective batch size and learning-rate scaling by world size.

effective batch = per-device batch x world size x gradient accumulation. With
`lr_scaling=linear` (or `sqrt`) every optimizer config of the model has its `lr` multiplied
by the world size (or its square root), the rule the PRS-Med seed applies; the default
`none` keeps the configured LR whatever the number of devices.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import hydra
import torch
from omegaconf import DictConfig, ListConfig

from medvol.core.errors import MedvolError

LR_SCALING_RULES = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class BatchArithmetic:
    per_device: int
    world_size: int
    accumulation: int

    @property
    def effective(self) -> int:
        return self.per_device * self.world_size * self.accumulation

    def describe(self) -> str:
        return (
            f"batch: {self.per_device} per device x {self.world_size} devices x {self.accumulation} accumulation "
            f"= effective batch {self.effective}"
        )


def _is_optimizer_config(node: DictConfig) -> bool:
    target = node.get("_target_")
    if not target or "lr" not in node:
        return False
    try:
        cls = hydra.utils.get_class(str(target))
    except Exception:  # noqa: BLE001 - a target that is not a class is simply not an optimizer
        return False
    return issubclass(cls, torch.optim.Optimizer)


def _optimizer_configs(node: DictConfig | ListConfig, path: str) -> list[tuple[str, DictConfig]]:
    """Every optimizer config (a `_target_` Optimizer class with an `lr`) under `node`, with its key path."""
    found: list[tuple[str, DictConfig]] = []
    if isinstance(node, DictConfig):
        if _is_optimizer_config(node):
            found.append((path, node))
        items = [(str(key), node._get_node(key)) for key in node.keys()]
    else:
        items = [(str(index), node._get_node(index)) for index in range(len(node))]
    for key, child in items:
        if isinstance(child, (DictConfig, ListConfig)):
            found.extend(_optimizer_configs(child, f"{path}.{key}"))
    return found


def lr_factor(rule: str, world_size: int) -> float:
    """How much the LR is multiplied by on `world_size` ranks under `rule`."""
    if rule not in LR_SCALING_RULES:
        raise MedvolError(f"`lr_scaling`: got {rule!r}; expected one of {', '.join(LR_SCALING_RULES)}")
    if rule == "linear":
        return float(world_size)
    if rule == "sqrt":
        return math.sqrt(world_size)
    return 1.0


def scale_learning_rates(model_cfg: DictConfig, rule: str, world_size: int) -> tuple[DictConfig, list[str]]:
    """A copy of `model_cfg` with every optimizer's `lr` scaled, and one `key: old -> new` line per optimizer."""
    factor = lr_factor(rule, world_size)
    scaled = copy.deepcopy(model_cfg)
    optimizers = _optimizer_configs(scaled, "model")
    if rule != "none" and not optimizers:
        raise MedvolError(
            f"`lr_scaling={rule}` but the model config has no optimizer with an `lr` "
            "(expected e.g. `model.optimizer: {_target_: torch.optim.Adam, _partial_: true, lr: ...}`)"
        )
    lines = []
    for path, optimizer in optimizers:
        base = float(optimizer.lr)
        optimizer.lr = base * factor
        lines.append(
            f"{path}.lr: {base:g}" + (f" x {factor:g} ({rule} lr_scaling) = {base * factor:g}" if factor != 1 else "")
        )
    return scaled, lines
