"""An attack's allocation made to fail, not to take the machine: the address space a process may still map, capped.

`resource.setrlimit(RLIMIT_AS)` bounds every mapping (NumPy's, PyTorch's, zlib's), so a reader that asks for GiBs
a file promised gets a MemoryError (PyTorch: "can't allocate memory") at once, where medvol without its checks
would have filled the memory. In this process the soft limit is lowered for a block and raised back after it (an
unprivileged process may, up to the hard limit); a subprocess gets it before it starts (`preexec_fn`).
"""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

GIB = 1024**3


def mapped_bytes() -> int:
    """The address space this process maps now (VmSize)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextmanager
def at_most_more(gib: float) -> Iterator[None]:
    """Within the block, this process may map at most `gib` GiB more than it maps when the block starts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes() + int(gib * GIB), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def limited(gib: float):
    """A `preexec_fn` giving a subprocess `gib` GiB of address space in all (its imports included)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (int(gib * GIB), resource.getrlimit(resource.RLIMIT_AS)[1]))

    return limit
