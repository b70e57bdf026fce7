"""What `dataset.cache=auto` chooses: memory when this rank's cached items fit the budget, else disk, else none.

The estimate is one item's bytes after the deterministic transforms, scaled by every other
item's voxel count. The budget (`dataset.cache_budget`) is a fraction of the memory the
machine has available now, or a size; it is shared by the ranks of one node.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from medvol.core.errors import MedvolError

# A memory cache's resident size over its tensors' bytes: 1.08-1.14x measured (docs/benchmarks/data.md), rounded up.
MEMORY_OVERHEAD = 1.15
# A disk cache takes at most this share of its file system's free space.
DISK_SHARE = 0.5
# Units of `dataset.cache_budget`: KB/MB/GB/TB are powers of 1000, K/M/G/T and KiB/MiB/GiB/TiB of 1024.
UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
BUDGET_HELP = "a fraction of the available memory in (0, 1] (e.g. 0.25 or 25%) or a size (e.g. 8GiB, 500MB)"


def size_text(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Budget:
    """`dataset.cache_budget`: a fraction of the available memory, or a size in bytes."""

    fraction: float | None = None
    size: int | None = None

    def bytes(self, available: int) -> int:
        return int(self.fraction * available) if self.fraction is not None else int(self.size or 0)

    def describe(self, available: int) -> str:
        if self.fraction is not None:
            return f"{100 * self.fraction:g}% of {size_text(available)} available"
        return f"`dataset.cache_budget`={size_text(self.size or 0)}"


def parse_budget(value: Any) -> Budget:
    """A `Budget` from 0.25, "25%", "8GiB", "500MB", ...; anything else raises `MedvolError`."""
    if isinstance(value, bool) or value is None:
        raise MedvolError(f"`dataset.cache_budget` is {value!r}; expected {BUDGET_HELP}")
    if isinstance(value, (int, float)):
        if 0 < value <= 1:
            return Budget(fraction=float(value))
        raise MedvolError(f"`dataset.cache_budget` is {value!r}; expected {BUDGET_HELP}")
    text = str(value).strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = -1.0
        if 0 < percent <= 100:
            return Budget(fraction=percent / 100)
        raise MedvolError(f"`dataset.cache_budget` is {value!r}; expected {BUDGET_HELP}")
    match = SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in UNITS or float(match.group(1)) <= 0:
        raise MedvolError(f"`dataset.cache_budget` is {value!r}; expected {BUDGET_HELP}")
    return Budget(size=int(float(match.group(1)) * UNITS[unit]))


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def available_memory() -> int:
    """Bytes of memory this process can still take: the system's `MemAvailable`, capped by a cgroup limit."""
    candidates = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 2**60:
            candidates.append(max(0, limit - usage))
    if not candidates:
        # No /proc (macOS): half the physical memory stands in for what is available.
        candidates.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    return min(candidates)


def existing_folder(folder: Path) -> Path:
    """`folder`, or its nearest ancestor that exists."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def check_cache_folder(folder: Path) -> None:
    """A folder the disk cache can create and write into; else `MedvolError`. Creates nothing."""
    existing = existing_folder(folder)
    if not existing.is_dir():
        raise MedvolError(
            f"`dataset.cache_dir`: {folder} cannot be a folder ({existing} is a file); expected a writable folder"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise MedvolError(
            f"`dataset.cache_dir`: {folder} is not writable ({existing} refuses new files); "
            "expected a writable folder, or dataset.cache=memory|none"
        )


def free_disk(folder: Path) -> int:
    return shutil.disk_usage(existing_folder(folder)).free


def item_bytes(item: Any) -> int:
    """Bytes of the tensors and arrays in a (nested) item."""
    if isinstance(item, torch.Tensor):
        return item.element_size() * item.numel()
    if isinstance(item, np.ndarray):
        return int(item.nbytes)
    if isinstance(item, Mapping):
        return sum(item_bytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(item_bytes(v) for v in item)
    return 0


@dataclass
class CachePlan:
    """The choice of `dataset.cache=auto` for this rank, and what it was based on.

    Args:
        mode: memory, disk or none.
        reason: why, in words.
        subjects: this rank's subjects (all stages).
        estimate: bytes of their cached items.
        budget: this rank's memory budget in bytes.
        budget_text: where the budget comes from.
        folder: the disk cache's folder (with its fingerprint), or None.
        disk_room: bytes the disk cache may take, or None.
    """

    mode: str
    reason: str
    subjects: int
    estimate: int
    budget: int
    budget_text: str
    folder: Path | None = None
    disk_room: int | None = None

    def describe(self) -> str:
        where = f" in {self.folder}" if self.mode == "disk" else ""
        return (
            f"dataset.cache=auto: {self.mode}{where}: this rank's {self.subjects} subjects are "
            f"~{size_text(self.estimate)} cached; {self.reason}"
        )

    def summary(self) -> dict[str, Any]:
        return {
            "requested": "auto", "mode": self.mode, "subjects": self.subjects,
            "estimate_mb": round(self.estimate / 2**20, 1), "budget_mb": round(self.budget / 2**20, 1),
            "folder": str(self.folder) if self.folder else None, "reason": self.reason,
        }


def plan_cache(
    subjects: int, estimate: int, budget: int, budget_text: str, folder: Path | None, disk_room: int | None
) -> CachePlan:
    """Memory if the estimate (with the allocator's overhead) fits the budget, else disk if it has room, else none."""
    fits = f"memory budget {size_text(budget)} ({budget_text}"
    if estimate * MEMORY_OVERHEAD <= budget:
        return CachePlan("memory", f"within the {fits})", subjects, estimate, budget, budget_text)
    if folder is None:
        reason = f"over the {fits}) and no `dataset.cache_dir` for a disk cache: not cached"
        return CachePlan("none", reason, subjects, estimate, budget, budget_text)
    assert disk_room is not None
    if estimate <= disk_room:
        reason = f"over the {fits}), within half the free disk space ({size_text(disk_room)})"
        return CachePlan("disk", reason, subjects, estimate, budget, budget_text, folder, disk_room)
    reason = (
        f"over the {fits}) and over half the free disk space under {folder.parent} ({size_text(disk_room)}): not "
        "cached; raise `dataset.cache_budget` or free disk space"
    )
    return CachePlan("none", reason, subjects, estimate, budget, budget_text, folder, disk_room)
