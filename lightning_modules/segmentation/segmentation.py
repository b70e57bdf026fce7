"""3D segmentation trained on patches and evaluated on whole volumes by Gaussian-blended sliding windows.

Training cuts one patch per sample (at random or centred on the label) out of the whole-volume
batch; validation and testing run `sliding_window_inference` over the whole volume with the
training patch as the window, so the network always sees inputs of the size it was trained on.
Dice and HD95 are computed per subject and gathered from all ranks before averaging.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from monai.transforms import KeepLargestConnectedComponent
from monai.utils import convert_to_tensor
from torchmetrics import MeanMetric

from lightning_modules.base import MedvolModule
from lightning_modules.segmentation.label_scheme import LabelScheme
from lightning_modules.segmentation.losses import build_loss
from lightning_modules.segmentation.networks import build_network, check_size, supervised_heads
from lightning_modules.segmentation.patch_sampling import SAMPLINGS, cut_patches, patch_origins
from lightning_modules.segmentation.subject_scores import SubjectScores, subject_scores
from medvol.core.errors import MedvolError
from medvol.volumes.sliding_window import SlidingWindow


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
        feature_size: SwinUNETR embedding size (multiple of 12).
        loss: dice_ce or dice_focal.
        patch_size: training patch and sliding window; null trains on whole volumes.
        patch_sampling: random, or label_balanced (a `pos_ratio` share centred on the label).
        pos_ratio: share of label-centred patches.
        overlap: sliding-window overlap.
        sw_batch_size: windows per network call.
        stitch_on_cpu: keep the blended whole-volume output on the CPU (windows still run on the device).
        threshold: sigmoid probability for a region voxel.
        largest_component: keep only the largest connected component per class/region.
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
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
        image_key: str = "image",
        pad_value: float | Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.scheme = LabelScheme(num_classes, regions, threshold, class_names)
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
            res_block,
        )
        self.supervision_weights = supervision_weights(len(self.features)) if deep_supervision else None
        self.pad_value = pad_value_of(pad_value)
        self.loss = build_loss(loss, self.scheme.is_regions)
        self.optimizer_factory = optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3))
        self.scheduler_factory = scheduler
        # Every region, or every class but the background.
        first = 0 if self.scheme.is_regions else 1
        self.largest = (
            KeepLargestConnectedComponent(applied_labels=list(range(first, self.scheme.out_channels)), is_onehot=True)
            if largest_component
            else None
        )
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
        loss = self.training_loss(self(image), self.scheme.target(label))
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, prog_bar=True, batch_size=image.shape[0])
        return loss

    def training_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of the full-resolution output, plus with deep supervision the weighted losses of the coarser heads
        (DynUNet stacks them on dim 1, already upsampled to the patch)."""
        if self.supervision_weights is None or output.dim() == target.dim():
            return self.loss(output, target)
        return sum(  # type: ignore[return-value]
            w * self.loss(output[:, i], target) for i, w in enumerate(self.supervision_weights)
        )

    def sliding_window(self, image: torch.Tensor) -> torch.Tensor:
        """Logits for whole volumes: windows of the training patch, overlap, Gaussian blending; windows past a
        small volume are padded with the training background (`pad_value`)."""
        roi = self.patch_size or list(image.shape[2:])
        window = SlidingWindow.of(
            roi, overlap=self.hparams.overlap, mode="gaussian", batch_size=self.hparams.sw_batch_size,
            device=self.device, output_device=torch.device("cpu") if self.hparams.stitch_on_cpu else self.device,
            pad_value=self.pad_value,
        )
        return window(self.net, image)

    def postprocess(self, logits: torch.Tensor) -> torch.Tensor:
        """Binary masks (B, C, ...): threshold or argmax, then optionally the largest connected component."""
        masks = self.scheme.discretise(logits)
        if self.largest is not None:
            masks = torch.stack([convert_to_tensor(self.largest(m), track_meta=False) for m in masks])
        return masks

    def _evaluate(self, batch: dict[str, Any], stage: str) -> dict[str, Any]:
        image, label = batch[self.hparams.image_key], batch["label"]
        self.scheme.check_label(label, batch.get("source_file"))
        logits = self.sliding_window(image)
        target = self.scheme.target(label).to(logits.device)
        loss_metric: MeanMetric = getattr(self, f"{stage}_loss")
        loss_metric.update(self.loss(logits, target).detach().to(self.device), weight=image.shape[0])
        masks = self.postprocess(logits)
        target_masks = target if self.scheme.is_regions else self.scheme.one_hot(target)
        spacing = voxel_spacing(batch["affine"]) if "affine" in batch else None
        dice, hd95 = subject_scores(self.scheme.scored(masks), self.scheme.scored(target_masks), spacing)
        getattr(self, f"{stage}_dice").update(dice)
        getattr(self, f"{stage}_hd95").update(hd95)
        per_subject = {f"dice_{n}": dice[:, i] for i, n in enumerate(self.scheme.names)}
        per_subject.update({f"hd95_{n}": hd95[:, i] for i, n in enumerate(self.scheme.names)})
        return {
            "volumes": {
                "input": image.detach(),
                "seg": self.scheme.label_map(masks).to(image.device),
                "label": self.scheme.label_map(target_masks).to(image.device),
            },
            "segments": self.scheme.segments,
            "subject_metrics": per_subject,
        }

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
        """Masks of whole volumes window by window; Dice and HD95 per subject where the batch has a label."""
        image = batch[self.hparams.image_key]
        if window.pad_value is None:
            window = dataclasses.replace(window, pad_value=self.pad_value)
        masks = self.postprocess(window(self.net, image))
        outputs: dict[str, Any] = {
            "volumes": {"input": image, "seg": self.scheme.label_map(masks)},
            "segments": self.scheme.segments,
        }
        if batch.get("label") is not None:
            target = self.scheme.target(batch["label"])
            target_masks = target if self.scheme.is_regions else self.scheme.one_hot(target)
            spacing = voxel_spacing(batch["affine"]) if "affine" in batch else None
            dice, hd95 = subject_scores(self.scheme.scored(masks), self.scheme.scored(target_masks), spacing)
            outputs["subject_metrics"] = {
                **{f"dice_{n}": dice[:, i] for i, n in enumerate(self.scheme.names)},
                **{f"hd95_{n}": hd95[:, i] for i, n in enumerate(self.scheme.names)},
            }
        return outputs
