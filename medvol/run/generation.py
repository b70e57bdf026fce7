"""Condition-only prediction: a generative family's outputs from the inputs a patient has, and N seeded samples.

A family names the batch keys it generates from (`MedvolModule.generation_inputs`, e.g. `cond` for a
T1 -> T2 model); predict.py builds batches with those keys and no target, checks every input's
headers before anything is written, and calls `generate_volumes` once per sample. The outputs that
are not in the condition's units take the training targets' typical scaling from the checkpoint
(`VolumeDataModule.fingerprint`), so they come out in the units the model learned (HU in window mode).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch
from omegaconf import DictConfig, open_dict

from lightning_modules.base import MedvolModule
from medvol.core.errors import MedvolError
from medvol.volumes.intensity import INTENSITY_RANGE_KEY, intensity_keys
from medvol.volumes.source_grid import oriented_spacing
from medvol.volumes.volume_reader import volume_grid

# The dataset config field that lists the modalities of each generation input (batch key).
MODALITY_FIELDS = {"cond": "cond_modalities"}
# The batch keys that place a volume on its source file's grid; a refined output leaves them out.
SOURCE_GRID_KEYS = ("source_affine", "source_shape", "source_file")
# An input axis counts as coarser than the training spacing beyond this relative margin.
SPACING_TOLERANCE = 1e-3


def modality_field(key: str) -> str:
    """The dataset config field holding the modalities of generation input `key`."""
    if key not in MODALITY_FIELDS:
        raise MedvolError(
            f"the model generates from the batch key `{key}`, which predict.py cannot read from files yet; "
            f"condition-only inputs are supported for {sorted(MODALITY_FIELDS)}"
        )
    return MODALITY_FIELDS[key]


def lacks_targets(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether some listed subject has no file for a target (`image`) modality."""
    return any(None in (record.get("image") or []) for record in records)


def without_targets(config: DictConfig, generation: Mapping[str, int]) -> DictConfig:
    """A dataset config that lists only the generation inputs: no `image` modalities and no label."""
    for key in generation:
        field = modality_field(key)
        if not config.get(field):
            raise MedvolError(
                f"the model generates from `{key}`, but the dataset has no target files and lists no "
                f"`dataset.{field}`; name the condition modalities the model was trained on, "
                "or give the scans with `input=`"
            )
    config = config.copy()
    with open_dict(config):
        config.image_modalities = []
        if "label" in config:
            config.label = False
        if "label_file" in config:
            config.label_file = None
    return config


def check_condition_files(
    records: Sequence[Mapping[str, Any]], config: DictConfig, generation: Mapping[str, int]
) -> None:
    """Every subject must have every condition modality's file."""
    names = [name for key in generation for name in config.get(modality_field(key))]
    where = config.get("root") or config.get("list_file")
    if not records:
        raise MedvolError(
            f"`dataset.root`: {where} holds none of the condition files ({', '.join(names)}) the model generates from"
        )
    for record in records:
        for name in names:
            if record["files"].get(name) is None:
                raise MedvolError(
                    f"`dataset.root`: subject {record['subject']} has no {name!r} file; a condition-only prediction "
                    f"needs the condition modalities {names} of every subject in {where}"
                )


def file_channels(path: str) -> int:
    """Channels of one NIfTI file, from its header: the product of the axes past the third (1 for 3D); a DICOM
    series folder is one channel."""
    if Path(path).is_dir():
        return 1
    return int(np.prod(nib.load(path).shape[3:], dtype=np.int64))


def check_input_channels(records: Sequence[Mapping[str, Any]], expected: Mapping[str, int], where: str) -> None:
    """Refuse, before anything is written, a subject whose files give another channel count than the model's.

    Args:
        records: subjects with a list of files under each key of `expected` (synthetic subjects have none).
        expected: batch key -> the model's channel count.
        where: the config key to name (`input`, `dataset.root`).
    """
    for record in records:
        for key, channels in expected.items():
            files = record.get(key)
            if not files or None in files:
                continue
            got = sum(file_channels(str(f)) for f in files)
            if got != channels:
                what = "image" if key == "image" else "condition"
                listed = ", ".join(str(f) for f in files)
                raise MedvolError(
                    f"`{where}`: subject {record['subject']} has {got} {what} channel{'s' if got != 1 else ''} "
                    f"({listed}), but the model was trained on {channels}; give {channels}-channel {what} volumes "
                    f"({'one file per channel, or a 4D file' if key == 'image' else 'as many condition modalities'})"
                )


