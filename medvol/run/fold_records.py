"""What a segmentation run's validation leaves on disk, and how predict.py and a sweep's summary find it.

`<run>/validation/fold.json` names the run's fold (null outside a cross-validation), the checkpoint the
validation used, the label settings and the subjects; `<run>/postprocessing.json` (and a sweep's) the
post-processing chosen on the validation predictions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning_modules.segmentation.postprocessing import Postprocessing
from medvol.core.errors import MedvolError

VALIDATION_DIR = "validation"
LABEL_MAPS_DIR = "label_maps"
FOLD_FILE = "fold.json"
POSTPROCESSING_FILE = "postprocessing.json"
SUMMARY_FILE = "cross_validation.json"
VOLUMES_FILE = "structure_volumes.json"


def write_json(path: Path, record: Any) -> None:
    """`record` as JSON at `path`, replaced in one step (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def read_postprocessing(folder: Path) -> Postprocessing:
    """The post-processing recorded in `folder` (a run or a sweep); none where nothing was recorded."""
    path = folder / POSTPROCESSING_FILE
    if not path.is_file():
        return Postprocessing()
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise MedvolError(f"{path}: cannot read the post-processing ({err}); remove the file or restore it") from err
    return Postprocessing.from_json(record, str(path))


def fold_runs(sweep_dir: Path) -> list[tuple[int, Path, dict[str, Any]]]:
    """(fold, run directory, fold record) of every validated cross-validation run in a sweep, by fold."""
    found = []
    for path in sorted(sweep_dir.glob(f"*/{VALIDATION_DIR}/{FOLD_FILE}")):
        record = json.loads(path.read_text())
        if record.get("fold") is not None:
            found.append((int(record["fold"]), path.parent.parent, record))
    folds = [fold for fold, _, _ in found]
    if len(set(folds)) != len(folds):
        raise MedvolError(
            f"{sweep_dir} holds several runs of the same fold ({sorted(folds)}); a sweep cross-validates one "
            "setting: sweep dataset.fold alone, or give predict.py the runs of one setting (ckpt_path=[...])"
        )
    return sorted(found, key=lambda item: item[0])


def fold_checkpoints(run_dir: Path) -> list[str]:
    """The checkpoints of a fold sweep's runs (the ones their validation used), fold by fold."""
    runs = fold_runs(run_dir)
    if not runs:
        raise MedvolError(
            f"`run_dir`: {run_dir} holds no validated cross-validation runs (<run>/validation/fold.json); expected the "
            "folder of a `python train.py -m ... dataset.fold=0,1,2,3,4` sweep"
        )
    return [str(record["checkpoint"]) for _, _, record in runs]


def read_volume_range(folder: Path) -> dict[str, list[float]]:
    """Per structure, the [smallest, largest] volume (ml) of the run's training labels; empty where not recorded."""
    path = folder / VOLUMES_FILE
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    return {name: [float(v["min"]), float(v["max"])] for name, v in record.items()}
