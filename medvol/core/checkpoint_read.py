"""Checkpoints read as data: `torch.load(weights_only=True)`, so reading a file cannot run code.

A checkpoint medvol writes holds tensors and plain values only (`medvol.core.plain_values`). A file whose
pickle asks for anything else (a function to call, a class of some library) is refused in one line naming
the file and what it asked for; PyTorch's restricted unpickler stops at that name, before any of the file
runs. What it holds is then walked as data (`medvol.core.file_data.check_data`): bounded in size as a copy would
count it, and no string that an interpolation would evaluate. `checkpoints_trusted(True)` is the documented opt-in
(`trust_checkpoints=true` on the command line) for a file the user vouches for, such as a checkpoint written by a
medvol from before this rule.

Before a byte of it is unpickled or inflated, a file is held against what reading it would take, from the zip's
central directory alone (`check_records`): torch.save stores every record uncompressed, so a record stored deflated
more than `MAX_RATIO` times (2 MB that inflate to 2 GiB) is no genuine checkpoint, and all records together may
inflate to at most `MEMORY_SHARE` times the memory budget (`medvol.volumes.volume_budget`: a network within the budget,
as `medvol.core.module_size` holds it, its optimizer's two moments and an EMA copy). This holds for a trusted file
too: trust is about code, and a file can exhaust memory without running any. A file in PyTorch's legacy format
(before 1.6, no zip) declares the size of each of its tensors in its pickle and PyTorch allocates that before reading
a byte of it, so nothing can be checked before it is read: it is refused unless trusted, with the one line saying
how to save it again.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from medvol.core.errors import MedvolError
from medvol.core.file_data import check_data, cut
from medvol.volumes.volume_budget import MEMORY_SHARE, volume_budget_bytes

TRUST_KEY = "trust_checkpoints"
# torch.save stores records uncompressed (ratio 1); a compressed copy of real weights shrinks them a few times at most.
MAX_RATIO = 20
# Records this small may be compressed at any ratio (a zipped copy's pickle and version files): nothing to exhaust.
SMALL_RECORD = 1024**2
# PyTorch's legacy format starts as a pickle (protocol 2), where the zip format starts `PK`.
PICKLE_START = b"\x80"
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
    check_records(path, key, expected)
    checkpoint = _loaded(path, key, expected, mmap)
    if weights_only():
        check_data(checkpoint, f"`{key}`: {path}", tensors=True)
    return checkpoint


def check_records(path: Path, key: str, expected: str) -> None:
    """Refuse in one line a torch file that would take more to read than its reader may hold: a record stored deflated
    beyond `MAX_RATIO`, records inflating past the budget, a legacy file unless trusted. Read from the zip's central
    directory only (nothing inflated); a damaged file is left for `torch.load` to call unreadable."""
    records = _zip_records(path)
    if records is None:
        start = _first_byte(path)
        if start is None:
            return
        if start != PICKLE_START:
            raise MedvolError(
                f"`{key}`: {path} is not a readable checkpoint (no zip directory and no legacy pickle: damaged, or "
                f"no torch file); expected {expected}"
            )
        if weights_only():
            raise MedvolError(
                f"`{key}`: {path} is in PyTorch's legacy format (before 1.6), whose tensors' sizes are allocated as "
                "its pickle states them before any can be checked; medvol reads the zip format torch.save writes "
                f"since: save it again (torch.save(torch.load(old, weights_only=True), new)), or add {TRUST_KEY}=true "
                f"if you trust it. Expected {expected}"
            )
        return
    for record in records:
        if (record.compress_type != zipfile.ZIP_STORED and record.file_size > SMALL_RECORD
                and record.file_size > MAX_RATIO * max(record.compress_size, 1)):
            raise MedvolError(
                f"`{key}`: {path} stores `{cut(record.filename, 60)}` deflated, {record.compress_size:,} bytes that "
                f"inflate to {record.file_size:,} ({record.file_size / max(record.compress_size, 1):,.0f}x); "
                f"torch.save stores records uncompressed and no checkpoint shrinks beyond {MAX_RATIO}x: refused "
                f"before inflating it. Expected {expected}"
            )
    inflated, budget = sum(record.file_size for record in records), MEMORY_SHARE * volume_budget_bytes()
    if inflated > budget:
        raise MedvolError(
            f"`{key}`: {path} holds {inflated / 1e6:,.2f} MB of records, more than reading it may take "
            f"({budget / 1024**2:,.0f} MiB: {MEMORY_SHARE}x the memory budget, a network within the budget with its "
            f"optimizer state; see MEDVOL_VOLUME_BUDGET_GIB): refused before reading it. Expected {expected}"
        )


def _zip_records(path: Path) -> list[zipfile.ZipInfo] | None:
    """The records the zip's central directory lists (nothing inflated), or None for a file that is no zip."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None


def _first_byte(path: Path) -> bytes | None:
    """The file's first byte (empty for an empty file), or None where it cannot be opened (`torch.load` says why)."""
    try:
        with Path(path).open("rb") as handle:
            return handle.read(1)
    except OSError:
        return None


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
