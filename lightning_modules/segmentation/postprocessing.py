"""Keeping the largest connected component of a structure, and nnU-Net's rule for when to keep it.

Post-processing works on label maps, as nnU-Net's does (`remove_all_but_largest_component_from_segmentation`):
a step names label values; the voxels holding any of them form one mask, and every 26-connected component of
that mask but the largest goes to the background. The steps are tried on the validation predictions of every
fold (`choose`): first all foreground values as one mask, kept where it raises the mean foreground Dice and
lowers no structure's; then each class or region on top of what was kept, each kept where it raises that
structure's mean Dice. The decision is a list of steps, recorded as JSON with the number of folds it was chosen on
and applied in order. As nnU-Net (`nnUNetv2_determine_postprocessing` on the cross-validation folds), a decision
applies by default only where it was chosen on two folds or more: on one split's 4-7 validation subjects, dropping
all but the largest component can remove true lesions (`medvol.run.fold_records.applied_postprocessing`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import ndimage

from lightning_modules.segmentation.label_scheme import MAX_CLASSES, LabelScheme
from medvol.core.errors import MedvolError
from medvol.core.file_data import cut

# 26-connectivity (every voxel sharing a face, an edge or a corner), nnU-Net's and MONAI's default in 3D.
NEIGHBOURS = np.ones((3, 3, 3), dtype=bool)
ALL_FOREGROUND = "all foreground"
# `model.postprocessing` / predict.py's `postprocessing`: which recorded decision applies.
POSTPROCESSING_SWITCHES = ("auto", True, False)
# A recorded decision holds a step per structure and one for all foreground at most (`choose`); 1024 structures is
# past any dataset medvol has met (TotalSegmentator's 117), and each step is a pass over every label map.
MAX_STEPS = 1025
# A structure's name, as dataset.json gives it and the console shows it.
MAX_NAME = 200


def keep_largest(label_map: np.ndarray, values: Sequence[int]) -> np.ndarray:
    """`label_map` with the voxels of `values` outside their largest connected component set to 0 (a copy)."""
    mask = np.isin(label_map, list(values))
    components, count = ndimage.label(mask, structure=NEIGHBOURS)
    if count <= 1:
        return label_map.copy()
    sizes = np.bincount(components.ravel())
    sizes[0] = 0
    out = label_map.copy()
    out[mask & (components != int(sizes.argmax()))] = 0
    return out


@dataclass(frozen=True)
class Postprocessing:
    """The steps chosen: (name, label values) each, applied in order to a (D, H, W) label map; `folds`: how many
    cross-validation folds' validation predictions it was chosen on (1: one run's validation split)."""

    steps: tuple[tuple[str, tuple[int, ...]], ...] = ()
    scores: dict[str, Any] = field(default_factory=dict, compare=False)
    folds: int = field(default=1, compare=False)

    def __call__(self, label_map: np.ndarray) -> np.ndarray:
        for _, values in self.steps:
            label_map = keep_largest(label_map, values)
        return label_map

    def describe(self) -> str:
        """One line for the console."""
        if not self.steps:
            return "post-processing: none (keeping the largest component raised no Dice on the validation folds)"
        return f"post-processing: the largest connected component of {self.kept()}"

    def kept(self) -> str:
        """The structures whose largest component is kept, for a line of text."""
        return cut(", ".join(name for name, _ in self.steps), 300) or "none"

    def to_json(self) -> dict[str, Any]:
        return {"steps": [{"name": n, "values": list(v)} for n, v in self.steps], "folds": self.folds, **self.scores}

    @classmethod
    def from_json(cls, record: Any, where: str, folds: int = 1) -> Postprocessing:
        """A recorded decision; `folds` where the record does not say (one written before it did)."""
        steps = record.get("steps") if isinstance(record, dict) else None
        if not isinstance(steps, list) or not all(
            isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("values"), list)
            and all(isinstance(v, int) for v in s["values"]) for s in steps
        ):
            raise MedvolError(f"{where}: expected {{'steps': [{{'name': ..., 'values': [ints]}}, ...]}}")
        _check_steps(steps, where)
        recorded = record.get("folds", folds)
        if isinstance(recorded, bool) or not isinstance(recorded, int) or not 1 <= recorded <= 1000:
            raise MedvolError(
                f"{where}: `folds` is {recorded!r}; expected the number of folds it was chosen on (1-1000)"
            )
        return cls(tuple((s["name"], tuple(s["values"])) for s in steps), folds=recorded)


def _check_steps(steps: list[dict[str, Any]], where: str) -> None:
    """Refuse in one line steps no run chose (`choose`: a step per structure and one for all foreground, each named
    once, each a set of label values), before any is applied or shown."""
    if len(steps) > MAX_STEPS:
        raise MedvolError(
            f"{where}: {len(steps):,} steps; a post-processing holds a step per structure and one for all foreground, "
            f"at most {MAX_STEPS}: refused"
        )
    seen: set[str] = set()
    for index, step in enumerate(steps):
        name, values = step["name"], step["values"]
        if len(name) > MAX_NAME:
            raise MedvolError(f"{where}: `steps[{index}].name` is longer than {MAX_NAME} characters: refused")
        if name in seen:
            raise MedvolError(f"{where}: `steps[{index}]`: {name!r} is named twice; a run chooses each structure once")
        seen.add(name)
        if not values or len(set(values)) != len(values) or len(values) > MAX_CLASSES or not all(
            1 <= v <= MAX_CLASSES for v in values
        ):
            raise MedvolError(
                f"{where}: `steps[{index}].values` expected distinct label values, each 1-{MAX_CLASSES} (got "
                f"{len(values):,} values)"
            )


def candidates(scheme: LabelScheme) -> tuple[tuple[int, ...], list[tuple[str, tuple[int, ...]]]]:
    """The label values of all foreground, and of each scored structure (a class's own, a region's members)."""
    if scheme.is_regions:
        per_structure = [(name, tuple(members)) for name, members in scheme.regions.items()]
    else:
        per_structure = [(name, (k,)) for k, name in enumerate(scheme.class_names, start=1)]
    every = tuple(sorted({v for _, values in per_structure for v in values}))
    return every, per_structure


def label_map_dice(scheme: LabelScheme, prediction: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Dice per scored structure of two label maps; NaN for a structure absent from both (left out of the means, as
    nnU-Net's `compute_metrics` and the training metrics); voxels of the ignore label in `truth` left out."""
    scores = []
    annotated = truth != scheme.ignore_label if scheme.ignore_label is not None else True
    for _, values in candidates(scheme)[1]:
        predicted, expected = np.isin(prediction, values) & annotated, np.isin(truth, values) & annotated
        total = int(predicted.sum()) + int(expected.sum())
        scores.append(float("nan") if total == 0 else 2.0 * int((predicted & expected).sum()) / total)
    return np.asarray(scores)


