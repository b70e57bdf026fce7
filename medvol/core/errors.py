"""The one exception type that medvol turns into a single clear line for the user."""

from __future__ import annotations


class MedvolError(ValueError):
    """Bad user input (config value, file, checkpoint): the message names what is wrong and what was expected."""


def refusal_within(err: BaseException) -> MedvolError | None:
    """The `MedvolError` a library wrapped `err` around (Hydra's instantiate, MONAI's `applying transform ...`),
    following its causes; None where there is none."""
    cause: BaseException | None = err
    for _ in range(10):
        if cause is None or isinstance(cause, MedvolError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def failure_reason(err: BaseException) -> str:
    """A subject's failure in one line: medvol's own refusal, else the exception's type and first line."""
    if isinstance(err, MedvolError):
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__
