"""What a file says is data: read with bounds, walked with bounds, and never evaluated.

Every structure medvol reads back from a file (a run's record and its JSON records, a checkpoint's hyper-parameters
and callback states, an old run's YAML config) passes `check_data` before anything else sees it:

- its size is bounded before it is walked or copied: a pickle or a YAML file can share one list between many
  places (a memo entry, an anchor), so 40 levels of a list holding the same list twice are 2^40 values to anything
  that copies it as a tree (`OmegaConf.create` does). The walk counts values as such a copy would, and stops at
  `MAX_VALUES` or `MAX_DEPTH`;
- no string may hold `${`: OmegaConf evaluates `${...}` wherever a value reaches a config (`${oc.create:...}` builds
  new `_target_` nodes, a resolver can call anything it was registered with), and an escaped `\\${` becomes one
  after a second pass. Nothing medvol writes holds one; a file that does was not written by medvol;
- no integer reaches `MAX_INTEGER` in size: no setting, count or seed needs more than 64 bits, and one of thousands of
  digits costs time wherever it is converted or compared (Python parses at most 4300 digits from text: past that,
  `read_json` / `read_yaml` refuse the file as unparsable).

Every parse or value error of a reader is one line naming the file, cut to `SHOWN` characters: nothing a file holds
reaches the console at a length the file chose.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from medvol.core.errors import MedvolError

# A genuine checkpoint holds a few thousand values outside its tensors (its state dict's keys, the optimizer's
# parameter ids, the hyper-parameters); a run record a few hundred.
MAX_VALUES = 1_000_000
MAX_DEPTH = 48
# A run's records are kilobytes; a config or plan of megabytes was not written by medvol.
MAX_RECORD_BYTES = 16 * 1024**2
INTERPOLATION = "${"
MAX_INTEGER = 2**64
# The most characters of a value, a key or a parser's message a refusal shows.
SHOWN = 120
SCALARS = (str, int, float, bool, type(None))


def _key(path: list[Any]) -> str:
    shown = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            shown += f"[{part}]" if abs(part) < MAX_INTEGER else "[...]"
        else:
            shown += f".{part}" if shown else str(part)
    return cut(shown) or "<root>"


def cut(text: str, length: int = SHOWN) -> str:
    """`text` at most `length` characters long (its start, then `...`)."""
    return text if len(text) <= length else text[: length - 3] + "..."


def check_data(value: Any, source: str | Path, tensors: bool = False, interpolations: bool = False) -> Any:
    """`value` unchanged once it is plain data: dicts with string (or, in checkpoints, integer) keys, lists,
    tuples, numbers, strings, booleans and None, tensors where `tensors`, at most `MAX_DEPTH` deep and `MAX_VALUES`
    values counted as a copy counts them, and no string holding `${` (unless `interpolations`: an old run's config,
    whose interpolations `medvol.run.run_record` checks itself). Else one `MedvolError` line naming `source` and
    the key."""
    seen = 0
    stack: list[tuple[Any, list[Any]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise MedvolError(
                f"{source}: holds more than {MAX_VALUES:,} values (counting a value shared between places once per "
                "place, as a copy does); a file medvol writes holds far fewer: refused before it is copied"
            )
        if len(path) > MAX_DEPTH:
            raise MedvolError(
                f"{source}: `{_key(path[:8])}...` nests deeper than {MAX_DEPTH} levels; a file medvol writes nests a "
                "few levels: refused"
            )
        if isinstance(item, str):
            if INTERPOLATION in item and not interpolations:
                raise MedvolError(
                    f"{source}: `{_key(path)}` holds an interpolation ({cut(item, 60)!r}); values read from a file are "
                    "data and are never evaluated, and medvol writes none: refused"
                )
        elif isinstance(item, dict):
            for name, member in item.items():
                if not isinstance(name, (str, int)) or isinstance(name, bool):
                    raise MedvolError(
                        f"{source}: `{_key(path)}` has a key of type {type(name).__name__}; expected text"
                    )
                stack.append((name, [*path, "<key>"]))
                stack.append((member, [*path, name]))
        elif isinstance(item, (list, tuple)):
            stack.extend((member, [*path, index]) for index, member in enumerate(item))
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) >= MAX_INTEGER:
            # Counted from the bits: formatting the digits of a huge number is itself the cost refused here.
            digits = math.floor(item.bit_length() * math.log10(2)) + 1
            digits -= abs(item) < 10 ** (digits - 1)
            raise MedvolError(
                f"{source}: `{_key(path)}` is an integer of {digits} digits; no setting medvol reads needs more than "
                "64 bits: refused"
            )
        elif isinstance(item, float) or type(item) in SCALARS:
            continue
        elif isinstance(item, (int, bool)) or (tensors and isinstance(item, torch.Tensor)):
            continue
        elif tensors and isinstance(item, (complex, bytes)):
            continue
        else:
            raise MedvolError(
                f"{source}: `{_key(path)}` is a {type(item).__name__}; expected plain values (numbers, text, lists, "
                "mappings)"
            )
    return value


def _bounded_text(path: Path, what: str) -> str:
    try:
        size = path.stat().st_size
    except OSError as err:
        raise MedvolError(f"{path}: cannot read {what} ({err.strerror})") from None
    if size > MAX_RECORD_BYTES:
        raise MedvolError(
            f"{path}: {what} is {size / 1024**2:.3g} MiB; a file medvol writes is kilobytes (at most "
            f"{MAX_RECORD_BYTES // 1024**2} MiB read): refused before reading it"
        )
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise MedvolError(f"{path}: cannot read {what} ({err})") from None


def read_json(path: Path, what: str) -> Any:
    """The JSON file at `path` as plain data (`check_data`), else one `MedvolError` line saying what it should be."""
    text = _bounded_text(path, what)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as err:
        # ValueError: malformed JSON (JSONDecodeError), and an integer past Python's 4300 digits.
        raise _unparsable(path, what, err) from None
    return check_data(value, path)


def _unparsable(path: Path, what: str, err: BaseException) -> MedvolError:
    reason = "nests too deep" if isinstance(err, RecursionError) else (str(err).strip().splitlines() or [""])[0]
    if "integer string conversion" in reason:
        # Python's own line advises raising its limit: the number is refused, not the limit.
        reason = f"an integer of more than {sys.get_int_max_str_digits()} digits; no setting needs more than 64 bits"
    return MedvolError(f"{path}: is not {what} ({cut(reason)})")


def read_yaml(path: Path, what: str, interpolations: bool = False) -> Any:
    """The YAML file at `path` as plain data (safe loader: no tags that build objects; anchors bounded by
    `check_data`, as are interpolations unless `interpolations`), else one `MedvolError` line."""
    text = _bounded_text(path, what)
    try:
        value = yaml.load(text, Loader=yaml.CSafeLoader if hasattr(yaml, "CSafeLoader") else yaml.SafeLoader)
    except (yaml.YAMLError, ValueError, RecursionError) as err:
        raise _unparsable(path, what, err) from None
    return check_data(value, path, interpolations=interpolations)


def finite_number(value: Any) -> bool:
    """Whether `value` is an int or float (not a bool) with a finite value."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
