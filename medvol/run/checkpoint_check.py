"""Checks a `ckpt_path` before any work starts, so a bad one costs one clear line, not a crash mid-setup.

Two steps: `check_checkpoint_family` reads the file and the model class it was saved from, and
needs only the config's `model._target_` (it runs with the other config checks, before anything is
built or printed); `check_checkpoint_shapes` compares its weights with the model built on the meta device,
and that model's size with the memory budget, before the model is built for real (`medvol.core.module_size`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_modules.base import MODEL_KEY
from medvol.core.build import target_class
from medvol.core.checkpoint_read import load_checkpoint
from medvol.core.errors import MedvolError
from medvol.core.module_size import check_module_bytes, first_mismatch, on_meta

EXPECTED = "a .ckpt file written by medvol, e.g. <run>/checkpoints/last.ckpt"


def read_checkpoint(ckpt_path: str) -> tuple[Path, dict[str, Any]]:
    """(path, checkpoint) of a readable Lightning training checkpoint, read as data (tensors memory-mapped: the
    pickled structure only is read), else `MedvolError`."""
    path = Path(str(ckpt_path)).expanduser()
    if not path.is_file():
        raise MedvolError(f"`ckpt_path`: no file at {path}; expected {EXPECTED}")
    checkpoint = load_checkpoint(path, "ckpt_path", EXPECTED, mmap=True)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "loops" not in checkpoint:
        raise MedvolError(
            f"`ckpt_path`: {path} is not a Lightning training checkpoint (no state_dict/loops); expected {EXPECTED}"
        )
    return path, checkpoint


def _same_family(path: Path, checkpoint: dict[str, Any], wanted: str) -> None:
    saved = checkpoint.get(MODEL_KEY)
    if saved != wanted:
        raise MedvolError(
            f"`ckpt_path`: {path} is a checkpoint of {saved or 'an unknown model'}, but the config builds {wanted}; "
            "choose the matching `model=` or another checkpoint"
        )


def _same_shapes(path: Path, checkpoint: dict[str, Any], module: torch.nn.Module) -> None:
    mismatch = first_mismatch(module, checkpoint["state_dict"])
    if mismatch is None:
        return
    if mismatch.saved is None:
        raise MedvolError(
            f"`ckpt_path`: {path} lacks weights the model needs (first: {mismatch.key}); expected {EXPECTED}"
        )
    raise MedvolError(
        f"`ckpt_path`: {path} has {mismatch.key} of shape {mismatch.saved} but the model config gives "
        f"{mismatch.built}; use the model settings the checkpoint was trained with"
    )


def check_checkpoint_family(ckpt_path: str | None, model_target: str) -> dict[str, Any] | None:
    """Raise `MedvolError` unless `ckpt_path` (if given) is a readable checkpoint of the class `model_target` names;
    return the checkpoint read (tensors memory-mapped), so a caller that needs it reads it once."""
    if not ckpt_path:
        return None
    cls = target_class(model_target)
    path, checkpoint = read_checkpoint(ckpt_path)
    _same_family(path, checkpoint, f"{cls.__module__}.{cls.__qualname__}")
    return checkpoint


def check_checkpoint_shapes(
    ckpt_path: str | None, build: Callable[[], torch.nn.Module], checkpoint: dict[str, Any] | None = None
) -> None:
    """Raise `MedvolError` unless every weight the model `build` makes fits `ckpt_path` (if given) and none is missing,
    and the model fits the memory budget: checked on the meta device, before `build` allocates anything
    (`checkpoint`: the file as `check_checkpoint_family` read it, else it is read here)."""
    if not ckpt_path:
        return
    path = Path(str(ckpt_path)).expanduser()
    if checkpoint is None:
        path, checkpoint = read_checkpoint(ckpt_path)
    module = on_meta(build, f"`ckpt_path`: {path}")
    _same_shapes(path, checkpoint, module)
    check_module_bytes(module, f"`ckpt_path`: {path}")
