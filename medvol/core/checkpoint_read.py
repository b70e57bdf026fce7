"""Checkpoints read as data: `torch.load(weights_only=True)`, so reading a file cannot run code.

A checkpoint medvol writes holds tensors and plain values only (`medvol.core.plain_values`). A file whose
pickle asks for anything else (a function to call, a class of some library) is refused in one line naming
the file and what it asked for; PyTorch's restricted unpickler stops at that name, before any of the file
runs. What it holds is then walked as data (`medvol.core.file_data.check_data`): bounded in size as a copy would
count it, and no string that an interpolation would evaluate. `checkpoints_trusted(True)` is the documented opt-in
(`trust_checkpoints=true` on the command line) for a file the user vouches for, such as a checkpoint written by a
medvol from before this rule.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from medvol.core.errors import MedvolError
from medvol.core.file_data import check_data

TRUST_KEY = "trust_checkpoints"
_trusted = False


@contextmanager
def checkpoints_trusted(trusted: bool) -> Iterator[None]:
    """Within the block, checkpoints are unpickled in full (`trusted`) or as data only (the default).

    Set by an entry point for the run it starts, from the user's own command line only: a run folder or a
    checkpoint never grants itself trust.
    """
    global _trusted
    if not isinstance(trusted, bool):
        raise MedvolError(f"`{TRUST_KEY}` is {trusted!r}; expected true or false (default false)")
    before, _trusted = _trusted, trusted
    try:
        yield
    finally:
        _trusted = before


def are_trusted() -> bool:
    """Whether checkpoints are read in full in this block (`checkpoints_trusted`)."""
    return _trusted


def weights_only() -> bool:
    """The `weights_only` argument for a checkpoint read now (Lightning's `fit`/`test` take it too)."""
    return not _trusted


def asked_for(err: BaseException) -> str | None:
    """What a refused pickle asked the unpickler to load (`posix.system`, `omegaconf.listconfig.ListConfig`), or
    None where the restricted unpickler stopped for another reason (a damaged file)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    return found.group(1) if found else None


def untrusted_refusal(path: Path, key: str, err: BaseException) -> MedvolError:
    """The one line for a file that needs more than tensors and plain values to be read."""
    return MedvolError(
        f"`{key}`: {path} asks to load `{asked_for(err)}` when read; medvol reads checkpoints as data (tensors and "
        f"plain values) so that a file cannot run code, and refuses it. If you trust this file (for example a "
        f"checkpoint from a medvol older than this rule), add {TRUST_KEY}=true"
    )


def load_checkpoint(path: Path, key: str, expected: str, mmap: bool = False) -> Any:
    """The unpickled file at `path` (on the CPU; tensors memory-mapped with `mmap`), read as data unless trusted.

    Raises `MedvolError` naming `key` (the config key that gave the path) for a file that asks for code
    (`untrusted_refusal`), for one whose values are not plain data (`check_data`) and for one that is not a readable
    checkpoint at all (`expected`: what would be).
    """
    checkpoint = _loaded(path, key, expected, mmap)
    if weights_only():
        check_data(checkpoint, f"`{key}`: {path}", tensors=True)
    return checkpoint


def _loaded(path: Path, key: str, expected: str, mmap: bool) -> Any:
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=weights_only(), mmap=mmap)
        except RuntimeError as err:
            # Files in the legacy (non-zip) format cannot be mapped.
            if not mmap or "mmap" not in str(err):
                raise
            return torch.load(path, map_location="cpu", weights_only=weights_only())
    except pickle.UnpicklingError as err:
        if weights_only() and asked_for(err):
            raise untrusted_refusal(path, key, err) from None
        raise _unreadable(path, key, expected, err) from None
    except Exception as err:  # noqa: BLE001 - truncated zip, bad magic number, ...: all mean an unreadable file
        raise _unreadable(path, key, expected, err) from None


def _unreadable(path: Path, key: str, expected: str, err: BaseException) -> MedvolError:
    reason = str(err).strip().splitlines()[0][:100] if str(err).strip() else ""
    return MedvolError(
        f"`{key}`: {path} is not a readable checkpoint ({type(err).__name__}: {reason}); expected {expected}"
    )
