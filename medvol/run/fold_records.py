"""What a segmentation run's validation leaves on disk, and how predict.py and a sweep's summary find it.

`<run>/validation/fold.json` names the run's fold (null outside a cross-validation), the checkpoint the
validation used, the label settings and the subjects; `<run>/postprocessing.json` (and a sweep's) the
post-processing chosen on the validation predictions, with the number of folds it was chosen on. Which
decision applies (`applied_postprocessing`): by default (`auto`) only one chosen on cross-validation folds, as
nnU-Net; a single split's is written, and applied only when asked (`postprocessing=true`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lightning_modules.segmentation.postprocessing import Postprocessing
from medvol.core.errors import MedvolError
from medvol.core.file_data import read_json
from medvol.core.run_files import replace_in

VALIDATION_DIR = "validation"
LABEL_MAPS_DIR = "label_maps"
FOLD_FILE = "fold.json"
POSTPROCESSING_FILE = "postprocessing.json"
SUMMARY_FILE = "cross_validation.json"
VOLUMES_FILE = "structure_volumes.json"


def write_json(path: Path, record: Any, root: Path | None = None) -> None:
    """`record` as JSON at `path`, replaced in one step (a reader never sees half a file); a link in place of the file
    or of a folder below `root` (default: its folder) is refused (`medvol.core.run_files`)."""
    replace_in(root or path.parent, path, lambda handle: handle.write(json.dumps(record, indent=2) + "\n"))


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FoldLabels(_Record):
    num_classes: Annotated[int, Field(ge=1, le=1024)]
    regions: dict[str, list[Annotated[int, Field(ge=0, le=10**6)]]] | None
    class_names: list[Annotated[str, Field(max_length=256)]] | None
    threshold: Annotated[float, Field(allow_inf_nan=False)] | None
    ignore_label: Annotated[int, Field(ge=1, le=2**16)] | None = None


class FoldRecord(_Record):
    """`<run>/validation/fold.json`: the fold (null outside a cross-validation), the validated checkpoint (inside the
    run), the label settings and the validation subjects."""

    fold: Annotated[int, Field(ge=0, le=1000)] | None
    checkpoint: Annotated[str, Field(max_length=4096)]
    labels: FoldLabels
    subjects: list[Annotated[str, Field(max_length=4096, pattern=r"^[^/\\]+$")]]


class StructureVolume(_Record):
    min: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    median: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    max: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    subjects: Annotated[int, Field(ge=1)]


def _validated(schema: type[BaseModel], value: Any, path: Path, expected: str) -> Any:
    try:
        return schema.model_validate(value)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise MedvolError(f"{path}: `{where}` {first['msg'].lower()}; expected {expected} written by medvol") from None


def read_postprocessing(folder: Path) -> Postprocessing:
    """The post-processing recorded in `folder` (a run or a sweep); none where nothing was recorded. A record
    written before records said their folds counts a sweep's folds (`cross_validation.json` beside it), else 1."""
    path = folder / POSTPROCESSING_FILE
    if not path.is_file():
        return Postprocessing()
    folds = 1
    summary = folder / SUMMARY_FILE
    if summary.is_file():
        record = read_json(summary, "a cross-validation summary")
        if isinstance(record, dict) and isinstance(record.get("folds"), dict):
            folds = max(1, len(record["folds"]))
    return Postprocessing.from_json(read_json(path, "a post-processing record"), str(path), folds)


def applied_postprocessing(folder: Path | None, switch: str | bool, own: Postprocessing) -> tuple[Postprocessing, str]:
    """The post-processing that applies, and a line saying which and why. `folder`'s record (a run's or a sweep's)
    under `switch`: `auto` applies it where it was chosen on two folds or more (nnU-Net chooses on the
    cross-validation folds), and keeps `own` (`model.largest_component`) otherwise; `true` applies it whatever it
    was chosen on (refused in one line where none is recorded); `false` applies none."""
    if switch is False:
        return Postprocessing(), "post-processing: off (postprocessing=false)"
    recorded = read_postprocessing(folder) if folder is not None else None
    path = folder / POSTPROCESSING_FILE if folder is not None else None
    if switch is True:
        if path is None or not path.is_file():
            raise MedvolError(
                f"`postprocessing=true`: no post-processing recorded ({path or 'the checkpoint has no run folder'}); "
                "expected a run validated after training or a cross-validation sweep, or postprocessing=auto"
            )
        assert recorded is not None
        return recorded, f"{recorded.describe()} (chosen on {chosen_on(recorded)}, postprocessing=true; {path})"
    if recorded is not None and recorded.folds >= 2:
        return recorded, f"{recorded.describe()} (chosen on {chosen_on(recorded)}; {path})"
    line = own.describe() if own.steps else "post-processing: none"
    if recorded is not None and recorded.steps:
        line += (f" (one split's choice, largest component of {recorded.kept()}, not applied: postprocessing=true "
                 "applies it)")
    return own, line


def chosen_on(decision: Postprocessing) -> str:
    return f"{decision.folds} cross-validation folds" if decision.folds >= 2 else "one validation split"


def read_fold(path: Path) -> FoldRecord:
    """A run's fold record, checked: its checkpoint a file inside the run (stored relative to it; an older record's
    absolute path only where it still lies inside)."""
    record = _validated(FoldRecord, read_json(path, "a fold record"), path, "a fold record")
    run_dir = path.parent.parent.resolve()
    checkpoint = (run_dir / record.checkpoint).resolve()
    if not checkpoint.is_relative_to(run_dir):
        raise MedvolError(
            f"{path}: `checkpoint` {record.checkpoint} lies outside its run {run_dir}; expected one of the run's "
            "checkpoints"
        )
    return record.model_copy(update={"checkpoint": str(checkpoint)})


def fold_runs(sweep_dir: Path) -> list[tuple[int, Path, FoldRecord]]:
    """(fold, run directory, fold record) of every validated cross-validation run in a sweep, by fold."""
    found = []
    for path in sorted(sweep_dir.glob(f"*/{VALIDATION_DIR}/{FOLD_FILE}")):
        record = read_fold(path)
        if record.fold is not None:
            found.append((record.fold, path.parent.parent, record))
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
    return [record.checkpoint for _, _, record in runs]


def read_volume_range(folder: Path) -> dict[str, list[float]]:
    """Per structure, the [smallest, largest] volume (ml) of the run's training labels; empty where not recorded."""
    path = folder / VOLUMES_FILE
    if not path.is_file():
        return {}
    record = read_json(path, "a record of structure volumes")
    if not isinstance(record, dict):
        raise MedvolError(f"{path}: expected a mapping of structure name -> volumes written by medvol")
    volumes = {name: _validated(StructureVolume, value, path, "structure volumes") for name, value in record.items()}
    return {name: [v.min, v.max] for name, v in volumes.items()}
