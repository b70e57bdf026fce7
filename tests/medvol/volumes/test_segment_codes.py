"""Segment codes from names, against SNOMED CT's own values written by hand."""

from __future__ import annotations

import pytest

from medvol.core.errors import MedvolError
from medvol.volumes.segment_codes import named_code, segment_coding


@pytest.mark.parametrize(("name", "category", "kind"), [
    ("tumour", "49755003", "108369006"),
    ("Whole tumor", "49755003", "108369006"),
    ("TC", "49755003", "108369006"),
    ("peritumoral oedema", "49755003", "79654002"),
    ("NCR", "49755003", "6574001"),
    ("liver", "91723000", "10200004"),
    ("left kidney", "91723000", "64033007"),
    ("label 7", "85756007", "85756007"),
])
def test_a_segment_named_like_a_common_structure_gets_its_snomed_codes(name, category, kind):
    found = segment_coding(name)
    assert (found[0].value, found[1].value) == (category, kind)
    assert {found[0].scheme_designator, found[1].scheme_designator} == {"SCT"}


def test_the_users_codes_win_and_may_be_any_scheme():
    category, kind = segment_coding("tumour", {"type": "SCT:1240414004:Malignant neoplasm of lung"})
    assert (category.value, kind.value, kind.meaning) == ("49755003", "1240414004", "Malignant neoplasm of lung")
    assert named_code("Liver", "x").value == "10200004"
    assert named_code("99LOCAL:seg-1:My structure", "x").scheme_designator == "99LOCAL"
    with pytest.raises(MedvolError, match=r"`segment_codes.tumour` has 'colour'; expected category and/or type"):
        segment_coding("tumour", {"colour": "red"})
    with pytest.raises(MedvolError, match=r"`k` is 'NoSuchThing'; expected a SNOMED CT keyword"):
        named_code("NoSuchThing", "k")
