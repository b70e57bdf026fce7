"""Subject-level train/val/test split, reproducible from a seed and recorded as `split.json`."""

from __future__ import annotations

import json
import logging
import os
import random
from collections import Counter
from collections.abc import Hashable, Sequence
from pathlib import Path

from medvol.core.errors import MedvolError
from medvol.core.file_data import read_json

STAGES = ("train", "val", "test")
log = logging.getLogger("medvol")
# Below these a validation or test split's metric says little: a Dice or accuracy over a handful of subjects, a C-index
# over a handful of events (40 subjects at 10%/10% gave a test C-index of 0.33, then 0.17 on a rerun).
FEW_SUBJECTS = 10
FEW_EVENTS = 5


def small_split_warnings(
    split: dict[str, list[str]], events: dict[str, bool] | None = None
) -> list[str]:
    """A line per validation or test split too small for its metric to mean much: under `FEW_SUBJECTS` subjects, or
    with `events` (subject -> whether the event was seen: survival) under `FEW_EVENTS` events."""
    lines = []
    for name in ("val", "test"):
        members = split.get(name) or []
        if not members:
            continue
        seen = sum(bool(events.get(s)) for s in members) if events is not None else None
        if len(members) < FEW_SUBJECTS or (seen is not None and seen < FEW_EVENTS):
            what = f"{len(members)} subjects" + (f" and {seen} events" if seen is not None else "")
            limit = f"under {FEW_SUBJECTS} subjects" + (f" or {FEW_EVENTS} events" if seen is not None else "")
            lines.append(
                f"the {name} split holds {what} ({limit}): its metric will swing from split to split and its best "
                f"checkpoint by chance; more subjects, a larger `dataset.{name}_fraction` or cross-validation "
                "(`-m dataset.fold=0,1,2,3,4`) give one that means something"
            )
    return lines


def make_split(
    subjects: Sequence[str],
    val_fraction: float,
    test_fraction: float,
    seed: int,
    strata: Sequence[Hashable] | None = None,
    events: Sequence[bool] | None = None,
) -> dict[str, list[str]]:
    """Shuffle unique subject ids with `seed` and cut them into train/val/test; warn where a validation or test split
    is too small for its metric (`small_split_warnings`; `events`, one per subject, for survival).

    Every non-zero fraction gets at least one subject, as long as train keeps one. With `strata`
    (one value per subject, e.g. its class), every split takes each stratum's share of its
    subjects, to within one: the shuffled subjects are ordered by how far into their own stratum
    they come, then cut (systematic sampling), so a small validation set still holds every class.
    """
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= value < 1.0:
            raise MedvolError(f"`dataset.{name}` must be in [0, 1), got {value}")
    if val_fraction + test_fraction >= 1.0:
        raise MedvolError(
            f"`dataset.val_fraction` + `dataset.test_fraction` must be < 1, got {val_fraction} + {test_fraction}"
        )
    unique = sorted(set(subjects))
    if len(unique) != len(subjects):
        raise MedvolError("subject ids must be unique; the dataset lists some subjects twice")
    order = unique[:]
    random.Random(seed).shuffle(order)
    if strata is not None:
        stratum = dict(zip(subjects, strata, strict=True))
        sizes = Counter(stratum.values())
        seen: Counter[Hashable] = Counter()
        depth = {}
        for subject in order:
            depth[subject] = (seen[stratum[subject]] + 0.5) / sizes[stratum[subject]]
            seen[stratum[subject]] += 1
        order.sort(key=depth.__getitem__)  # stable: ties keep the shuffled order
    n = len(order)

    def count(fraction: float) -> int:
        return 0 if fraction == 0 else max(1, round(fraction * n))

    n_val, n_test = count(val_fraction), count(test_fraction)
    if n - n_val - n_test < 1:
        raise MedvolError(
            f"{n} subjects are too few for val_fraction={val_fraction} and test_fraction={test_fraction}; "
            "at least one subject must remain for training"
        )
    split = {
        "val": sorted(order[:n_val]),
        "test": sorted(order[n_val : n_val + n_test]),
        "train": sorted(order[n_val + n_test :]),
    }
    seen = dict(zip(subjects, (bool(e) for e in events), strict=True)) if events is not None else None
    for line in small_split_warnings(split, seen):
        log.warning("split: %s", line)
    return split


