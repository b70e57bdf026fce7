"""Files that attack the reader: a checkpoint whose unpickling runs a shell command (issue 36's payloads)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


class RunsACommand:
    """Unpickled, it runs `touch <marker>` in a shell: what a crafted checkpoint does to `torch.load`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def crafted_checkpoint(path: Path, marker: Path, **extra) -> Path:
    """A file shaped like a Lightning checkpoint (`extra`: more keys, e.g. its model class) whose unpickling runs
    `touch marker`."""
    torch.save({"state_dict": {}, "loops": {}, **extra, "callbacks": {"x": RunsACommand(marker)}}, path)
    return path
