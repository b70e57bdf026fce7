"""What the network predicts and how it maps to label maps: exclusive classes or nested binary regions.

Classes: one softmax channel per label value 0..K-1 (0 background); the prediction is the argmax.
Regions: one sigmoid channel per region, each a set of label values (BraTS: WT = {1, 2, 3},
TC = {1, 3}, ET = {3}); the prediction thresholds each channel. Regions must be nested, so a
region prediction turns back into one label map: each region is written with the smallest label
value it adds to the regions inside it (BraTS WT/TC/ET: WT only -> 2 oedema, TC without ET -> 1
necrotic core, ET -> 3; [WT] alone -> 1; [WT, ET]: WT without ET -> 1). Reading the written map
with the same regions gives back the predicted regions.

An ignore label (nnU-Net's `"ignore"` in dataset.json: the value after every class or region value) marks voxels
whose truth is unknown: they may appear in label files, never in a prediction, and neither the loss nor a metric
looks at them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from medvol.core.errors import MedvolError

# Classes (background included) a scheme may have: DICOM-SEG numbers its segments in 16 bits. The count sizes the
# class names, every one-hot target and probability map, and may come from a checkpoint.
MAX_CLASSES = 2**16


class LabelScheme:
    """Targets, predictions and label maps for `num_classes` classes or for `regions`.

    Args:
        num_classes: classes including background (classes mode; ignored when `regions` is set).
        regions: region name -> label values, outermost first; null for classes.
        threshold: sigmoid probability above which a region voxel is foreground.
        class_names: names of the foreground classes 1..K-1 in metric names; null: class1, class2, ...
        ignore_label: the label value of voxels without truth (above every class or region value), or null.
    """

    def __init__(
        self,
        num_classes: int | None = 2,
        regions: Mapping[str, Sequence[int]] | None = None,
        threshold: float = 0.5,
        class_names: Sequence[str] | None = None,
        ignore_label: int | None = None,
    ) -> None:
        self.regions = {str(k): sorted(int(v) for v in values) for k, values in (regions or {}).items()}
        self.threshold = float(threshold)
        if not 0.0 < self.threshold < 1.0:
            raise MedvolError(f"`model.threshold` must be in (0, 1), got {threshold}")
        if self.regions:
            self.region_values = self._region_values()
            self.num_classes = max(max(v) for v in self.regions.values()) + 1
        else:
            if num_classes is None:
                raise MedvolError(
                    "`model.num_classes` is null and no `model.regions` are set; expected the number of classes "
                    "(background included), or a run that reads them from the data"
                )
            if int(num_classes) < 2:
                raise MedvolError(f"`model.num_classes` must be >= 2 (background and one class), got {num_classes}")
            self.num_classes = int(num_classes)
        if self.num_classes > MAX_CLASSES:
            given = "the largest region value + 1" if self.regions else "`model.num_classes`"
            raise MedvolError(
                f"{given} is {self.num_classes}; at most {MAX_CLASSES} classes (DICOM-SEG numbers segments in 16 bits)"
            )
        self.class_names = (
            [str(n) for n in class_names] if class_names else [f"class{k}" for k in range(1, self.num_classes)]
        )
        if not self.regions and len(self.class_names) != self.num_classes - 1:
            raise MedvolError(
                f"`model.class_names` has {len(self.class_names)} names; expected one per foreground class "
                f"({self.num_classes - 1} for model.num_classes={self.num_classes})"
            )
        self.ignore_label = None if ignore_label is None else int(ignore_label)
        if self.ignore_label is not None and not self.num_classes <= self.ignore_label <= MAX_CLASSES:
            raise MedvolError(
                f"`model.ignore_label` is {ignore_label}; expected a value above every class or region value "
                f"(>= {self.num_classes}), as nnU-Net's ignore label is the highest label"
            )

    @property
    def is_regions(self) -> bool:
        return bool(self.regions)

    @property
    def out_channels(self) -> int:
        return len(self.regions) if self.regions else self.num_classes

    @property
    def names(self) -> list[str]:
        """Names of the scored channels: the regions, or the foreground classes."""
        return list(self.regions) if self.regions else self.class_names

    @property
    def segments(self) -> dict[str, list[int]]:
        """Name -> the `label_map` values it covers (a DICOM-SEG segment): a class its own value, a region its own
        and those of the regions nested inside it."""
        if not self.is_regions:
            return {name: [k] for k, name in enumerate(self.class_names, start=1)}
        return {
            name: sorted(
                value for inner, value in self.region_values.items() if set(self.regions[inner]) <= set(members)
            )
            for name, members in self.regions.items()
        }

    def _region_values(self) -> dict[str, int]:
        """The label value each region adds to the regions nested inside it."""
        values: dict[str, int] = {}
        for name, members in self.regions.items():
            if not members or min(members) < 1:
                raise MedvolError(f"`model.regions.{name}` is {members}; expected foreground label values (>= 1)")
            inner: set[int] = set()
            for other, other_members in self.regions.items():
                if other != name and set(other_members) < set(members):
                    inner |= set(other_members)
                elif other != name and set(other_members) & set(members) and not set(members) < set(other_members):
                    raise MedvolError(
                        f"`model.regions`: {name} {members} and {other} {other_members} overlap without nesting; "
                        "expected nested regions, e.g. {WT: [1, 2, 3], TC: [1, 3], ET: [3]}"
                    )
            own = set(members) - inner
            if not own:
                raise MedvolError(
                    f"`model.regions.{name}` is {members}, the union of the regions inside it; expected it to add at "
                    "least one label value, so predictions can be written back as one label map"
                )
            values[name] = min(own)
        return values

    def check_label(self, label: torch.Tensor, files: Sequence[str] | None = None) -> None:
        """Raise a `MedvolError` naming the offending value and its file (`files`: per sample, the batch's
        `source_file`) when `label` does not fit the scheme."""
        if label.shape[1] == self.out_channels and self.is_regions and label.shape[1] > 1:
            return  # the dataset already gives binary region channels
        if label.shape[1] != 1:
            raise MedvolError(
                f"the batch's `label` has {label.shape[1]} channels; expected a label map (1 channel)"
                + (f" or {self.out_channels} region channels" if self.is_regions else "")
            )
        values = torch.unique(label).tolist()
        allowed = (
            set(range(self.num_classes)) if not self.is_regions else {0, *(v for r in self.regions.values() for v in r)}
        ) | ({self.ignore_label} if self.ignore_label is not None else set())
        outside = [v for v in values if v not in allowed]
        if outside:
            key = "model.regions" if self.is_regions else "model.num_classes"
            where = ""
            if files:
                sample = next(b for b in range(label.shape[0]) if bool((label[b] == outside[0]).any()))
                where = f" in {files[sample]}"
            raise MedvolError(
                f"label value {outside[0]}{where} is outside the configured classes (`{key}`): expected values in "
                f"{sorted(allowed)}; fix the label files or the model config"
            )

    def annotated(self, label: torch.Tensor) -> torch.Tensor | None:
        """(B, 1, ...) True where a label map's voxel has a truth (not the ignore label); None without an ignore label
        or for region channels given as they are."""
        if self.ignore_label is None or label.shape[1] != 1:
            return None
        return label != self.ignore_label

    def target(self, label: torch.Tensor) -> torch.Tensor:
        """The loss target: the (B, 1, ...) label map for classes (ignored voxels as background: the loss leaves them
        out, `annotated`), (B, R, ...) binary channels for regions (ignored voxels in none)."""
        if not self.is_regions or label.shape[1] == self.out_channels and label.shape[1] > 1:
            if self.ignore_label is not None and label.shape[1] == 1:
                return torch.where(label == self.ignore_label, torch.zeros_like(label), label)
            return label
        channels = [
            torch.isin(label[:, 0], torch.tensor(v, device=label.device, dtype=label.dtype))
            for v in self.regions.values()
        ]
        return torch.stack(channels, 1).to(torch.uint8)

    def activation(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits -> probabilities: a sigmoid per region, or a softmax over the classes (dim 1)."""
        return torch.sigmoid(logits) if self.is_regions else torch.softmax(logits, dim=1)

    def background_logits(self) -> list[float]:
        """The logits of a voxel outside the model grid (cropped away), whose activation is the background: every
        region's probability 0, the background class's 1."""
        if self.is_regions:
            return [float("-inf")] * self.out_channels
        return [0.0] + [float("-inf")] * (self.num_classes - 1)

    def discretise(self, probabilities: torch.Tensor) -> torch.Tensor:
        """(B, out_channels, ...) binary masks of the prediction: thresholded regions or a one-hot argmax."""
        if self.is_regions:
            return (probabilities > self.threshold).to(torch.uint8)
        return self.one_hot(probabilities.argmax(1, keepdim=True))

    def one_hot(self, label_map: torch.Tensor) -> torch.Tensor:
        """(B, 1, ...) class map -> (B, K, ...) one-hot masks."""
        index = label_map[:, 0].long().clamp(0, self.num_classes - 1)
        return torch.nn.functional.one_hot(index, self.num_classes).movedim(-1, 1).to(torch.uint8)

    def scored(self, masks: torch.Tensor) -> torch.Tensor:
        """The masks that metrics score: every region, or the foreground classes (one-hot without background)."""
        return masks if self.is_regions else masks[:, 1:]

    def label_map(self, masks: torch.Tensor) -> torch.Tensor:
        """(B, C, ...) binary masks (regions or one-hot classes) -> (B, 1, ...) int64 label map."""
        if not self.is_regions:
            return masks.argmax(1, keepdim=True).long()
        out = torch.zeros_like(masks[:, :1], dtype=torch.int64)
        # Outer regions first, so the regions nested inside them paint over.
        order = sorted(range(len(self.regions)), key=lambda i: -len(list(self.regions.values())[i]))
        for i in order:
            out[masks[:, i : i + 1].bool()] = self.region_values[list(self.regions)[i]]
        return out
