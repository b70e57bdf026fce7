"""Input files grouped into subjects as training took its channels: nnU-Net's `<case>_XXXX.nii.gz` naming (one file
per channel, XXXX the channel index) gives one subject per case, its files in channel order; any other file is one
subject: a 3D volume for a one-channel model, a 4D file holding every channel on its last axis (as the Medical
Segmentation Decathlon stores its scans) for a model of several, however it was trained."""

from __future__ import annotations

import re
from pathlib import Path

import nibabel as nib
from omegaconf import DictConfig

from medvol.core.errors import MedvolError
from medvol.volumes.plan import read_plan

CHANNEL_FILE = re.compile(r"^(?P<case>.+)_(?P<channel>\d{4})\.nii(\.gz)?$")
PLAN_KEY = "channel_files"


def files_per_subject(run: DictConfig, plan_file: Path) -> int:
    """How many files a training subject had (`plan.json`'s `channel_files`, else the run's image modalities)."""
    if plan_file.is_file():
        files = read_plan(plan_file).get(PLAN_KEY)
        if files:
            return int(files)
    try:
        return max(1, len(run.dataset.get("image_modalities") or []))
    except Exception:  # noqa: BLE001 - an interpolation that needs the training data (not here): one file per subject
        return 1


def volumes_in(path: Path) -> int:
    """How many volumes an input holds along its fourth axis (its header only): 1 for a 3D file or a DICOM series."""
    if not path.is_file():
        return 1
    try:
        shape = nib.load(str(path)).shape
    except Exception:  # noqa: BLE001 - an unreadable file is reported, by name, where it is read
        return 1
    return int(shape[3]) if len(shape) == 4 else 1


def channel_groups(files: list[Path], channels: int) -> dict[str, list[Path]]:
    """Subject -> its files: by nnU-Net's naming where every file follows it, else one file per subject.

    Raises `MedvolError` naming the case when a case does not have exactly the channel files 0..`channels`-1, or
    naming the file when a model taking several channels is given a file that holds another number of volumes and
    does not follow the naming.
    """
    matches = [CHANNEL_FILE.match(f.name) for f in files]
    if not files or not all(m and f.is_file() for m, f in zip(matches, files, strict=True)):
        if channels > 1:
            for path in files:
                found = volumes_in(path)
                if found != channels:
                    raise MedvolError(
                        f"`input`: {path} holds {found} volume(s); the model takes {channels} channels per subject: "
                        f"one 4D file holding them on its last axis, or one file per channel named as nnU-Net does, "
                        "<case>_0000.nii.gz ... <case>_%04d.nii.gz" % (channels - 1)
                    )
        return {f.name.removesuffix(".gz").removesuffix(".nii"): [f] for f in files}
    cases: dict[str, dict[int, Path]] = {}
    for match, path in zip(matches, files, strict=True):
        assert match is not None
        cases.setdefault(match.group("case"), {})[int(match.group("channel"))] = path
    for case, found in cases.items():
        if sorted(found) != list(range(channels)):
            raise MedvolError(
                f"`input`: case {case} has the channel files {sorted(found)}; the model takes {channels} "
                f"(<case>_0000 ... <case>_{channels - 1:04d})"
            )
    return {case: [found[k] for k in range(channels)] for case, found in cases.items()}
