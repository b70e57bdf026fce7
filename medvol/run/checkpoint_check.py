"""Checks a `ckpt_path` before any work starts, so a bad one costs one clear line, not a crash mid-setup."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_modules.base import MODEL_KEY, class_path
from medvol.core.errors import MedvolError


def check_checkpoint(ckpt_path: str | None, module: torch.nn.Module) -> None:
    """Raise `MedvolError` unless `ckpt_path` is a readable Lightning checkpoint of `module`'s family and shapes."""
    if not ckpt_path:
        return
    path = Path(str(ckpt_path)).expanduser()
    expected = "a .ckpt file written by medvol, e.g. <run>/checkpoints/last.ckpt"
    if not path.is_file():
        raise MedvolError(f"`ckpt_path`: no file at {path}; expected {expected}")
    try:
        # mmap avoids reading multi-GB checkpoints twice; files in the legacy format cannot be mapped.
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - truncated zip, pickle error, ...: all mean an unreadable file
        reason = str(err).splitlines()[0][:100] if str(err) else ""
        raise MedvolError(
            f"`ckpt_path`: {path} is not a readable checkpoint ({type(err).__name__}: {reason}); expected {expected}"
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "loops" not in checkpoint:
        raise MedvolError(f"`ckpt_path`: {path} is not a Lightning training checkpoint (no state_dict/loops); expected {expected}")
    saved = checkpoint.get(MODEL_KEY)
    wanted = class_path(module)
    if saved != wanted:
        raise MedvolError(
            f"`ckpt_path`: {path} is a checkpoint of {saved or 'an unknown model'}, but the config builds {wanted}; "
            "choose the matching `model=` or another checkpoint"
        )
    own = module.state_dict()
    for key, value in checkpoint["state_dict"].items():
        if key in own and tuple(own[key].shape) != tuple(value.shape):
            raise MedvolError(
                f"`ckpt_path`: {path} has {key} of shape {tuple(value.shape)} but the model config gives "
                f"{tuple(own[key].shape)}; use the model settings the checkpoint was trained with"
            )
    missing = sorted(set(own) - set(checkpoint["state_dict"]))
    if missing:
        raise MedvolError(f"`ckpt_path`: {path} lacks weights the model needs (first: {missing[0]}); expected {expected}")
