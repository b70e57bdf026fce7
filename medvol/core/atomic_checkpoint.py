"""Checkpoint files that are either the old file or the complete new one, whatever moment a crash hits.

Lightning's default writer opens the target path itself; a `kill -9`, an out-of-memory kill
or a node failure during that write can leave a truncated `last.ckpt`, and the run that was
meant to resume from it cannot. `AtomicCheckpointIO` writes into a hidden partial file in the
same folder, flushes and fsyncs it, renames it over the target (`os.replace`, atomic on one
file system) and fsyncs the folder so the rename itself survives a power cut.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning_fabric.utilities.cloud_io import get_filesystem
from pytorch_lightning.plugins.io import TorchCheckpointIO

log = logging.getLogger("medvol")

_PARTIAL_SUFFIX = ".partial"


def partial_path(target: Path, writer: str = "") -> Path:
    """Where `target` is written before it is renamed into place: hidden, same folder, not `*.ckpt`.

    `writer` tells apart the partial files of writers that may work on the same target at once.
    """
    return target.with_name(f".{target.name}{writer}{_PARTIAL_SUFFIX}")


def _fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX; other systems cannot open a folder for fsync)."""
    if os.name != "posix":
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove_partials(folder: Path) -> None:
    """Partial files left by a writer that was killed; one process writes a run's checkpoints at a time."""
    for leftover in folder.glob(f".*{_PARTIAL_SUFFIX}"):
        log.debug("Removing %s, left by an interrupted checkpoint write", leftover)
        leftover.unlink(missing_ok=True)


def atomic_torch_save(checkpoint: Any, target: Path, shared: bool = False) -> None:
    """`torch.save(checkpoint, target)` through a partial file, fsync and rename.

    Args:
        checkpoint: what to save.
        target: the file.
        shared: other processes and threads may write into the same folder at once (a data cache): the
            partial file is named for this process and thread, and nobody else's leftovers are removed.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    if shared:
        partial = partial_path(target, f".{os.getpid()}-{threading.get_ident()}")
    else:
        _remove_partials(target.parent)
        partial = partial_path(target)
    try:
        # 0o666 so the user's umask decides the mode, as for a plain open().
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
        with os.fdopen(descriptor, "wb") as stream:
            torch.save(checkpoint, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's `TorchCheckpointIO` with atomic, durable writes on local disks.

    Remote paths (`s3://`, ...) keep Lightning's own writer: object stores publish an object
    only once it is complete.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Write `checkpoint` to `path` so that a crash leaves either the previous file or the new one."""
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_torch_save(checkpoint, Path(path))


def checkpoint_io_plugins(strategy: Any) -> list[AtomicCheckpointIO]:
    """The plugin list entry that makes every run's checkpoint writes atomic.

    A strategy built with its own `checkpoint_io` keeps it: Lightning refuses a second one.
    """
    if getattr(strategy, "_checkpoint_io", None) is not None:
        return []
    return [AtomicCheckpointIO()]
