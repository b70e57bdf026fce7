"""`python tests/slow_checkpoint_writes.py train.py <overrides>`: train.py whose checkpoint writes pause halfway.

The SIGKILL test needs kills that land inside a checkpoint write, which takes milliseconds for
a tiny model. Here every `torch.save` into a file writes the first half of its bytes, writes
the path of the file being written into `$MEDVOL_TEST_WRITE_MARKER`, pauses, writes the rest
and removes the marker; the test kills the run while the marker exists. Only tests use this.
"""

from __future__ import annotations

import io
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

import torch

PAUSE_SECONDS = 1.0
_torch_save = torch.save


def _write_slowly(data: bytes, stream: BinaryIO, name: str) -> None:
    marker = Path(os.environ["MEDVOL_TEST_WRITE_MARKER"])
    half = len(data) // 2
    stream.write(data[:half])
    stream.flush()
    marker.write_text(name)
    time.sleep(PAUSE_SECONDS)
    stream.write(data[half:])
    stream.flush()
    marker.unlink(missing_ok=True)


def slow_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    """`torch.save` with a pause halfway through the bytes that reach a file on disk."""
    if isinstance(f, (str, os.PathLike)):
        buffer = io.BytesIO()
        _torch_save(obj, buffer, *args, **kwargs)
        with open(f, "wb") as stream:
            _write_slowly(buffer.getvalue(), stream, str(f))
        return
    try:
        name = os.readlink(f"/proc/self/fd/{f.fileno()}")
    except (AttributeError, OSError, io.UnsupportedOperation):
        # An in-memory buffer: nothing reaches the disk here.
        _torch_save(obj, f, *args, **kwargs)
        return
    buffer = io.BytesIO()
    _torch_save(obj, buffer, *args, **kwargs)
    _write_slowly(buffer.getvalue(), f, name)


if __name__ == "__main__":
    torch.save = slow_save
    sys.argv = sys.argv[1:]
    # As `python train.py` would: the script's own folder first on the path, not tests/, whose medvol/ (the tests
    # of the medvol package) would hide the package itself.
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)
    runpy.run_path(sys.argv[0], run_name="__main__")