def nan_mean(rows: Sequence[np.ndarray] | np.ndarray, axis: int | None = None) -> np.ndarray:
    """The mean leaving NaN out (nnU-Net's `np.nanmean`); NaN, without a warning, where every entry is NaN."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(rows, axis=axis)


def at_least(trial: np.ndarray, best: np.ndarray) -> bool:
    """Every structure's Dice as high as before (a structure NaN in both, absent everywhere, counts as unchanged)."""
    return bool(np.all((trial >= best) | (np.isnan(trial) & np.isnan(best))))


def choose(
    scheme: LabelScheme, cases: Sequence[Callable[[], tuple[np.ndarray, np.ndarray]]],
    dice: Callable[[LabelScheme, np.ndarray, np.ndarray], np.ndarray] = label_map_dice, folds: int = 1,
) -> Postprocessing:
    """nnU-Net's rule on the validation subjects of `folds` folds: `cases` load each one's (prediction, reference)
    label maps, read again for every trial so that only one subject is in memory at a time."""
    if not cases:
        raise MedvolError("post-processing: no validation predictions to choose it on")
    every, per_structure = candidates(scheme)
    names = [name for name, _ in per_structure]

    def mean_dice(steps: list[tuple[str, tuple[int, ...]]]) -> np.ndarray:
        chosen = Postprocessing(tuple(steps))
        return nan_mean([dice(scheme, chosen(p), t) for p, t in (load() for load in cases)], axis=0)

    steps: list[tuple[str, tuple[int, ...]]] = []
    baseline = best = mean_dice(steps)
    trial = mean_dice([(ALL_FOREGROUND, every)])
    if nan_mean(trial) > nan_mean(best) and at_least(trial, best):
        steps, best = [(ALL_FOREGROUND, every)], trial
    if len(per_structure) > 1:
        for index, step in enumerate(per_structure):
            trial = mean_dice([*steps, step])
            if trial[index] > best[index]:
                steps, best = [*steps, step], trial
    scores = {
        "dice_before": dict(zip(names, finite_or_none(baseline), strict=True)),
        "dice_after": dict(zip(names, finite_or_none(best), strict=True)),
        "subjects": len(cases),
    }
    return Postprocessing(tuple(steps), scores, folds)


def finite_or_none(scores: np.ndarray) -> list[float | None]:
    """Rounded scores for JSON: null for a structure absent from every subject (NaN is not JSON)."""
    return [None if np.isnan(v) else round(float(v), 6) for v in scores]


def postprocessing_switch(value: Any, key: str) -> str | bool:
    """`value` checked as a post-processing switch: auto, true or false."""
    if value not in POSTPROCESSING_SWITCHES or (not isinstance(value, bool) and value != "auto"):
        raise MedvolError(
            f"`{key}` is {value!r}; expected auto (a post-processing chosen on cross-validation folds applies), true "
            "(the recorded one applies, also one chosen on a single validation split) or false (none)"
        )
    return value
