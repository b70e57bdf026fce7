"""The one exception type that medvol turns into a single clear line for the user."""

from __future__ import annotations


class MedvolError(ValueError):
    """Bad user input (config value, file, checkpoint): the message names what is wrong and what was expected."""
