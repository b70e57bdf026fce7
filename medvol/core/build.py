"""`build(node)`: Hydra's instantiate, but user errors reach the user as one `MedvolError` line.

A `MedvolError` raised by a constructor is re-raised as itself; a `_target_` that cannot be
imported (a misspelt class path, a package that is not installed) becomes one.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import open_dict

from medvol.core.errors import MedvolError, refusal_within


def _causes(err: BaseException) -> list[BaseException]:
    chain = []
    cause: BaseException | None = err.__cause__
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def build(node: Any, **kwargs: Any) -> Any:
    """Instantiate a `_target_` config; unwrap Hydra's wrapper around medvol's one-line user errors."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        own = refusal_within(err)
        if own is not None:
            raise own from None
        missing = next((c for c in _causes(err) if isinstance(c, ModuleNotFoundError)), None)
        target = node.get("_target_") if hasattr(node, "get") else None
        if str(err).startswith("Error locating target"):
            raise MedvolError(
                f"`_target_: {target}`: no such class or function; check the spelling of the class path"
            ) from None
        if missing is not None:
            raise MedvolError(f"`_target_: {target}` needs a package that is not installed ({missing})") from None
        raise


# Keys of a model config that tell the run how to judge, split and plan for the model (the root config's
# `optimized_metric`, `fallback_metric` and `dataset.stratify_by` read them; segmentation's `plan` steers
# medvol.run.planning), not constructor arguments.
RUN_KEYS = ("monitor", "monitor_mode", "fallback_monitor", "fallback_mode", "stratify_by", "plan")


def build_model(node: Any, **kwargs: Any) -> Any:
    """`build` for a model config: its run keys (`RUN_KEYS`) are left out of the constructor's arguments."""
    node = copy.deepcopy(node)
    with open_dict(node):
        for key in RUN_KEYS:
            node.pop(key, None)
    return build(node, **kwargs)


def target_class(target: str) -> Any:
    """The class (or function) a `_target_` path names, imported without building anything.

    Raises the `MedvolError` that `build` would give for a path that cannot be imported.
    """
    parts = str(target).split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
                continue  # this prefix is no module: the rest of the path is attributes
            raise MedvolError(f"`_target_: {target}` needs a package that is not installed ({err})") from None
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                break
            found = getattr(found, attribute)
        else:
            return found
        break
    raise MedvolError(f"`_target_: {target}`: no such class or function; check the spelling of the class path")
