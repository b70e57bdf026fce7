"""The data doctor: find unreadable, truncated, mismatched or degenerate data before a run spends hours on it.

    python check_data.py dataset=brats dataset.root=/data/BraTS2023

(`medvol.run.data_check`) reads every file of the configured dataset and prints one table of problems (exit status 1
if there are any). Training runs the cheap mode of the same check (headers and existence,
no voxel reads) in `preflight()` and refuses to start on errors.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from medvol.core.errors import MedvolError
from medvol.volumes.dicom_io import SeriesGeometry, is_dicom_series, read_series, series_geometry
from medvol.volumes.scan_checks import shape_problem, truncation_problem
from medvol.volumes.volume_budget import VolumeTooLarge, check_resampled_size, load_nifti

LABEL_KEY = "label"


@dataclass(frozen=True)
class Problem:
    """One finding: which subject, which file (or CSV row), what is wrong."""

    subject: str
    file: str
    problem: str


@dataclass
class _Header:
    shape: tuple[int, ...]
    affine: np.ndarray
    image: Any


def duplicate_subjects(records: Iterable[dict[str, Any]], source: str) -> list[Problem]:
    counts = Counter(str(r["subject"]) for r in records)
    return [
        Problem(subject, source, f"duplicate subject: listed {n} times; subject ids must be unique")
        for subject, n in sorted(counts.items()) if n > 1
    ]


def _read_header(path: Path) -> tuple[_Header | None, str | None]:
    try:
        image = load_nifti(path)
        header = _Header(tuple(int(s) for s in image.shape), np.asarray(image.affine, dtype=np.float64), image)
    except VolumeTooLarge as err:
        return None, f"too large: {str(err).removeprefix(f'{path}: ')}"
    except MedvolError as err:
        return None, f"unusable: {str(err).removeprefix(f'{path}: ')}"
    except Exception as err:  # noqa: BLE001 - every reader failure means the same thing to the user
        return None, f"unreadable: {type(err).__name__}: {str(err)[:100]}"
    problem = truncation_problem(path, image)
    return (None, problem) if problem else (header, None)


@dataclass
class _SeriesImage:
    """A DICOM series as the voxel checks read it: `dataobj` reads its values (rescaled) on demand."""

    geometry: SeriesGeometry

    @property
    def dataobj(self) -> np.ndarray:
        return read_series(self.geometry.folder, self.geometry.uid)[0]


def _read_series_header(path: Path, series: str | None) -> tuple[_Header | None, list[str]]:
    """The grid of a series folder (headers only) and its findings: a refusal, or localizers among the slices."""
    try:
        geometry = series_geometry(path, series)
    except MedvolError as err:
        return None, [f"DICOM series: {str(err).removeprefix(f'{path}: ')}"]
    problem = shape_problem(geometry.shape)
    if problem:
        return None, [problem]
    findings = (
        [f"{len(geometry.dropped)} localizer image(s) among the slices (dropped when read)"] if geometry.dropped else []
    )
    return _Header(geometry.shape, geometry.affine, _SeriesImage(geometry)), findings


def check_record(
    record: dict[str, Any], label_values: Sequence[int] | None, full: bool, image_names: Sequence[str] = (),
    series: str | None = None, spacing: Sequence[float] | None = None, orientation: str | None = None,
) -> list[Problem]:
    """The problems of one subject's files (`record["files"]`: name -> path or None).

    Args:
        record: a subject record with `subject` and `files`.
        label_values: the allowed label values (full mode), or None for any.
        full: read every voxel (NaN/Inf, constant volumes, label values) as well as the headers.
        image_names: names of the image channels (constant-volume check); others are treated as labels.
        series: the series to read from DICOM folders holding several (UID or description).
        spacing: the spacing (mm) the dataset resamples to, after `orientation`: each grid it makes is checked
            against the memory budget (a header of few, huge voxels), before any voxel is read.
    """
    subject = str(record["subject"])
    problems: list[Problem] = []
    headers: dict[str, _Header] = {}
    for name, path in record.get("files", {}).items():
        if path is None:
            kind = "label" if name == LABEL_KEY else "modality"
            problems.append(Problem(subject, f"<{name}>", f"missing {kind} {name!r}: no file found for this subject"))
            continue
        path = Path(path)
        if is_dicom_series(path):
            header, findings = _read_series_header(path, series)
            problems += [Problem(subject, str(path), finding) for finding in findings]
            if header is not None:
                headers[name] = header
            continue
        if not path.is_file():
            problems.append(Problem(subject, str(path), f"missing file ({name}): no such file"))
            continue
        header, error = _read_header(path)
        if error:
            problems.append(Problem(subject, str(path), error))
            continue
        assert header is not None
        problem = shape_problem(header.shape)
        if problem:
            problems.append(Problem(subject, str(path), problem))
            continue
        headers[name] = header
    if spacing:
        # A volume too large once resampled is not read at all (full mode reads the others' voxels).
        refused = _resampled_too_large(subject, record, headers, spacing, orientation)
        problems += list(refused.values())
        headers = {name: header for name, header in headers.items() if name not in refused}
    problems += _grid_mismatches(subject, record, headers)
    if full:
        for name, header in headers.items():
            problems += _voxel_problems(subject, record["files"][name], name, header, label_values, image_names)
    return problems


def _resampled_too_large(
    subject: str, record: dict[str, Any], headers: dict[str, _Header], spacing: Sequence[float],
    orientation: str | None,
) -> dict[str, Problem]:
    """Per file whose grid at `spacing` exceeds the memory budget, its problem."""
    refused = {}
    for name, header in headers.items():
        path = str(record["files"][name])
        try:
            check_resampled_size(path, header.shape, header.affine, spacing, orientation)
        except MedvolError as err:
            kind = "too large" if isinstance(err, VolumeTooLarge) else "unusable"
            refused[name] = Problem(subject, path, f"{kind}: {str(err).removeprefix(f'{path}: ')}")
    return refused


def _grid_mismatches(subject: str, record: dict[str, Any], headers: dict[str, _Header]) -> list[Problem]:
    if not headers:
        return []
    reference_name = next(iter(headers))
    reference = headers[reference_name]
    problems = []
    for name, header in headers.items():
        if name == reference_name:
            continue
        path = str(record["files"][name])
        if header.shape[:3] != reference.shape[:3]:
            problems.append(
                Problem(
                    subject,
                    path,
                    f"shape mismatch: {name} is {header.shape[:3]}, {reference_name} is {reference.shape[:3]}",
                )
            )
        elif not np.allclose(header.affine, reference.affine, atol=1e-3, rtol=1e-4):
            problems.append(
                Problem(
                    subject,
                    path,
                    f"affine mismatch: {name} and {reference_name} lie on different voxel grids (resample them)",
                )
            )
    return problems


def _voxel_problems(
    subject: str, path: str, name: str, header: _Header, label_values: Sequence[int] | None, image_names: Sequence[str]
) -> list[Problem]:
    try:
        data = np.asanyarray(header.image.dataobj)
    except Exception as err:  # noqa: BLE001 - zlib/EOF/OSError all mean a corrupt file
        return [Problem(subject, path, f"truncated or corrupt: {type(err).__name__}: {str(err)[:100]}")]
    problems = []
    if np.issubdtype(data.dtype, np.floating):
        bad = int(np.count_nonzero(~np.isfinite(data)))
        if bad:
            problems.append(Problem(subject, path, f"{bad} NaN/Inf voxels"))
            data = np.nan_to_num(data)
    if name == LABEL_KEY:
        values = np.unique(data)
        if label_values is not None:
            outside = sorted(set(values.tolist()) - set(label_values))
            if outside:
                problems.append(Problem(
                    subject, path, f"label values {outside[:5]} outside the expected {sorted(label_values)}"
                ))
        if np.any(values != np.round(values)):
            problems.append(Problem(subject, path, "label map holds non-integer values"))
    elif (not image_names or name in image_names) and data.size and data.min() == data.max():
        problems.append(
            Problem(subject, path, f"constant volume (every voxel is {data.flat[0]:g}): no signal to learn")
        )
    return problems


def format_table(problems: Sequence[Problem]) -> str:
    """One plain-text table: subject | file | problem."""
    rows = [("subject", "file", "problem")] + [(p.subject, p.file, p.problem) for p in problems]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}" for row in rows]
    lines.insert(1, "-" * min(160, max(len(line) for line in lines)))
    return "\n".join(lines)


def preflight_error(problems: Sequence[Problem], overrides: Sequence[str]) -> MedvolError:
    """The one-line refusal training gives when the cheap check finds problems."""
    first = "; ".join(f"{p.file}: {p.problem}" for p in problems[:3])
    # Quoted for a POSIX shell, so the line pastes as it stands: Hydra needs the quotes of `"{subject}/label.nii.gz"`.
    command = " ".join(["python check_data.py", *(shlex.quote(o) for o in overrides)])
    return MedvolError(
        f"the data check found {len(problems)} problem(s), training not started (first: {first}); "
        f"run the full check for the whole table: {command}"
    )


def dataset_overrides() -> list[str]:
    """The overrides of the running Hydra job that choose and shape its dataset (`experiment=...`, which may choose
    it, `dataset=...`, `dataset.x=...`), to repeat them in a hint."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    try:
        task = list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - a config composed without the hydra node has no overrides
        return []
    chosen = [o for o in task if o.split("=")[0].lstrip("+~").split(".")[0] in ("experiment", "dataset")]
    # The group choices first, as a user would type them.
    return sorted(chosen, key=lambda o: "." in o.split("=")[0])
