"""The embedded default dataset: synthetic head phantoms, generated from (seed, index) (no download)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from monai.transforms import Transform
from torch.utils.data import Dataset

from datamodules.pipeline.volume_datamodule import Record, VolumeDataModule, fingerprint_sample
from datamodules.sources.phantom import LABELS, MODALITIES, lesion_class, make_phantom, phantom_affine
from medvol.core.errors import MedvolError
from medvol.volumes.projection import VIEW_AXES, radiographs

# The MR percentile mapped to 1 when `mr_scale` is null.
MR_PERCENTILE = 99.5


def _to_unit_range(
    volume: np.ndarray, modality: str, ct_window: Sequence[float], mr_scale: float | None = None
) -> np.ndarray:
    """MR: divide by `mr_scale`, or by the volume's 99.5th percentile when None; CT: clip to the HU window.

    Both are then clipped to [0, 1] and mapped to [-1, 1].
    """
    if modality == "ct":
        low, high = ct_window
        unit = (np.clip(volume, low, high) - low) / (high - low)
    else:
        top = mr_scale if mr_scale is not None else np.percentile(volume, MR_PERCENTILE)
        unit = np.clip(volume / max(top, 1e-6), 0, 1)
    return (unit * 2 - 1).astype(np.float32)


def phantom_radiographs(
    seed: int, index: int, field_of_view: Sequence[float], views: Sequence[str], size: Sequence[int],
    mu_water: float = 0.02, grid: int = 64, output_range: Sequence[float] = (-1.0, 1.0),
) -> torch.Tensor:
    """(V, H, W) DRRs of phantom `index` sampled at `grid`^3 voxels over `field_of_view` (x, y, z) mm: the subject's
    radiographs, the same whatever grid a model reconstructs the phantom on (the phantom is analytic)."""
    ct = make_phantom(seed, index, (int(grid),) * 3).channels["ct"]
    spacing = torch.tensor([[float(f) / int(grid) for f in field_of_view]], dtype=torch.float32)
    return radiographs(torch.from_numpy(ct)[None], spacing, views, size, mu_water, output_range)[0]


class PhantomItem(Transform):
    """A record (`subject`, `index`) -> its phantom as a batch dict; deterministic, so a cache can keep it.

    Keys: `image` (C, D, H, W) in [-1, 1] from `image_modalities`; `cond` from
    `cond_modalities` when given (e.g. T1 -> T2 translation); `label` (1, D, H, W) int64
    (0 background, 1 lesion core, 2 oedema); `time` (months), `event` (0/1),
    `lesion_fraction`, `class_label` (int64: 1 if the lesion load is above the generator's median,
    `datamodules.sources.phantom.lesion_class`: about half the subjects), `subject`,
    `affine` (4x4, RAS mm); with `views`, `xray` (V, H, W): DRRs of the patient's CT, not of `image`:
    the phantom at `xray_grid`^3 voxels over the same field of view, whatever `size` is, so the
    stages of a cascade (16^3, 24^3, 32^3 grids of one head) see the very same radiographs.
    """

    def __init__(
        self,
        size: Sequence[int],
        image_modalities: Sequence[str],
        cond_modalities: Sequence[str],
        seed: int,
        spacing: float,
        ct_window: Sequence[float],
        views: Sequence[str] = (),
        xray_size: Sequence[int] = (32, 32),
        mu_water: float = 0.02,
        mr_scale: float | None = None,
        xray_grid: int = 64,
    ) -> None:
        self.size = tuple(size)
        self.image_modalities = list(image_modalities)
        self.cond_modalities = list(cond_modalities)
        self.seed = seed
        self.ct_window = ct_window
        self.mr_scale = mr_scale
        self.affine = phantom_affine(self.size, spacing)
        self.views = list(views)
        self.xray_size = list(xray_size)
        self.mu_water = mu_water
        self.xray_grid = int(xray_grid)
        self.field_of_view = [float(spacing) * s for s in self.size]

    def __call__(self, record: Record) -> dict[str, Any]:
        phantom = make_phantom(self.seed, record["index"], self.size)

        def stack(names: Sequence[str]) -> torch.Tensor:
            return torch.from_numpy(
                np.stack([_to_unit_range(phantom.channels[n], n, self.ct_window, self.mr_scale) for n in names])
            )

        item: dict[str, Any] = {
            "image": stack(self.image_modalities),
            "label": torch.from_numpy(phantom.label.astype(np.int64))[None],
            "time": torch.tensor(phantom.time, dtype=torch.float32),
            "event": torch.tensor(float(phantom.event), dtype=torch.float32),
            "lesion_fraction": torch.tensor(phantom.lesion_fraction, dtype=torch.float32),
            "class_label": torch.tensor(lesion_class(self.seed, record["index"])),
            "subject": record["subject"],
            "affine": torch.from_numpy(self.affine),
        }
        if self.cond_modalities:
            item["cond"] = stack(self.cond_modalities)
        if self.views:
            item["xray"] = phantom_radiographs(
                self.seed, record["index"], self.field_of_view, self.views,
                self.xray_size, self.mu_water, self.xray_grid,
            )
        return item


class SyntheticDataModule(VolumeDataModule):
    """Deterministic synthetic phantoms: `num_subjects` subjects of `size` voxels.

    Args:
        num_subjects: how many phantoms the dataset holds.
        size: edge length (int) or (D, H, W) of each volume.
        image_modalities: channels of `image`, from t1, t1ce, t2, flair, ct.
        cond_modalities: channels of `cond` (empty for none).
        seed: phantom series; the same seed and index always give the same subject.
        spacing: voxel size in mm, written into the affine.
        ct_window: Hounsfield window mapped to [-1, 1] for the ct channel.
        views: X-ray views of the ct channel to add as `xray` (from ap, lateral); empty for none.
        xray_size: (H, W) of each view.
        mu_water: attenuation of water per mm for the views.
        xray_grid: the views are projected from each phantom sampled at this many voxels per axis over the
            same field of view (`size` x `spacing` mm), whatever `size` is: a patient's radiographs do not
            change with the grid a model reconstructs on.
        mr_scale: MR intensity mapped to 1 in every volume; None scales each volume's 99.5th percentile
            to 1. The phantoms' MR intensities are absolute (tissue values up to 1 times a smooth bias
            field; the brightest voxels stay below ~1.25), so a fixed scale keeps a lesion equally bright
            in every subject. The percentile is set by the lesions themselves once they fill ~0.5% of
            the volume, so it dims lesioned heads and brightens lesion-free ones: fine for image
            synthesis, but it hides lesion burden from a model that compares subjects (survival).
        **kwargs: split and loader settings of `VolumeDataModule`.
    """

    def __init__(
        self,
        num_subjects: int = 32,
        size: int | Sequence[int] = 32,
        image_modalities: Sequence[str] = ("t1",),
        cond_modalities: Sequence[str] = (),
        seed: int = 0,
        spacing: float = 6.0,
        ct_window: Sequence[float] = (-1000.0, 1000.0),
        views: Sequence[str] = (),
        xray_size: Sequence[int] = (32, 32),
        mu_water: float = 0.02,
        mr_scale: float | None = None,
        xray_grid: int = 64,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        size = [int(size)] * 3 if isinstance(size, int) else [int(s) for s in size]
        if len(size) != 3 or min(size) < 8:
            raise MedvolError(f"`dataset.size` must be an int or three ints >= 8, got {size}")
        for key, names in (("image_modalities", image_modalities), ("cond_modalities", cond_modalities)):
            unknown = [n for n in names if n not in MODALITIES]
            if unknown:
                raise MedvolError(
                    f"`dataset.{key}`: unknown modality {unknown[0]!r}; expected some of {list(MODALITIES)}"
                )
        if not image_modalities:
            raise MedvolError("`dataset.image_modalities` is empty; name at least one of " + str(list(MODALITIES)))
        unknown_views = [v for v in views if v not in VIEW_AXES]
        if unknown_views:
            raise MedvolError(f"`dataset.views`: {list(views)}; expected some of {list(VIEW_AXES)}")
        if views and "ct" not in image_modalities:
            raise MedvolError(
                f"`dataset.views` needs the ct channel in `dataset.image_modalities`, got {list(image_modalities)}"
            )
        if len(xray_size) != 2 or min(xray_size) < 1:
            raise MedvolError(f"`dataset.xray_size` must be two positive ints (H, W), got {list(xray_size)}")
        if isinstance(xray_grid, bool) or not isinstance(xray_grid, int) or xray_grid < 8:
            raise MedvolError(
                "`dataset.xray_grid` must be an int >= 8 (voxels per axis the views are projected from), "
                f"got {xray_grid!r}"
            )
        if mr_scale is not None and not mr_scale > 0:
            raise MedvolError(f"`dataset.mr_scale` must be null or a positive number, got {mr_scale}")
        if num_subjects < 1:
            raise MedvolError(f"`dataset.num_subjects` must be >= 1, got {num_subjects}")
        self.num_subjects = num_subjects
        self.size = size
        self.image_modalities = list(image_modalities)
        self.cond_modalities = list(cond_modalities)
        self.seed = seed
        self.spacing = spacing
        self.ct_window = tuple(ct_window)
        self.views = list(views)
        self.xray_size = [int(v) for v in xray_size]
        self.mu_water = mu_water
        self.mr_scale = None if mr_scale is None else float(mr_scale)
        self.xray_grid = xray_grid

    def subjects(self) -> list[Record]:
        records: list[Record] = [
            {"subject": f"phantom-{self.seed}-{i:04d}", "index": i} for i in range(self.num_subjects)
        ]
        if self.stratify_by == "class_label":
            # Costs one small phantom per subject, so only when the split asks for the classes.
            for record in records:
                record["class_label"] = lesion_class(self.seed, record["index"])
        return records

    def label_names(self) -> list[str]:
        """The phantoms' foreground classes in label-value order (0 is background)."""
        return [name for name, value in sorted(LABELS.items(), key=lambda item: item[1]) if value > 0]

    def fingerprint(self) -> dict[str, Any]:
        """The phantoms' grid (`spacing` mm, RAS) and, per `image` channel, the raw values mapped onto -1 and 1:
        the HU window for ct; 0 and `mr_scale` (or the median 99.5th percentile of the training phantoms) for MR."""
        records = self.training_records()
        low, high = [], []
        for modality in self.image_modalities:
            if modality == "ct":
                low.append(float(self.ct_window[0]))
                high.append(float(self.ct_window[1]))
                continue
            low.append(0.0)
            if self.mr_scale is not None:
                high.append(self.mr_scale)
            else:
                tops = [np.percentile(make_phantom(self.seed, r["index"], self.size).channels[modality], MR_PERCENTILE)
                        for r in fingerprint_sample(records)]
                high.append(float(np.median(tops)))
        return {
            "spacing": [float(self.spacing)] * 3, "orientation": "RAS",
            "intensity": {"mode": "phantom", "low": low, "high": high, "range": [-1.0, 1.0]}, "subjects": len(records),
        }

    def build_dataset(self, records: list[Record], stage: str) -> Dataset:
        settings = {
            "size": self.size, "image_modalities": self.image_modalities, "cond_modalities": self.cond_modalities,
            "seed": self.seed, "spacing": self.spacing, "ct_window": list(self.ct_window), "views": self.views,
            "xray_size": self.xray_size, "mu_water": self.mu_water, "mr_scale": self.mr_scale,
            "xray_grid": self.xray_grid,
        }
        fingerprint = {"class": type(self).__name__, "settings": settings}
        return self.cached_dataset(records, [PhantomItem(**settings)], [], stage, fingerprint=fingerprint)
