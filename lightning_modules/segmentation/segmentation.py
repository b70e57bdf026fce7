"""3D segmentation trained on patches and evaluated on whole volumes by Gaussian-blended sliding windows.

Training cuts one patch per sample (at random or centred on the label) out of the whole-volume
batch; validation and testing run `sliding_window_inference` over the whole volume with the
training patch as the window, so the network always sees inputs of the size it was trained on.
Each window gives class or region logits; at test time and in predict.py they are averaged over the
window's mirrored copies (`model.tta`, nnU-Net's default), blended, averaged over an ensemble's members,
resampled onto the source scan's grid (linearly, a coarse axis of anisotropic data by nearest neighbour)
and only there turned into probabilities (softmax or sigmoid) and masks, as nnU-Net v2 does; the masks are
scored against the label file as stored: the Dice and HD95 of what the user receives. Validation while training scores
the model grid without mirroring (`val/*`, the checkpoint monitor). Dice and HD95 are computed per
subject and gathered from all ranks before averaging.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from lightning_modules.base import DYNAMIC_AXES, ExportedNetwork, MedvolModule, spatial_examples
from lightning_modules.segmentation.label_scheme import LabelScheme
from lightning_modules.segmentation.losses import build_loss
from lightning_modules.segmentation.networks import build_network, check_size, size_multiple, supervised_heads
from lightning_modules.segmentation.patch_sampling import SAMPLINGS, cut_patches, patch_origins
from lightning_modules.segmentation.postprocessing import Postprocessing, candidates, postprocessing_switch
from lightning_modules.segmentation.subject_scores import SubjectScores, subject_scores
from medvol.core.errors import MedvolError
from medvol.volumes.mirroring import SPATIAL_AXES, MirrorAveraged
from medvol.volumes.sliding_window import SlidingWindow
from medvol.volumes.source_grid import label_on_source_grid, logits_to_source_grid, to_source_grid

SOURCE_GRID_KEYS = ("source_affine", "source_shape", "affine")


def voxel_spacing(affine: torch.Tensor) -> list[list[float]]:
    """Per sample, the voxel size in mm from a (B, 4, 4) affine (column norms)."""
    return affine[:, :3, :3].double().norm(dim=1).tolist()


def supervision_weights(levels: int) -> list[float]:
    """Weights of the full-resolution output and the deep-supervision heads, as nnU-Net's `_build_loss`: halving per
    level, the lowest-resolution head 0, summing to 1."""
    raw = [0.5**i for i in range(1 + supervised_heads(levels))]
    raw[-1] = 0.0
    return [w / sum(raw) for w in raw]


def pad_value_of(value: float | Sequence[float] | None) -> tuple[float, ...] | None:
    if value is None:
        return None
    return tuple(float(v) for v in value) if isinstance(value, Sequence) else (float(value),)


class Segmenter(MedvolModule):
    """3D segmentation with a MONAI UNet, DynUNet or SwinUNETR.

    Args:
        in_channels: image channels (modalities).
        net: unet, dynunet or swinunetr.
        num_classes: classes including background (exclusive classes, softmax); a run sets it from the data when
            the config leaves it null (`medvol.run.planning`).
        class_names: names of the foreground classes in metric names (dice_<name>); null: class1, class2, ...
        regions: region name -> label values, outermost first (overlapping regions, sigmoid per channel),
            e.g. {WT: [1, 2, 3], TC: [1, 3], ET: [3]}; null for classes.
        features: channels per resolution level (unet, dynunet).
        kernels: dynunet: kernel size per level and axis (a plan's, anisotropic); null: 3.
        strides: dynunet: stride per level and axis, the first [1, 1, 1]; null: 2 after the first level.
        deep_supervision: dynunet: also score the coarser decoder levels while training (weights halving
            per level, the lowest 0, as nnU-Net).
        res_block: dynunet: residual blocks (false: two plain convolutions per stage, nnU-Net's PlainConvUNet).
        transposed_bias: dynunet: a bias on the upsampling transposed convolutions, as nnU-Net's PlainConvUNet (whose
            other convolution biases feed an instance norm, which removes them; a plan sets it).
        batch_dice: the Dice loss over the whole batch rather than per sample (nnU-Net's `batch_dice`, which its
            planner sets where it adds a low-resolution configuration; a plan sets it alike).
        ignore_label: the label value of voxels without truth (nnU-Net's dataset.json `ignore`, above every class or
            region value; a run takes it from the dataset): left out of the loss and of every metric, never predicted.
        feature_size: SwinUNETR embedding size (multiple of 12).
        loss: dice_ce or dice_focal.
        patch_size: training patch and sliding window; null trains on whole volumes.
        patch_sampling: random, or label_balanced (a `pos_ratio` share centred on the label).
        pos_ratio: share of label-centred patches.
        overlap: sliding-window overlap.
        sw_batch_size: windows per network call.
        stitch_on_cpu: keep the blended whole-volume output on the CPU (windows still run on the device).
        threshold: sigmoid probability for a region voxel.
        largest_component: keep only the largest connected component of every class/region (by hand; a
            post-processing that applies, `postprocessing`, replaces it).
        postprocessing: auto, true or false: which recorded post-processing (`postprocessing.json`, chosen on
            validation predictions) test=true and predict.py apply. auto: one chosen on cross-validation folds (a
            sweep's, nnU-Net's rule); a single split's is written, not applied; true: the recorded one, also a single
            split's; false: none (`medvol.run.fold_records.applied_postprocessing`).
        tta: at test time and in predict.py, average each window's logits over its copies mirrored along
            every spatial axis (8 network calls a window).
        optimizer: partial optimizer.
        scheduler: optional partial LR scheduler, stepped per epoch.
        image_key: batch key of the input volume.
        pad_value: per image channel (or one for all), the background value in model units, which sliding
            windows running past a volume smaller than the window pad with (null: 0, MONAI's).
    """

    def __init__(
        self,
        in_channels: int = 1,
        net: str = "unet",
        num_classes: int = 3,
        class_names: Sequence[str] | None = None,
        regions: Mapping[str, Sequence[int]] | None = None,
        features: Sequence[int] = (16, 32, 64, 128),
        kernels: Sequence[Sequence[int]] | None = None,
        strides: Sequence[Sequence[int]] | None = None,
        deep_supervision: bool = False,
        res_block: bool = True,
        transposed_bias: bool = False,
        batch_dice: bool = False,
        ignore_label: int | None = None,
        feature_size: int = 24,
        loss: str = "dice_ce",
        patch_size: Sequence[int] | None = None,
        patch_sampling: str = "label_balanced",
        pos_ratio: float = 0.5,
        overlap: float = 0.5,
        sw_batch_size: int = 4,
        stitch_on_cpu: bool = False,
        threshold: float = 0.5,
        largest_component: bool = False,
        postprocessing: str | bool = "auto",
        tta: bool = True,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
        image_key: str = "image",
        pad_value: float | Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.scheme = LabelScheme(num_classes, regions, threshold, class_names, ignore_label)
        self.features = [int(f) for f in features]
        self.patch_size = [int(p) for p in patch_size] if patch_size else None
        if self.patch_size is not None:
            if len(self.patch_size) != 3 or min(self.patch_size) < 1:
                raise MedvolError(
                    f"`model.patch_size` must be three positive ints or null, got {list(patch_size or [])}"
                )
            check_size(net, self.features, self.patch_size, "model.patch_size", strides)
        if patch_sampling not in SAMPLINGS:
            raise MedvolError(f"`model.patch_sampling` is {patch_sampling!r}; expected one of {list(SAMPLINGS)}")
        if not 0.0 <= overlap < 1.0:
            raise MedvolError(f"`model.overlap` must be in [0, 1), got {overlap}")
        if deep_supervision and (net != "dynunet" or len(self.features) < 3):
            raise MedvolError(
                "`model.deep_supervision` needs model.net=dynunet with at least three `model.features` levels"
            )
        self.net = build_network(
            net, in_channels, self.scheme.out_channels, self.features, feature_size, kernels, strides, deep_supervision,
            res_block, transposed_bias,
        )
        self.supervision_weights = supervision_weights(len(self.features)) if deep_supervision else None
        self.pad_value = pad_value_of(pad_value)
        self.loss = build_loss(loss, self.scheme.is_regions, batch_dice, self.scheme.ignore_label)
        self.optimizer_factory = optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3))
        self.scheduler_factory = scheduler
        # Set by the run from its validation predictions (`postprocessing.json`), or every structure by hand.
        postprocessing_switch(postprocessing, "model.postprocessing")
        self.postprocessing = Postprocessing(tuple(candidates(self.scheme)[1]) if largest_component else ())
        # Which recorded decision applies, and why, in one line (set where a run or predict.py applies one).
        self.postprocessing_note = ""
        self.tta = bool(tta)
        # Per structure, the [smallest, largest] training volume in ml (the run's record): the report flags outliers.
        self.volume_range: dict[str, list[float]] = {}
        columns = len(self.scheme.names)
        self.val_dice, self.val_hd95 = SubjectScores(columns), SubjectScores(columns)
        self.test_dice, self.test_hd95 = SubjectScores(columns), SubjectScores(columns)
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()

    @classmethod
    def restoring_settings(cls, hyper_parameters: dict[str, Any]) -> dict[str, Any]:
        """The classes and channels the run took from its data (`model.num_classes: null`), as trained."""
        return {k: hyper_parameters[k] for k in ("num_classes", "class_names", "in_channels") if k in hyper_parameters}

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.net.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        image, label = batch[self.hparams.image_key], batch["label"]
        self.scheme.check_label(label, batch.get("source_file"))
        shape = list(image.shape[2:])
        if self.patch_size is not None:
            if any(p > s for p, s in zip(self.patch_size, shape, strict=True)):
                raise MedvolError(
                    f"`model.patch_size` {self.patch_size} is larger than the training volume {shape}; "
                    "use a smaller patch or pad the volumes (`dataset.transforms.spatial_size`)"
                )
            balanced = label if self.hparams.patch_sampling == "label_balanced" else None
            origins = patch_origins(image.shape[0], balanced, shape, self.patch_size, self.hparams.pos_ratio)
            image, label = cut_patches(image, origins, self.patch_size), cut_patches(label, origins, self.patch_size)
        else:
            check_size(
                self.hparams.net,
                self.features,
                shape,
                "dataset volume size (model.patch_size is null)",
                self.hparams.strides,
            )
        loss = self.training_loss(self(image), self.scheme.target(label), self.scheme.annotated(label))
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, prog_bar=True, batch_size=image.shape[0])
        return loss

    def training_loss(
        self, output: torch.Tensor, target: torch.Tensor, annotated: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The loss of the full-resolution output, plus with deep supervision the weighted losses of the coarser heads,
        as nnU-Net scores them: each head at its own resolution against the target downsampled to it
        (`nearest-exact`, batchgeneratorsv2's `DownsampleSegForDSTransform`), heads of weight 0 skipped. With an
        ignore label, `annotated` (the voxels with a truth) is downsampled alike and the loss sees only those.

        DynUNet returns its heads nearest-upsampled to the patch (stacked on dim 1), where a head of 1/8 the
        resolution is scored on blocks of 8^3 voxels against the full-resolution target; nnU-Net scores it on its own
        grid. The heads at their own resolution are in `net.heads`. (Measured on BraTS-layout brains, 320 steps:
        either way the nested regions were not learned with deep supervision on; docs/benchmarks/segmentation.md.)"""
        if self.supervision_weights is None or output.dim() == target.dim():
            return self.scored_loss(output, target, annotated)
        heads = [output[:, 0], *self.net.heads]  # one per weight: zip(strict=True) below checks it
        total = output.new_zeros(())
        for weight, head in zip(self.supervision_weights, heads, strict=True):
            if weight == 0.0:
                continue
            scaled, mask = target, annotated
            if tuple(head.shape[2:]) != tuple(target.shape[2:]):
                scaled = F.interpolate(target.float(), size=head.shape[2:], mode="nearest-exact").to(target.dtype)
                if annotated is not None:
                    mask = F.interpolate(annotated.float(), size=head.shape[2:], mode="nearest-exact").bool()
            total = total + weight * self.scored_loss(head, scaled, mask)
        return total

    def scored_loss(self, output: torch.Tensor, target: torch.Tensor, annotated: torch.Tensor | None) -> torch.Tensor:
        """The loss of one output; with an ignore label on the annotated voxels only."""
        if self.scheme.ignore_label is None:
            return self.loss(output, target)
        if annotated is None:
            annotated = torch.ones_like(target[:, :1], dtype=torch.bool)
        return self.loss(output, target, annotated)

    def window(self, image: torch.Tensor) -> SlidingWindow:
        """Windows of the training patch (or the whole volume), overlap, Gaussian blending; windows past a small
        volume are padded with the training background (`pad_value`)."""
        roi = self.patch_size or list(image.shape[2:])
        return SlidingWindow.of(
            roi, overlap=self.hparams.overlap, mode="gaussian", batch_size=self.hparams.sw_batch_size,
            device=self.device, output_device=torch.device("cpu") if self.hparams.stitch_on_cpu else self.device,
            pad_value=self.pad_value,
        )

    def logits(self, image: torch.Tensor, window: SlidingWindow | None = None, tta: bool = False) -> torch.Tensor:
        """(B, C, ...) class or region logits of whole volumes on the model grid, window by window, blended; with
        `tta` each window's are the mean over its copies mirrored along every spatial axis (nnU-Net's predictor)."""
        window = window or self.window(image)
        if window.pad_value is None:
            window = dataclasses.replace(window, pad_value=self.pad_value)
        # One volume per class or region: held against the memory budget before it is blended.
        window = dataclasses.replace(window, output_channels=self.scheme.out_channels)
        return window(MirrorAveraged(self.net, SPATIAL_AXES if tta else ()), image)

    def probabilities(
        self, image: torch.Tensor, window: SlidingWindow | None = None, tta: bool = False
    ) -> torch.Tensor:
        """(B, C, ...) class or region probabilities on the model grid: the softmax or sigmoid of `logits`."""
        return self.scheme.activation(self.logits(image, window, tta))

    def label_maps(self, probabilities: torch.Tensor) -> torch.Tensor:
        """(B, 1, ...) int64 label maps: threshold or argmax, then the post-processing."""
        label_map = self.scheme.label_map(self.scheme.discretise(probabilities))
        if not self.postprocessing.steps:
            return label_map
        kept = [torch.from_numpy(self.postprocessing(m[0].cpu().numpy()))[None] for m in label_map]
        return torch.stack(kept).to(label_map.device)

    def masks_of(self, label_map: torch.Tensor) -> torch.Tensor:
        """(B, C, ...) binary masks of the scored structures' channels from (B, 1, ...) label maps."""
        return self.scheme.target(label_map) if self.scheme.is_regions else self.scheme.one_hot(label_map)

    def _evaluate(self, batch: dict[str, Any], stage: str) -> dict[str, Any]:
        image, label = batch[self.hparams.image_key], batch["label"]
        self.scheme.check_label(label, batch.get("source_file"))
        logits = self.logits(image, tta=stage == "test" and self.tta)
        probabilities = self.scheme.activation(logits)
        target = self.scheme.target(label).to(probabilities.device)
        annotated = self.scheme.annotated(label.to(probabilities.device))
        loss_metric: MeanMetric = getattr(self, f"{stage}_loss")
        loss = self.scored_loss(logits, target, annotated)
        loss_metric.update(loss.detach().to(self.device), weight=image.shape[0])
        if stage == "test" and on_source_grid(batch):
            outputs = self.outputs_of(batch, logits)
        else:
            label_map = self.label_maps(probabilities)
            target_masks = target if self.scheme.is_regions else self.scheme.one_hot(target)
            outputs = {
                "volumes": {
                    "input": image.detach(), "seg": label_map.to(image.device),
                    "label": self.scheme.label_map(target_masks).to(image.device),
                },
                "segments": self.scheme.segments,
                "subject_metrics": self.subject_metrics(label_map, target_masks, batch.get("affine"), annotated),
            }
        metrics = outputs["subject_metrics"]
        getattr(self, f"{stage}_dice").update(torch.stack([metrics[f"dice_{n}"] for n in self.scheme.names], 1))
        getattr(self, f"{stage}_hd95").update(torch.stack([metrics[f"hd95_{n}"] for n in self.scheme.names], 1))
        return outputs

    def subject_metrics(
        self, label_map: torch.Tensor, target_masks: torch.Tensor, affine: torch.Tensor | None,
        annotated: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Dice and HD95 (mm where the grid's affine is known) per subject and scored structure; with `annotated`
        (B, 1, ...) only those voxels count in either mask (nnU-Net's `compute_metrics` with an ignore label)."""
        spacing = voxel_spacing(affine) if affine is not None else None
        masks = self.masks_of(label_map).to(target_masks.device)
        if annotated is not None:
            kept = annotated.to(target_masks.device)
            masks, target_masks = masks * kept, target_masks * kept
        dice, hd95 = subject_scores(self.scheme.scored(masks), self.scheme.scored(target_masks), spacing)
        return {
            **{f"dice_{n}": dice[:, i] for i, n in enumerate(self.scheme.names)},
            **{f"hd95_{n}": hd95[:, i] for i, n in enumerate(self.scheme.names)},
        }

    def outputs_of(
        self, batch: dict[str, Any], logits: torch.Tensor, extras: Sequence[str] = ()
    ) -> dict[str, Any]:
        """The outputs a user receives from model-grid logits: on the source scan's grid where the batch has one
        (the logits resampled as nnU-Net resamples them, `logits_to_source_grid`, then the softmax or sigmoid, the
        argmax or threshold, the post-processing), scored there against the label file as stored; else on the model
        grid. `extras`: `probabilities` also returns them (written as `<subject>_probabilities.nii.gz`), `reference`
        the label maps scored against (in model label values, on the same grid)."""
        image = batch[self.hparams.image_key]
        label = batch.get("label")
        if not on_source_grid(batch):
            probabilities = self.scheme.activation(logits)
            label_map = self.label_maps(probabilities)
            outputs: dict[str, Any] = {
                "volumes": {"input": image, "seg": label_map}, "segments": self.scheme.segments, "as_is": ["seg"],
                "volume_range": self.volume_range,
            }
            if "probabilities" in extras:
                outputs["volumes"]["probabilities"] = probabilities.float()
                outputs["as_is"].append("probabilities")
            if label is not None:
                target = self.scheme.target(label.to(probabilities.device))
                target_masks = target if self.scheme.is_regions else self.scheme.one_hot(target)
                outputs["subject_metrics"] = self.subject_metrics(
                    label_map, target_masks, batch.get("affine"), self.scheme.annotated(label.to(target.device))
                )
                if "reference" in extras:
                    outputs["volumes"]["reference"] = self.scheme.label_map(target_masks)
            return outputs
        maps, kept, references, rows = [], [], [], []
        for i in range(image.shape[0]):
            grid = (batch["source_affine"][i], batch["source_shape"][i])
            source = self.scheme.activation(logits_to_source_grid(
                logits[i].detach().float().cpu(), grid, batch["affine"][i], self.scheme.background_logits()
            )[None])[0]
            label_map = self.label_maps(source[None])
            maps.append(label_map[0])
            if "probabilities" in extras:
                kept.append(source)
            if label is not None:
                truth = self.source_truth(batch, i, grid)[None, None]
                references.append(truth[0])
                target_masks = self.masks_of(self.scheme.target(truth) if not self.scheme.is_regions else truth)
                rows.append(self.subject_metrics(
                    label_map, target_masks, batch["source_affine"][i : i + 1], self.scheme.annotated(truth)
                ))
        outputs = {
            "volumes": {
                "input": image, "seg": maps, **({"probabilities": kept} if kept else {}),
                **({"reference": references} if "reference" in extras and references else {}),
            },
            "segments": self.scheme.segments, "as_is": ["seg", "probabilities"], "volume_range": self.volume_range,
        }
        if rows:
            outputs["subject_metrics"] = {name: torch.cat([row[name] for row in rows]) for name in rows[0]}
        return outputs

    def source_truth(self, batch: dict[str, Any], index: int, grid: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The subject's label on the source grid in model label values: the label file as stored (its values
        mapped through the batch's `label_values`, e.g. BraTS 2021's 4 -> 3), else the model-grid label's nearest
        voxel."""
        files = batch.get("source_label_file")
        if not files or not files[index]:
            label = batch["label"][index]
            label = label if label.shape[0] == 1 else self.scheme.label_map(label[None])[0]
            return to_source_grid(label.long().cpu(), grid, batch["affine"][index], "nearest")[0]
        stored = label_on_source_grid(files[index], grid)
        values = batch.get("label_values")
        if values is None:
            return stored
        lookup = values[index].cpu().tolist()
        model = torch.zeros_like(stored)
        for model_value, file_value in enumerate(lookup):
            model[stored == int(file_value)] = model_value
        return model

    def _log_epoch(self, stage: str) -> None:
        # torchmetrics squeezes a one-column result (one class) to a scalar: back to one entry per column.
        dice = getattr(self, f"{stage}_dice").compute().reshape(-1)
        hd95 = getattr(self, f"{stage}_hd95").compute().reshape(-1)
        values = {f"{stage}/hd95": hd95.nanmean(), f"{stage}/loss": getattr(self, f"{stage}_loss").compute()}
        for i, name in enumerate(self.scheme.names):
            values[f"{stage}/dice_{name}"] = dice[i]
            values[f"{stage}/hd95_{name}"] = hd95[i]
        # Already gathered from every rank by the metric objects, so every rank logs the same numbers.
        # An HD95 without a subject where both masks are non-empty is undefined this epoch: not logged; so is the
        # Dice of a class absent from every prediction and truth, which stays out of the mean (nnU-Net, MONAI).
        self.log_dict({k: v.float() for k, v in values.items() if not torch.isnan(v)})
        self.log(f"{stage}/dice", dice.nanmean().float(), prog_bar=True)
        for metric in ("dice", "hd95", "loss"):
            getattr(self, f"{stage}_{metric}").reset()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self._evaluate(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self._evaluate(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def predict_volumes(
        self, batch: dict[str, Any], window: SlidingWindow, extras: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Masks of whole volumes on the source grid (`outputs_of`), mirrored as `tta` says; Dice and HD95 per subject
        where the batch has a label."""
        image = batch[self.hparams.image_key]
        return self.outputs_of(batch, self.logits(image, window, self.tta), extras)

    def exported_networks(self, size: Sequence[int]) -> list[ExportedNetwork]:
        """The network (`network`: logits) and what predict.py blends per window (`window`: logits averaged over the
        mirrored copies as `tta` says). Spatial sizes vary in multiples of the network's halvings (SwinUNETR's window
        attention fixes them at the training patch)."""
        patch = self.patch_size or [int(s) for s in size]
        multiple = size_multiple(self.hparams.net, self.features, self.hparams.strides)
        image, larger = spatial_examples(int(self.hparams.in_channels), patch, multiple)
        fixed = self.hparams.net == "swinunetr"
        axes = {0: "batch"} if fixed else DYNAMIC_AXES
        seconds = {"image": image.repeat(2, 1, 1, 1, 1)} if fixed else {"image": larger}
        about = {"input": "image after the plan's preprocessing (z units)", "size_multiple": multiple,
                 "classes" if not self.scheme.is_regions else "regions": self.scheme.names}
        return [
            ExportedNetwork("network", self.net.eval(), {"image": image}, "logits", {"image": axes, "logits": axes},
                            seconds, {**about, "output": "logits, one channel per class or region"}),
            ExportedNetwork("window", self.bundle_network(), {"image": image}, "logits",
                            {"image": axes, "logits": axes}, seconds,
                            {**about, "output": "logits averaged over the mirrored copies (the softmax or sigmoid "
                             "comes after blending and resampling, as nnU-Net's)",
                             "mirrored_along": ["depth", "height", "width"] if self.tta else []}),
        ]

    def bundle_network(self) -> torch.nn.Module:
        return WindowLogits(self.net, SPATIAL_AXES if self.tta else ()).eval()


class WindowLogits(torch.nn.Module):
    """A window -> its class or region logits as predict.py blends them: the network's, averaged over the mirrored
    copies along `axes` (none: one call); a module export.py traces."""

    def __init__(self, net: torch.nn.Module, axes: Sequence[int]):
        super().__init__()
        self.net = net
        self.mirrored = MirrorAveraged(net, tuple(axes))

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        return self.mirrored(window)


def on_source_grid(batch: dict[str, Any]) -> bool:
    """Whether the batch says which source scan grid each subject came from (file datasets; not patches)."""
    return batch.get("patch_origin") is None and all(batch.get(k) is not None for k in SOURCE_GRID_KEYS)
