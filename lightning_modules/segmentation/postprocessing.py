"""Keeping the largest connected component of a structure, and nnU-Net's rule for when to keep it.

Post-processing works on label maps, as nnU-Net's does (`remove_all_but_largest_component_from_segmentation`):
a step names label values; the voxels holding any of them form one mask, and every 26-connected component of
that mask but the largest goes to the background. The steps are tried on the validation predictions of every
fold (`choose`): first all foreground values as one mask, kept where it raises the mean foreground Dice and
lowers no structure's; then each class or region on top of what was kept, each kept where it raises that
structure's mean Dice. The decision is a list of steps, recorded as JSON and applied in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import ndimage

from lightning_modules.segmentation.label_scheme import LabelScheme
from medvol.core.errors import MedvolError

# 26-connectivity (every voxel sharing a face, an edge or a corner), nnU-Net's and MONAI's default in 3D.
NEIGHBOURS = np.ones((3, 3, 3), dtype=bool)
ALL_FOREGROUND = "all foreground"


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
    """The steps chosen: (name, label values) each, applied in order to a (D, H, W) label map."""

    steps: tuple[tuple[str, tuple[int, ...]], ...] = ()
    scores: dict[str, Any] = field(default_factory=dict, compare=False)

    def __call__(self, label_map: np.ndarray) -> np.ndarray:
        for _, values in self.steps:
            label_map = keep_largest(label_map, values)
        return label_map

    def describe(self) -> str:
        """One line for the console."""
        if not self.steps:
            return "post-processing: none (keeping the largest component raised no Dice on the validation folds)"
        kept = ", ".join(name for name, _ in self.steps)
        return f"post-processing: the largest connected component of {kept}"

    def to_json(self) -> dict[str, Any]:
        return {"steps": [{"name": n, "values": list(v)} for n, v in self.steps], **self.scores}

    @classmethod
    def from_json(cls, record: Any, where: str) -> Postprocessing:
        steps = record.get("steps") if isinstance(record, dict) else None
        if not isinstance(steps, list) or not all(
            isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("values"), list)
            and all(isinstance(v, int) for v in s["values"]) for s in steps
        ):
            raise MedvolError(f"{where}: expected {{'steps': [{{'name': ..., 'values': [ints]}}, ...]}}")
        return cls(tuple((s["name"], tuple(s["values"])) for s in steps))


def candidates(scheme: LabelScheme) -> tuple[tuple[int, ...], list[tuple[str, tuple[int, ...]]]]:
    """The label values of all foreground, and of each scored structure (a class's own, a region's members)."""
    if scheme.is_regions:
        per_structure = [(name, tuple(members)) for name, members in scheme.regions.items()]
    else:
        per_structure = [(name, (k,)) for k, name in enumerate(scheme.class_names, start=1)]
    every = tuple(sorted({v for _, values in per_structure for v in values}))
    return every, per_structure


def label_map_dice(scheme: LabelScheme, prediction: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Dice per scored structure of two label maps (an empty prediction of an empty truth scores 1)."""
    scores = []
    for _, values in candidates(scheme)[1]:
        predicted, expected = np.isin(prediction, values), np.isin(truth, values)
        total = int(predicted.sum()) + int(expected.sum())
        scores.append(1.0 if total == 0 else 2.0 * int((predicted & expected).sum()) / total)
    return np.asarray(scores)


def choose(
    scheme: LabelScheme, cases: Sequence[Callable[[], tuple[np.ndarray, np.ndarray]]],
    dice: Callable[[LabelScheme, np.ndarray, np.ndarray], np.ndarray] = label_map_dice,
) -> Postprocessing:
    """nnU-Net's rule on the validation subjects of every fold: `cases` load each one's (prediction, reference)
    label maps, read again for every trial so that only one subject is in memory at a time."""
    if not cases:
        raise MedvolError("post-processing: no validation predictions to choose it on")
    every, per_structure = candidates(scheme)
    names = [name for name, _ in per_structure]

    def mean_dice(steps: list[tuple[str, tuple[int, ...]]]) -> np.ndarray:
        chosen = Postprocessing(tuple(steps))
        return np.mean([dice(scheme, chosen(p), t) for p, t in (load() for load in cases)], axis=0)

    steps: list[tuple[str, tuple[int, ...]]] = []
    baseline = best = mean_dice(steps)
    trial = mean_dice([(ALL_FOREGROUND, every)])
    if trial.mean() > best.mean() and bool(np.all(trial >= best)):
        steps, best = [(ALL_FOREGROUND, every)], trial
    if len(per_structure) > 1:
        for index, step in enumerate(per_structure):
            trial = mean_dice([*steps, step])
            if trial[index] > best[index]:
                steps, best = [*steps, step], trial
    scores = {
        "dice_before": dict(zip(names, baseline.round(6).tolist(), strict=True)),
        "dice_after": dict(zip(names, best.round(6).tolist(), strict=True)),
        "subjects": len(cases),
    }
    return Postprocessing(tuple(steps), scores)
