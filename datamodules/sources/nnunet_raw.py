"""The datasets nnU-Net users already have, read as they are: nnU-Net v2's raw layout and the Medical Segmentation
Decathlon's.

    python train.py model=segmentation dataset=nnunet dataset.root=/data/nnUNet_raw/Dataset004_Hippocampus

nnU-Net v2 (`dataset.json` with `channel_names`, `labels`, `file_ending`): `imagesTr/<case>_<XXXX><file_ending>`,
one file per channel XXXX, and `labelsTr/<case><file_ending>`; an explicit `dataset` mapping (case -> `images`,
`label`) is read instead of the folders where present. The Decathlon (`modality`, `labels` as value -> name, a
`training` list of `image`/`label` paths): one 4D image per case, its fourth axis the channels; a listed image
that does not exist but `<name>_0000...` files do (nnU-Net v1's conversion) is read as separate channel files.

From the file: the channels and their names (a channel named CT is normalized as CT, any other as MR, as nnU-Net's
`get_normalization_scheme`), the classes and their names, and regions (a label whose value is a list, nnU-Net's
region training). A malformed dataset.json is refused in one line naming the key; it is read by medvol's checked
reader (`medvol.core.file_data.read_json`: size, depth, integers and no `${` in any name, which OmegaConf would
resolve once a label name reached a config).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from datamodules.pipeline.check import LABEL_KEY, Problem
from datamodules.pipeline.volume_datamodule import Record
from datamodules.sources.nifti import NiftiDataModule
from medvol.core.errors import MedvolError
from medvol.core.file_data import read_json
from medvol.core.subject_names import check_subject_id

DATASET_JSON = "dataset.json"
# nnU-Net's label name for voxels without truth.
IGNORE = "ignore"
NIFTI_ENDINGS = (".nii.gz", ".nii")
# A 4D Decathlon image stands for its channels under this one name.
FOUR_D = "image"


def read_dataset_json(root: Path) -> dict[str, Any]:
    """`root/dataset.json` as a dict, or one line naming what is wrong."""
    path = root / DATASET_JSON
    if not path.is_file():
        raise MedvolError(
            f"`dataset.root`: {root} has no {DATASET_JSON}; expected an nnU-Net raw dataset (dataset.json, imagesTr/, "
            "labelsTr/) or a Medical Segmentation Decathlon task folder"
        )
    content = read_json(path, "an nnU-Net dataset.json")
    if not isinstance(content, dict):
        raise MedvolError(f"{path}: expected a JSON object with channel_names (or modality) and labels")
    return content


def channel_names(content: Mapping[str, Any], where: Path) -> list[str]:
    """The channels in index order: `channel_names` (nnU-Net v2) or `modality` (Decathlon, nnU-Net v1)."""
    key = "channel_names" if "channel_names" in content else "modality"
    channels = content.get(key)
    if not isinstance(channels, Mapping) or not channels:
        raise MedvolError(
            f"{where}: `channel_names` is missing or empty; expected e.g. {{\"0\": \"T2\", \"1\": \"ADC\"}}"
        )
    try:
        order = sorted(channels, key=int)
    except ValueError as err:
        raise MedvolError(f"{where}: `{key}` has a key that is not a channel index: {list(channels)}") from err
    if [int(k) for k in order] != list(range(len(order))):
        raise MedvolError(f"{where}: `{key}` must number the channels 0..{len(order) - 1}, got {list(channels)}")
    return [str(channels[k]) for k in order]


def label_table(content: Mapping[str, Any], where: Path) -> tuple[dict[str, int], dict[str, list[int]]]:
    """(class name -> value, region name -> values) from `labels`: nnU-Net v2's name -> value (a list for a region)
    or the Decathlon's value -> name; nnU-Net's `ignore` entry is not a class (`ignore_label`)."""
    labels = content.get("labels")
    if not isinstance(labels, Mapping) or not labels:
        raise MedvolError(f"{where}: `labels` is missing or empty; expected e.g. {{\"background\": 0, \"tumour\": 1}}")
    decathlon = all(re.fullmatch(r"\d+", str(k)) for k in labels) and all(isinstance(v, str) for v in labels.values())
    entries = {str(v): int(k) for k, v in labels.items()} if decathlon else dict(labels)
    entries.pop(IGNORE, None)
    classes: dict[str, int] = {}
    listed: dict[str, list[int]] = {}
    for name, value in entries.items():
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise MedvolError(
                f"{where}: `labels.{name}` is {value!r}; expected a label value >= 0 or a list of them (a region)"
            )
        listed[name] = [int(v) for v in values]
        if len(values) == 1:
            classes[name] = int(values[0])
    if 0 not in classes.values():
        raise MedvolError(f"{where}: `labels` has no background 0; expected e.g. \"background\": 0")
    regions: dict[str, list[int]] = {}
    if any(len(v) > 1 for v in listed.values()):
        # nnU-Net: with regions every foreground entry is a region, single values included, in the file's order.
        regions = {n: v for n, v in listed.items() if v != [0]}
        order = content.get("regions_class_order")
        if order is not None and (not isinstance(order, list) or len(order) != len(regions)):
            raise MedvolError(
                f"{where}: `regions_class_order` is {order!r}; expected one label value per region ({len(regions)})"
            )
    return classes, regions


def ignore_label(content: Mapping[str, Any], where: Path) -> int | None:
    """nnU-Net's ignore label (`labels.ignore`: voxels without truth), which must be one above every other label value
    (nnU-Net's `LabelManager`); None without one."""
    labels = content.get("labels")
    value = labels.get(IGNORE) if isinstance(labels, Mapping) else None
    if value is None:
        return None
    classes, regions = label_table(content, where)
    highest = max([*classes.values(), *(v for r in regions.values() for v in r)])
    if isinstance(value, bool) or not isinstance(value, int) or value != highest + 1:
        raise MedvolError(
            f"{where}: `labels.ignore` is {value!r}; expected the integer one above every other label value "
            f"({highest + 1}), as nnU-Net requires"
        )
    return value


def metric_name(name: str) -> str:
    """A label name as a metric name: spaces and slashes as underscores."""
    return re.sub(r"[\s/]+", "_", name.strip())


class NnunetDataModule(NiftiDataModule):
    """An nnU-Net v2 raw dataset or a Decathlon task folder (`root`), read from its dataset.json.

    Args:
        root: the dataset folder (holding dataset.json, imagesTr/, labelsTr/).
        image_modalities: the channel names (from dataset.json through `conf/dataset/nnunet.yaml`; null: read here).
        modality_kind: auto (CT for a channel named CT, else MR, as nnU-Net), or mr/ct per channel as given.
        **kwargs: transforms, split, loader and cache settings of `NiftiDataModule`.
    """

    def __init__(
        self, root: str, image_modalities: Sequence[str] | None = None, modality_kind: str | Sequence[str] = "auto",
        **kwargs: Any,
    ) -> None:
        folder = Path(root).expanduser()
        content = read_dataset_json(folder)
        where = folder / DATASET_JSON
        self.channels = channel_names(content, where)
        self.classes, self.regions = label_table(content, where)
        self.ignore_label = ignore_label(content, where)
        self.content = content
        self.decathlon = "training" in content and "channel_names" not in content
        files = dataset_channels(content, folder)
        names = list(image_modalities) if image_modalities else files
        if names != files:
            raise MedvolError(
                f"`dataset.image_modalities` is {names}; {where} gives the channel files {files} (leave it null)"
            )
        kinds = modality_kind
        if kinds == "auto":
            kinds = ["ct" if c.strip().lower() == "ct" else "mr" for c in self.channels]
        super().__init__(root=str(folder), image_modalities=files, label_values=None, **kwargs)
        # The plan normalizes per channel of the data (a 4D file's volumes included).
        self.modality_kind = [str(k) for k in kinds] if not isinstance(kinds, str) else [kinds] * len(self.channels)
        values = sorted({*self.classes.values(), *(v for r in self.regions.values() for v in r)})
        self.label_values = values + ([self.ignore_label] if self.ignore_label is not None else [])

    def label_names(self) -> list[str] | None:
        """The foreground classes' names in value order (None with regions)."""
        if self.regions:
            return None
        return [metric_name(n) for n, v in sorted(self.classes.items(), key=lambda item: item[1]) if v != 0]

    def ignore_label_of_data(self) -> int | None:
        """dataset.json's ignore label (voxels without truth), or None."""
        return self.ignore_label

    def label_regions_of_data(self) -> dict[str, list[int]] | None:
        """The regions of dataset.json, outermost first as nnU-Net lists them (None without regions)."""
        if not self.regions:
            return None
        return {metric_name(n): list(v) for n, v in self.regions.items()}

    def list_subjects(self) -> tuple[list[Record], list[Problem]]:
        assert self.root is not None
        where = self.root / DATASET_JSON
        if self.decathlon:
            return self._decathlon(where)
        if isinstance(self.content.get("dataset"), Mapping):
            return self._listed_cases(self.content["dataset"], where)
        ending = file_ending(self.content, where)
        images = self.root / "imagesTr"
        if not images.is_dir():
            raise MedvolError(f"`dataset.root`: {self.root} has no imagesTr/ folder; expected nnU-Net's raw layout")
        pattern = re.compile(rf"(?P<case>.+)_(?P<channel>\d{{4}}){re.escape(ending)}$")
        found: dict[str, dict[int, str]] = {}
        for path in sorted(images.iterdir()):
            match = pattern.match(path.name)
            if match:
                found.setdefault(match.group("case"), {})[int(match.group("channel"))] = str(path)
        records, problems = [], []
        for case, by_channel in found.items():
            files: dict[str, str | None] = {
                name: by_channel.get(k) for k, name in enumerate(self.image_modalities)
            }
            missing = [n for n, f in files.items() if f is None]
            if missing or len(by_channel) != len(self.image_modalities):
                problems.append(Problem(case, str(images), f"channel files {sorted(by_channel)} of "
                                                           f"{len(self.image_modalities)} (imagesTr/{case}_XXXX)"))
            label = self.root / "labelsTr" / f"{case}{ending}"
            files[LABEL_KEY] = str(label) if label.is_file() else None
            records.append(self.make_record(case, files))
        return records, problems

    def _listed_cases(self, cases: Mapping[str, Any], where: Path) -> tuple[list[Record], list[Problem]]:
        assert self.root is not None
        records = []
        for case, entry in cases.items():
            if not isinstance(entry, Mapping) or not isinstance(entry.get("images"), list) or "label" not in entry:
                raise MedvolError(f"{where}: `dataset.{case}` needs `images` (a list) and `label`")
            paths = [self._resolve(self.root, p) for p in entry["images"]]
            files: dict[str, str | None] = dict(zip(self.image_modalities, paths, strict=False))
            files[LABEL_KEY] = self._resolve(self.root, entry["label"])
            records.append(self.make_record(check_subject_id(case, str(where)), files))
        return records, []

    def _decathlon(self, where: Path) -> tuple[list[Record], list[Problem]]:
        assert self.root is not None
        training = self.content.get("training")
        if not isinstance(training, list) or not all(isinstance(t, Mapping) and "image" in t for t in training):
            raise MedvolError(f"{where}: `training` must list objects with `image` and `label` paths")
        records = []
        for entry in training:
            image = self._resolve(self.root, entry["image"])
            assert image is not None
            case = check_subject_id(Path(image).name.removesuffix(".gz").removesuffix(".nii"), str(where))
            if len(self.image_modalities) == 1:
                files: dict[str, str | None] = {FOUR_D: image}
            else:
                stem = image.removesuffix(".gz").removesuffix(".nii")
                ending = image[len(stem):]
                files = {name: f"{stem}_{k:04d}{ending}" for k, name in enumerate(self.image_modalities)}
            files[LABEL_KEY] = self._resolve(self.root, entry.get("label"))
            records.append(self.make_record(case, files))
        return records, []

    def cache_key(self) -> dict[str, Any]:
        return {**super().cache_key(), "dataset_json": self.content}


def file_ending(content: Mapping[str, Any], where: Path) -> str:
    ending = content.get("file_ending")
    if not isinstance(ending, str) or not ending:
        raise MedvolError(f"{where}: `file_ending` is missing; expected \".nii.gz\" (nnU-Net v2's dataset.json)")
    if ending not in NIFTI_ENDINGS:
        raise MedvolError(f"{where}: `file_ending` is {ending!r}; medvol reads NIfTI: expected one of {NIFTI_ENDINGS}")
    return ending


def dataset_channels(content: Mapping[str, Any], root: Path) -> list[str]:
    """The channel files per case: one per channel name (nnU-Net v2, or a Decathlon listing split into
    `_XXXX` files), or one 4D `image` (a Decathlon task as published)."""
    channels = channel_names(content, root / DATASET_JSON)
    if "training" in content and "channel_names" not in content:
        training = content.get("training")
        first = training[0].get("image") if isinstance(training, list) and training and isinstance(
            training[0], Mapping) else None
        if isinstance(first, str):
            path = root / first
            stem = str(path).removesuffix(".gz").removesuffix(".nii")
            if not path.exists() and Path(f"{stem}_0000{str(path)[len(stem):]}").exists():
                return [f"{k:04d}_{metric_name(c)}" for k, c in enumerate(channels)]
        return [FOUR_D]
    return [f"{k:04d}_{metric_name(c)}" for k, c in enumerate(channels)]
