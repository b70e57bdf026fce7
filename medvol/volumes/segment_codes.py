"""What a DICOM-SEG segment is, in SNOMED CT codes: its category (tissue, anatomical structure, morphologically
abnormal structure) and its type (tumour, oedema, liver, ...), from the segment's name or the user's choice.

A PACS groups, colours and searches segments by these codes, not by their free-text labels, so a tumour coded
as "Tissue / Tissue" is lost among tissues. A segment named like a common structure gets its code: tumour
words (tumour, neoplasm, glioma, the BraTS regions WT/TC/ET, enhancing ...) a neoplasm, oedema and necrosis
their own, an organ named as SNOMED names it (liver, left kidney: kidney) that organ; anything else stays
"Tissue / Tissue". `segment_codes` (`name: {category: ..., type: ...}`) sets any segment's codes, each as
a SNOMED CT keyword pydicom knows (`Neoplasm`, `Liver`) or `SCHEME:value:meaning` (`SCT:108369006:Neoplasm`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydicom.sr.codedict import codes
from pydicom.sr.coding import Code

from medvol.core.errors import MedvolError

TISSUE = codes.SCT.Tissue
ANATOMY = codes.SCT.AnatomicalStructure
ABNORMAL = codes.SCT.MorphologicallyAbnormalStructure
# Words of a segment's name -> its type (category: morphologically abnormal structure), first match wins.
ABNORMAL_WORDS = (
    (("oedema", "edema", "ed"), codes.SCT.Edema),
    (("necrosis", "necrotic", "ncr", "net"), codes.SCT.Necrosis),
    (("cyst",), codes.SCT.Cyst),
    (("nodule",), codes.SCT.Nodule),
    (("lesion",), codes.SCT.Lesion),
    (("mass",), codes.SCT.Mass),
    (("tumour", "tumor", "neoplasm", "cancer", "carcinoma", "glioma", "metastasis", "wt", "tc", "et", "enhancing",
      "core"), codes.SCT.Neoplasm),
)
KEY = "segment_codes"


def _words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", name.lower())


def _anatomy(name: str) -> Code | None:
    """The SNOMED CT code pydicom names like `name` (`pancreas` -> Pancreas), if it is one; a side (`left kidney`)
    is dropped where the structure has no sided code (DICOM states laterality apart from the structure)."""
    words = _words(name)
    for kept in (words, [w for w in words if w not in ("left", "right")]):
        keyword = "".join(word.capitalize() for word in kept)
        try:
            return getattr(codes.SCT, keyword) if keyword else None
        except AttributeError:
            continue
    return None


def named_code(value: Any, key: str) -> Code:
    """A code given as a SNOMED CT keyword (`Neoplasm`) or as `SCHEME:value:meaning`."""
    text = str(value)
    parts = text.split(":", 2)
    if len(parts) == 3 and all(p.strip() for p in parts):
        return Code(parts[1].strip(), parts[0].strip(), parts[2].strip())
    try:
        return getattr(codes.SCT, text)
    except AttributeError:
        raise MedvolError(
            f"`{key}` is {text!r}; expected a SNOMED CT keyword pydicom knows (e.g. Neoplasm, Liver, Tissue) or "
            "SCHEME:value:meaning (e.g. SCT:108369006:Neoplasm)"
        ) from None


def segment_coding(name: str, given: Mapping[str, Any] | None = None) -> tuple[Code, Code]:
    """(category, type) of the segment `name`: the user's (`given`: category and/or type), else from its name."""
    words = set(_words(name))
    category, kind = TISSUE, TISSUE
    found = next((code for names, code in ABNORMAL_WORDS if words & set(names)), None)
    organ = _anatomy(name)
    if found is not None:
        category, kind = ABNORMAL, found
    elif organ is not None and organ not in (TISSUE, ANATOMY, ABNORMAL):
        category, kind = ANATOMY, organ
    given = given or {}
    unknown = sorted(set(given) - {"category", "type"})
    if unknown:
        raise MedvolError(f"`{KEY}.{name}` has {unknown[0]!r}; expected category and/or type")
    if "category" in given:
        category = named_code(given["category"], f"{KEY}.{name}.category")
    if "type" in given:
        kind = named_code(given["type"], f"{KEY}.{name}.type")
    return category, kind