def check_refinable(
    records: Sequence[Mapping[str, Any]], key: str, geometry: Mapping[str, Any], where: str
) -> None:
    """A super-resolution input must be coarser than the training spacing along some axis."""
    spacing = geometry.get("spacing")
    if not spacing:
        raise MedvolError(
            "`spacing`: a super-resolution model generates at its training spacing, but none is set (`spacing=native`, "
            "or a checkpoint without the record); give `spacing=[x,y,z]` in mm"
        )
    for record in records:
        first = str(record[key][0])
        own = oriented_spacing(volume_grid(first)[1], geometry.get("orientation"))
        if all(s <= t * (1 + SPACING_TOLERANCE) for s, t in zip(own, spacing, strict=True)):
            raise MedvolError(
                f"`{where}`: {first} has {'x'.join(f'{s:g}' for s in own)} mm voxels, already at or finer than the "
                f"training spacing {'x'.join(f'{s:g}' for s in spacing)} mm: there is nothing to super-resolve; give a "
                "coarser scan"
            )


def with_target_units(batch: dict[str, Any], intensity: Mapping[str, Any] | None) -> dict[str, Any]:
    """The batch with the training targets' typical scaling as its `image` scaling record, where it has none."""
    low_key, high_key = intensity_keys("image")
    if intensity is None or batch.get(low_key) is not None:
        return batch
    size = len(batch["subject"])
    record = {
        low_key: torch.tensor([intensity["low"]] * size, dtype=torch.float64),
        high_key: torch.tensor([intensity["high"]] * size, dtype=torch.float64),
    }
    if batch.get(INTENSITY_RANGE_KEY) is None:
        record[INTENSITY_RANGE_KEY] = torch.tensor([intensity["range"]] * size, dtype=torch.float64)
    return {**batch, **record}


def on_model_grid(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch without its source grid, so outputs are written on the model grid (a refined resolution)."""
    return {key: value for key, value in batch.items() if key not in SOURCE_GRID_KEYS}


def sampled_outputs(
    module: MedvolModule, batch: dict[str, Any], num_samples: int, first: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`num_samples` seeded draws of the generated volumes; with more than one, each as `<name>_<k>` plus
    the voxel-wise `<name>_mean` and `<name>_std` (the sample standard deviation, written as a spread).

    Args:
        module: the model.
        batch: one batch of condition-only inputs, or with targets.
        num_samples: draws per subject.
        first: draw 0 when already computed (`predict_volumes` on a batch with targets, with its metrics).
    """
    draws = [first] if first is not None else []
    draws += [module.generate_volumes(batch, draw) for draw in range(len(draws), num_samples)]
    if num_samples == 1:
        return draws[0]
    outputs = dict(draws[0])
    volumes, units = dict(outputs["volumes"]), dict(outputs.get("units") or {})
    spreads = list(outputs.get("spreads") or [])
    for name in draws[-1]["volumes"]:
        stack = torch.stack([draw["volumes"][name].float() for draw in draws])
        del volumes[name]
        unit = units.pop(name, "image")
        named = {f"{name}_{k}": sample for k, sample in enumerate(stack)}
        named[f"{name}_mean"], named[f"{name}_std"] = stack.mean(dim=0), stack.std(dim=0)
        volumes.update(named)
        units.update(dict.fromkeys(named, unit))
        spreads.append(f"{name}_std")
    return {**outputs, "volumes": volumes, "units": units, "spreads": spreads}


def intensity_record(module: MedvolModule) -> dict[str, Any] | None:
    """The training targets' typical scaling from the checkpoint's record (None: written in model units)."""
    return (module.training_data or {}).get("intensity")
