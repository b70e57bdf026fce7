"""BraTS case folders, 2021 (`*_t1, _t1ce, _t2, _flair, _seg`) or 2023 (`-t1n, -t1c, -t2w, -t2f, -seg`), detected
automatically.

Modalities use one set of names for both years: t1, t1ce, t2, flair. Labels come out with
one numbering for both years: 0 background, 1 necrotic core, 2 oedema, 3 enhancing tumour
(2021 stores the last as 4), or as binary tumour regions (WT, TC, ET), one channel each.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from monai.transforms import MapTransform
from monai.utils import convert_to_dst_type, convert_to_tensor

from datamodules.pipeline.check import LABEL_KEY
from datamodules.sources.nifti import NiftiDataModule
from medvol.core.errors import MedvolError
from medvol.volumes.dicom_io import is_dicom_series

MODALITIES = ("t1", "t1ce", "t2", "flair")
SUFFIXES = {
    2021: {"t1": "_t1", "t1ce": "_t1ce", "t2": "_t2", "flair": "_flair", LABEL_KEY: "_seg"},
    2023: {"t1": "-t1n", "t1ce": "-t1c", "t2": "-t2w", "flair": "-t2f", LABEL_KEY: "-seg"},
}
LABEL_VALUES = {2021: (0, 1, 2, 4), 2023: (0, 1, 2, 3)}
# Regions over the unified labels: whole tumour, tumour core, enhancing tumour.
REGIONS = {"WT": (1, 2, 3), "TC": (1, 3), "ET": (3,)}


def detect_year(root: Path) -> int:
    """2023 if any file has a 2023 suffix, else 2021 if any has a 2021 one (any modality: a folder may hold
    only the condition modalities of a translation model); a DICOM series folder named with the suffix counts."""
    for year in (2023, 2021):
        if any(next(root.glob(f"**/*{suffix}.nii.gz"), None) for suffix in SUFFIXES[year].values()):
            return year
        if any(is_dicom_series(p) for suffix in SUFFIXES[year].values() for p in root.glob(f"**/*{suffix}")):
            return year
    raise MedvolError(
        f"`dataset.root`: {root} holds no BraTS files; expected case folders with *_t1.nii.gz ... *_seg.nii.gz "
        "(2021) or *-t1n.nii.gz ... *-seg.nii.gz (2023), or DICOM series folders named so without .nii.gz"
    )


def is_case_folder(folder: Path) -> bool:
    """Whether `folder` is a BraTS case folder: it holds files (or DICOM series folders) named after itself with one
    year's suffixes, `BraTS2021_00000/BraTS2021_00000_t1.nii.gz` or `BraTS-GLI-00000-000/...-t1n.nii.gz`."""
    names = [f"{folder.name}{suffix}" for suffixes in SUFFIXES.values() for suffix in suffixes.values()]
    return any((folder / f"{name}.nii.gz").is_file() or is_dicom_series(folder / name) for name in names)


def case_folders(path: Path) -> list[Path]:
    """The BraTS case folders `path` is or holds directly; none for a file or a folder of other files."""
    if not path.is_dir():
        return []
    if is_case_folder(path):
        return [path]
    return sorted(p for p in path.iterdir() if p.is_dir() and is_case_folder(p))


class BratsLabelsd(MapTransform):
    """Unify the label numbering (2021's 4 -> 3) and optionally turn it into binary region channels.

    Also records the file's value of each unified label under `label_values` ((4,) int64: 0, 1, 2, 4
    for 2021), so a predicted label map can be written with the values the input used.

    Args:
        key: the label key.
        year: 2021 or 2023.
        regions: region names (WT, TC, ET) for one channel each, or empty for the class map.
    """

    def __init__(self, key: str, year: int, regions: Sequence[str] = ()) -> None:
        super().__init__([key])
        self.year = year
        self.regions = list(regions)

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        label = d[self.keys[0]]
        if self.year == 2021:
            label = torch.where(label == 4, torch.full_like(label, 3), label)
        if self.regions:
            values = convert_to_tensor(label[0], track_meta=False)
            regions = torch.stack(
                [torch.isin(values, torch.tensor(REGIONS[r], dtype=values.dtype)) for r in self.regions]
            )
            label = convert_to_dst_type(regions, label, dtype=label.dtype)[0]
        d[self.keys[0]] = label
        d["label_values"] = torch.tensor(LABEL_VALUES[self.year], dtype=torch.int64)
        return d


class BratsDataModule(NiftiDataModule):
    """BraTS 2021 or 2023 cases under `root`.

    Args:
        root: the folder holding the case folders.
        year: `auto`, 2021 or 2023.
        image_modalities: channels of `image`, from t1, t1ce, t2, flair.
        cond_modalities: channels of `cond` (e.g. [t1] with image [t2] for T1 -> T2 translation).
        label: load the segmentation as `label`.
        label_regions: null for the class map (0..3), or regions from WT, TC, ET as binary channels.
        **kwargs: transforms, split, loader and cache settings of `NiftiDataModule`.
    """

    # The modality names BraTS folders hold, whatever the year: a model trained under these names reads them here.
    modality_names = MODALITIES

    def __init__(
        self,
        root: str,
        year: str | int = "auto",
        image_modalities: Sequence[str] = MODALITIES,
        cond_modalities: Sequence[str] = (),
        label: bool = True,
        label_regions: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        for key, names in (("image_modalities", image_modalities), ("cond_modalities", cond_modalities)):
            unknown = [n for n in names if n not in MODALITIES]
            if unknown:
                raise MedvolError(
                    f"`dataset.{key}`: unknown BraTS modality {unknown[0]!r}; expected some of {list(MODALITIES)}"
                )
        regions = list(label_regions or [])
        unknown = [r for r in regions if r not in REGIONS]
        if unknown:
            raise MedvolError(
                f"`dataset.label_regions`: unknown region {unknown[0]!r}; expected some of {list(REGIONS)}"
            )
        if str(year) not in ("auto", "2021", "2023"):
            raise MedvolError(f"`dataset.year` is {year!r}; expected auto, 2021 or 2023")
        super().__init__(root=root, image_modalities=image_modalities, cond_modalities=cond_modalities, **kwargs)
        if self.root is None or not self.root.is_dir():
            raise MedvolError(f"`dataset.root`: {root} is not a folder; expected the folder of BraTS case folders")
        self.year = detect_year(self.root) if str(year) == "auto" else int(year)
        self.with_label = label
        self.label_regions = regions
        self.label_values = list(LABEL_VALUES[self.year])
        suffixes = SUFFIXES[self.year]
        self.files = {name: f"**/{{subject}}{suffixes[name]}.nii.gz" for name in MODALITIES}
        self.label_file = f"**/{{subject}}{suffixes[LABEL_KEY]}.nii.gz" if label else None

    def label_transform(self) -> Callable | None:
        return BratsLabelsd(LABEL_KEY, self.year, self.label_regions)

    def label_names(self) -> list[str]:
        """The unified classes 1..3: necrotic core, oedema, enhancing tumour."""
        return ["NCR", "ED", "ET"]

    def label_value_map(self) -> dict[int, int]:
        return {4: 3} if self.year == 2021 else {}

    def batch_keys(self) -> list[str]:
        return [*super().batch_keys(), "label_values"]

    def cache_key(self) -> dict[str, Any]:
        return {**super().cache_key(), "year": self.year, "regions": self.label_regions}