def make_folds(
    subjects: Sequence[str], num_folds: int, seed: int, strata: Sequence[Hashable] | None = None
) -> list[list[str]]:
    """Cut `subjects` (the training and validation subjects of a split; never its test subjects) into
    `num_folds` folds for cross-validation: shuffled with `seed`, then dealt out in turn, so the folds differ
    in size by at most one and, with `strata` (one value per subject), each holds every stratum's share to
    within one. Every subject lands in exactly one fold: the fold it is validated in."""
    if not isinstance(num_folds, int) or isinstance(num_folds, bool) or num_folds < 2:
        raise MedvolError(f"`dataset.num_folds` is {num_folds!r}; expected a whole number >= 2")
    unique = sorted(set(subjects))
    if len(unique) < num_folds:
        raise MedvolError(
            f"{len(unique)} training and validation subjects are too few for {num_folds} folds; "
            "lower `dataset.num_folds` or add subjects"
        )
    order = unique[:]
    random.Random(seed).shuffle(order)
    if strata is not None:
        stratum = dict(zip(subjects, strata, strict=True))
        groups: dict[Hashable, list[str]] = {}
        for subject in order:
            groups.setdefault(stratum[subject], []).append(subject)
        order = [s for key in sorted(groups, key=str) for s in groups[key]]
    return [sorted(order[k::num_folds]) for k in range(num_folds)]


def fold_split(split: dict[str, list[str]], folds: list[list[str]], fold: int) -> dict[str, list[str]]:
    """The split of one cross-validation fold: that fold validates, the others train, the test split stays."""
    if not isinstance(fold, int) or isinstance(fold, bool) or not 0 <= fold < len(folds):
        raise MedvolError(f"`dataset.fold` is {fold!r}; expected null or a fold index 0..{len(folds) - 1}")
    return {
        "val": list(folds[fold]),
        "test": list(split["test"]),
        "train": sorted(s for k, members in enumerate(folds) if k != fold for s in members),
    }


def load_split(path: Path, subjects: Sequence[str]) -> dict[str, list[str]]:
    """Read a recorded split and check it still matches the dataset."""
    split = read_json(path, "a split (JSON with train/val/test lists)")
    if not isinstance(split, dict) or any(not isinstance(split.get(s), list) for s in STAGES):
        raise MedvolError(f"`dataset.split_file`: {path} must hold lists under 'train', 'val' and 'test'")
    listed = [s for stage in STAGES for s in split[stage]]
    if len(set(listed)) != len(listed):
        raise MedvolError(f"`dataset.split_file`: {path} puts a subject in more than one split (leakage)")
    unknown = sorted(set(listed) - set(subjects))
    if unknown:
        raise MedvolError(
            f"`dataset.split_file`: {path} lists subjects the dataset does not have (first: {unknown[:3]}); "
            "the data changed since the split was made: remove the file or point to the original data"
        )
    return {stage: list(split[stage]) for stage in STAGES}


def load_folds(path: Path, fold: int | None) -> list[list[str]] | None:
    """The folds a split file records (a cross-validation run's), checked against `dataset.fold`."""
    record = read_json(path, "a split (JSON with train/val/test lists)")
    folds, recorded = (record.get("folds"), record.get("fold")) if isinstance(record, dict) else (None, None)
    if fold is None and folds is None:
        return None
    if not (isinstance(folds, list) and all(isinstance(f, list) and all(isinstance(s, str) for s in f) for f in folds)):
        raise MedvolError(f"`dataset.split_file`: {path} records no folds as lists of subject ids; expected a split "
                          "written by a cross-validation run (dataset.fold=...)")
    if recorded != fold:
        held = "a split without folds" if recorded is None else f"the split of fold {recorded}"
        raise MedvolError(
            f"`dataset.fold` is {fold}, but {path} records {held}; a run keeps its split: resume with the same "
            "dataset.fold, or start a new run"
        )
    return [list(members) for members in folds]


def save_split(
    path: Path, split: dict[str, list[str]], seed: int, folds: list[list[str]] | None = None, fold: int | None = None
) -> None:
    """Record the split (and, for a cross-validation run, every fold and the one this run validates on)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    extra = {"fold": fold, "folds": folds} if folds is not None else {}
    tmp.write_text(json.dumps({"seed": seed, **extra, **split}, indent=2) + "\n")
    os.replace(tmp, path)
