"""Names that come from a dataset (its label names, its channels) placed into a config stay text.

OmegaConf reads `${...}` in any string of a config as an interpolation, and `${oc.create:...}` builds new nodes that
Hydra would instantiate: a dataset.json whose label is named `${oc.create:{_target_: ...}}` would run code once the
names reach the run's config. A name from data holds no `${`; one that does is refused in one line before it is placed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from medvol.core.errors import MedvolError
from medvol.core.file_data import INTERPOLATION


def literal_names(names: Iterable[Any], source: str) -> list[str]:
    """`names` as a list of text, each free of `${`; else one `MedvolError` line naming `source` and the name."""
    checked = []
    for name in names:
        text = str(name)
        if INTERPOLATION in text:
            raise MedvolError(
                f"{source}: the name {text[:60]!r} holds `${{`, which a config would evaluate; expected a plain name "
                "(letters, digits, spaces, punctuation other than `${`)"
            )
        checked.append(text)
    return checked
