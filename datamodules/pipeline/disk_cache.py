"""The disk cache: each item of the deterministic transforms saved once, atomically, in a fingerprinted folder.

`<cache_dir>/<fingerprint>/fingerprint.json` records what the items were made from: the
dataset's transform settings, every source file's path, size and modification time, a hash of
medvol's data code and the versions of the libraries that transform. The folder is named by
the hash of that record, so a changed transform, file or code reads and writes a folder of its
own, and an unchanged one (a resume, the next job of a sweep) reuses the items. Items are
`<stage>/<hash of the subject's record>.pt`, written to a partial file and renamed into place:
an interrupted write or a full disk never leaves a file that could be read as an item.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from medvol.core.atomic_checkpoint import atomic_torch_save
from medvol.core.errors import MedvolError

log = logging.getLogger("medvol")

FINGERPRINT_FILE = "fingerprint.json"
# Folders (from the repository root) whose code makes cached items, and the libraries that do.
CODE_FOLDERS = ("datamodules", "medvol/volumes")
LIBRARIES = ("monai", "torch", "numpy", "nibabel")
UNREADABLE = (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError)


def digest(content: Any) -> str:
    """A hash of JSON-able content (keys sorted; other objects by their `str`)."""
    return hashlib.sha1(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()


@functools.cache
def code_version(root: Path = Path(__file__).resolve().parents[2]) -> dict[str, str]:
    """A hash of the data code under `root` and the versions of its libraries: cached items depend on both."""
    sources = hashlib.sha1()
    for folder in CODE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            sources.update(path.relative_to(root).as_posix().encode())
            sources.update(path.read_bytes())
    return {"code": sources.hexdigest(), **{name: importlib.metadata.version(name) for name in LIBRARIES}}


def _expanded(paths: Iterable[str]) -> list[str]:
    """The paths, each folder replaced by the files directly in it."""
    return [str(p) for path in paths for p in (sorted(Path(path).iterdir()) if Path(path).is_dir() else [path])]


def file_stats(paths: Iterable[str]) -> list[list[Any]]:
    """[path, size, modification time in ns] of each file (None, None for a missing one); a folder (a DICOM
    series) stands for the files in it (a changed slice need not change the folder's own time)."""
    stats = []
    for path in _expanded(paths):
        try:
            stat = os.stat(path)
            stats.append([str(path), stat.st_size, stat.st_mtime_ns])
        except OSError:
            stats.append([str(path), None, None])
    return stats


def fingerprint_folder(cache_dir: Path, content: Mapping[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The folder for items made from `content` (transform settings, source files, ...) and its full record."""
    record = json.loads(json.dumps({**content, **code_version()}, sort_keys=True, default=str))
    return Path(cache_dir) / digest(record)[:16], record


def open_fingerprint_folder(folder: Path, record: Mapping[str, Any]) -> None:
    """Create `folder` with its `fingerprint.json`, or check that an existing one was made from `record`."""
    path = folder / FINGERPRINT_FILE
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            stored = None
        if stored == record:
            return
        if stored is not None:
            raise MedvolError(
                f"`dataset.cache_dir`: {folder} holds items made from other settings (its {FINGERPRINT_FILE} differs); "
                "remove that folder"
            )
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{FINGERPRINT_FILE}.{os.getpid()}.partial"
    partial.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(partial, path)


class DiskCache(Dataset):
    """`records` through `transform`, each item computed once and kept as `<folder>/<hash of the record>.pt`.

    An item file that cannot be read is made again; one that cannot be written (a full disk) is
    served uncached, with one warning.

    Args:
        records: subject records.
        transform: the deterministic transforms.
        folder: where the items go (the fingerprint folder's stage subfolder).
    """

    def __init__(self, records: list[dict[str, Any]], transform: Callable, folder: Path) -> None:
        self.records = records
        self.transform = transform
        self.folder = Path(folder)
        self._warned = False

    def __len__(self) -> int:
        return len(self.records)

    def item_path(self, record: Mapping[str, Any]) -> Path:
        return self.folder / f"{digest(record)}.pt"

    def __getitem__(self, index: int) -> Any:
        record = self.records[index]
        path = self.item_path(record)
        if path.is_file():
            try:
                return torch.load(path, weights_only=True)
            except UNREADABLE as err:
                log.warning("disk cache: %s cannot be read (%s); making it again", path, err)
        item = self.transform(record)
        try:
            atomic_torch_save(item, path, shared=True)
        except OSError as err:
            if not self._warned:
                self._warned = True
                log.warning("disk cache: cannot write %s (%s); items that do not fit are served uncached", path, err)
        return item
