"""`build(node)`: Hydra's instantiate, but a `MedvolError` raised by a constructor reaches the user as itself."""

from __future__ import annotations

from typing import Any

import hydra
from hydra.errors import InstantiationException

from medvol.errors import MedvolError


def build(node: Any, **kwargs: Any) -> Any:
    """Instantiate a `_target_` config; unwrap Hydra's wrapper around medvol's one-line user errors."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        while cause is not None and not isinstance(cause, MedvolError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise
