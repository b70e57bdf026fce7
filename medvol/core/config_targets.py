"""A config read from a file (a run's record, an old run's `.hydra/config.yaml`, the settings a checkpoint restores)
builds only medvol's classes and the classes of the libraries medvol builds from, never an arbitrary callable.

Hydra instantiates whatever a `_target_` names: `os.system` with the right arguments is as valid a target as
a network. A run folder someone shares is data, so every `_target_` in a config read from one is checked
before anything is imported from it or built: the path must lie in medvol's own packages, or in torch, MONAI
or Lightning and name a class of the kinds medvol builds there (a network, an optimizer, a scheduler, a
callback, a logger, a strategy, a trainer), and not one of the few of those that call a function they are given
(`CALLERS`). The check reads the resolved tree (`medvol.run.run_record` resolves an old config before it): a
`_target_` that an interpolation would create is checked as the one written. Hydra's own target policy (1.3.6 and
later) is not relied on: it stops `os.system`, not `torch.load(weights_only=False)`. The user's own command line is
not checked: it may name any target.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from medvol.core.errors import MedvolError

OWN_PACKAGES = ("medvol", "lightning_modules", "datamodules", "callbacks")
LIBRARIES = ("torch", "monai", "pytorch_lightning", "lightning", "lightning_fabric")
ALLOWED = "medvol's classes, or torch/MONAI/Lightning networks, optimizers, schedulers, callbacks, loggers, strategies"
# Classes of those kinds that call whatever function they are given.
CALLERS = ("pytorch_lightning.callbacks.LambdaCallback", "lightning.pytorch.callbacks.LambdaCallback",
           "pytorch_lightning.callbacks.lambda_function.LambdaCallback",
           "lightning.pytorch.callbacks.lambda_function.LambdaCallback")


def _library_bases() -> tuple[type, ...]:
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.loggers import Logger
    from pytorch_lightning.strategies import Strategy

    return (
        torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, pl.Callback,
        pl.LightningModule, pl.LightningDataModule, pl.Trainer, Logger, Strategy,
    )


def file_targets(node: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(key of the node, its `_target_` as written) for every node of a plain config tree that has one."""
    if isinstance(node, dict):
        if "_target_" in node:
            yield key or "<root>", node["_target_"]
        for name, value in node.items():
            yield from file_targets(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from file_targets(value, f"{key}[{index}]")


def _located(target: str) -> Any:
    """The object a dotted path names, imported from the longest importable module prefix; None if none."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute, None)
            if found is None:
                return None
        return found
    return None


def target_problem(target: Any) -> str | None:
    """Why a `_target_` read from a file may not be built, or None when it may."""
    if not isinstance(target, str):
        return "is not a class path"
    if "${" in target:
        return "is an interpolation, not a class path"
    if target in CALLERS:
        return "calls the functions it is given"
    if "__main__" in target.split("."):
        return "names a script, not a class"
    package = target.split(".")[0]
    if package not in OWN_PACKAGES + LIBRARIES:
        return f"lies outside {', '.join(OWN_PACKAGES + LIBRARIES)}"
    found = _located(target)
    if not isinstance(found, type):
        return "is no class" if found is not None else "names nothing importable"
    if f"{found.__module__}.{found.__qualname__}" in CALLERS:
        return "calls the functions it is given"
    if package in OWN_PACKAGES or issubclass(found, _library_bases()):
        return None
    return "is not a class medvol builds from that library"


def _binders(node: Any, key: str = "") -> Iterator[str]:
    """Keys of the nodes that would bind a built object into a callable: a `_partial_` node or an `_args_` list
    holding a `_target_` (Hydra builds the inner one first and hands it to the outer)."""
    if isinstance(node, dict):
        holds = [name for name, value in node.items() if not str(name).startswith("_") or name == "_args_"]
        if node.get("_partial_") or "_args_" in node:
            if any(True for name in holds for _ in file_targets(node[name])):
                yield key or "<root>"
        for name, value in node.items():
            yield from _binders(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _binders(value, f"{key}[{index}]")


def own_targets(cfg: DictConfig) -> dict[str, str]:
    """(key, `_target_`) for every class path the reader's own config (its command line and medvol's config groups,
    never a file it reads) names as written: a file may name the same class at the same key."""
    tree = OmegaConf.to_container(cfg, resolve=False)
    return {
        key: target for key, target in file_targets(tree)
        if isinstance(target, str) and "${" not in target and not key.startswith("hydra")
    }


def check_file_targets(tree: Any, source: Path | str, own: Mapping[str, str] | None = None) -> None:
    """Raise `MedvolError` naming the first `_target_` of `tree` (plain and resolved, or a config node resolved
    here; read from `source`) that may not be built, or the first node that would bind one into a callable.
    `own`: the reader's own targets (`own_targets`); a file's target equal to the one at the same key there is
    the reader's choice, not the file's."""
    if isinstance(tree, DictConfig):
        tree = OmegaConf.to_container(tree, resolve=True)
    for key in _binders(tree):
        raise MedvolError(
            f"`{key}` in {source} is a partial (`_partial_`, `_args_`) holding another `_target_`; a config read from "
            "a run folder binds no built object into a callable (write it on your own command line)"
        )
    for key, target in file_targets(tree):
        problem = None if own and own.get(key) == target else target_problem(target)
        if problem:
            raise MedvolError(
                f"`{key}._target_: {target}` in {source} {problem}; a config read from a run folder builds only "
                f"{ALLOWED} (name any other class on your own command line)"
            )
