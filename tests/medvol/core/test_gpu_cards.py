"""The cards a preflight is held against (`preflight=H100`, a memory size, or the device torch names)."""

from __future__ import annotations

import pytest

from medvol.core.errors import MedvolError
from medvol.core.gpu_cards import CARDS, GIB, card_named, card_of_device_name


def test_a_card_is_named_in_any_case_and_the_rounds_cards_hold_what_torch_reported():
    assert card_named("h100") is card_named("H100") is CARDS["h100"]
    # The 2026-11-28 round's H100 and the 2026-11-27 round's H200, as torch.cuda reported their memory.
    assert card_named("H100").memory_gib == pytest.approx(79.18, abs=0.01)
    assert card_named("H200").memory_gib == pytest.approx(139.80, abs=0.01)


@pytest.mark.parametrize(("text", "gib"), [("24GiB", 24.0), ("20GB", 20e9 / GIB), ("0.5 gib", 0.5)])
def test_a_card_may_be_named_by_its_memory(text, gib):
    card = card_named(text)
    assert card.memory_gib == pytest.approx(gib) and card.name == text


@pytest.mark.parametrize("text", ["H900", "0GiB", "-3GB", "24", ""])
def test_a_name_that_is_no_card_is_one_line_listing_the_cards(text):
    refusal = r"names no card: use one of A100-40GB, .*H100, .*, or a memory size such as 24GiB$"
    with pytest.raises(MedvolError, match=refusal):
        card_named(text)


@pytest.mark.parametrize(("device", "card"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb"), ("NVIDIA L40S", "l40s"),
    ("NVIDIA L4", "l4"), ("NVIDIA A10", "a10"), ("Tesla T4", None),
])
def test_a_device_name_is_the_listed_card_it_is(device, card):
    found = card_of_device_name(device)
    assert (found is None and card is None) or found is CARDS[card]
