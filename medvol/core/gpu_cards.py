"""The GPUs a user can name for a preflight (`preflight=H100`): memory and dense bf16 tensor rate of each.

Rates are NVIDIA's datasheet figures for dense bf16 tensor-core work (the datasheets print twice as much "with
sparsity"): A100 312 TFLOP/s (A100 datasheet), H100 SXM and H200 989 (H100 and H200 datasheets, 1,979 sparse),
H100 PCIe 756, L40S 362 (L40S datasheet), L4 121 and A10 125 (their datasheets). Memory is what
`torch.cuda.get_device_properties().total_memory` reported on the GPU rounds where a card was lent (H100 80GB HBM3
79.18 GiB on 2026-11-28, H200 139.80 GiB on 2026-11-27); for the others the datasheet's capacity, whose "GB" of
HBM are GiB (the H100's 80 GB read 79.18 GiB), less the same 0.82 GiB the H100 kept, and GDDR's GB as 10^9 bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from medvol.core.errors import MedvolError

GIB = 2**30


@dataclass(frozen=True)
class Card:
    """A GPU: its name, the memory a process can allocate (GiB) and its dense bf16 peak (TFLOP/s; None: unknown)."""

    name: str
    memory_gib: float
    bf16_tflops: float | None
    source: str


RESERVED_GIB = 80 - 79.18
CARDS = {
    card.name.lower(): card
    for card in (
        Card("A100-40GB", 40 - RESERVED_GIB, 312, "datasheet"),
        Card("A100-80GB", 80 - RESERVED_GIB, 312, "datasheet"),
        Card("H100", 79.18, 989, "measured memory 2026-11-28 (H100 80GB HBM3), datasheet rate (SXM)"),
        Card("H100-PCIe", 80 - RESERVED_GIB, 756, "datasheet"),
        Card("H200", 139.80, 989, "measured memory 2026-11-27, datasheet rate"),
        Card("L40S", 48e9 / GIB - RESERVED_GIB, 362, "datasheet"),
        Card("L4", 24e9 / GIB - RESERVED_GIB, 121, "datasheet"),
        Card("A10", 24e9 / GIB - RESERVED_GIB, 125, "datasheet"),
    )
}
# A card by its memory alone (a MIG slice, a card not listed): `preflight=20GiB`, `preflight=24GB`.
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(GiB|GB)$", re.IGNORECASE)


def card_named(name: str) -> Card:
    """The card `name` names: one of `CARDS` (any case), or a memory size such as `20GiB` / `24GB`."""
    text = str(name).strip()
    if text.lower() in CARDS:
        return CARDS[text.lower()]
    size = _SIZE.match(text)
    if size:
        gib = float(size.group(1)) * (1 if size.group(2).lower() == "gib" else 1e9 / GIB)
        if gib > 0:
            return Card(text, gib, None, "named by its memory")
    known = ", ".join(card.name for card in CARDS.values())
    raise MedvolError(f"`preflight={text}` names no card: use one of {known}, or a memory size such as 24GiB")


def card_of_device_name(device_name: str) -> Card | None:
    """The listed card a CUDA device name (`torch.cuda.get_device_name`) is, for its rate; None when not listed."""
    name = device_name.upper()
    for key in ("H200", "H100 PCIE", "H100", "A100", "L40S", "L4", "A10"):
        if key in name:
            if key == "A100":
                return CARDS["a100-80gb" if "80GB" in name else "a100-40gb"]
            return CARDS[key.lower().replace(" ", "-")]
    return None
