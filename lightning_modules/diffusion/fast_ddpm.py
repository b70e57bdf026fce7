"""3D conditional diffusion (Fast-DDPM): trains on a timestep set, samples it with DDIM; DDPM/DDIM baselines.

Tasks: `translation` (condition from the batch key `cond`, e.g. BraTS T1 -> T2), `denoising`
and `super_resolution` (the batch's `cond`, or, when the dataset has none, the image with
added Gaussian noise / average-pooled and resampled to the image grid), `unconditional`.
The condition is concatenated first, `cat([cond, x_t])`, as in the reference code.

The family on the diffusion core (`DiffusionModule`: schedule, timestep sets, prediction
algebra, samplers, EMA, per-subject noise, the walk, windowed sampling): it adds the network,
the condition volume (cut to each window when sampling is windowed) and its tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric, MetricCollection

from lightning_modules.base import DYNAMIC_AXES
from lightning_modules.diffusion.checkpointing import checkpoint_unet
from lightning_modules.diffusion.diffusion_module import Conditioning, DiffusionModule
from lightning_modules.diffusion.generation_metrics import (
    generation_metrics,
    load_feature_network,
    update_generation_metrics,
)
from lightning_modules.diffusion.low_precision_norm import low_precision_group_norms
from lightning_modules.diffusion.samplers import Denoise
from lightning_modules.diffusion.subject_noise import SubjectNoise, subject_names
from medvol.core.errors import MedvolError

TASKS = ("translation", "denoising", "super_resolution", "unconditional")


class ConditionalDiffusion(DiffusionModule):
    """3D diffusion model around a pluggable denoiser (MONAI's `DiffusionModelUNet` by default).

    Args:
        network: partial denoiser, called with `in_channels` and `out_channels`; the module it
            returns maps (x, timesteps) -> a tensor shaped like the image.
        image_channels: channels of the generated volume (`image`).
        cond_channels: channels of the batch's `cond` (0: the dataset gives none).
        task: `translation`, `denoising`, `super_resolution` or `unconditional`.
        activation_checkpointing: recompute each residual and attention block's activations in the backward pass.
        low_precision_norm: the network's GroupNorms in the autocast dtype (bf16) instead of float32 under mixed
            precision (`low_precision_norm.py`; MAISI's half-precision norms).
        noise_std: std of the Gaussian noise that makes a denoising condition from the image.
        downsample_factor: pooling factor that makes a super-resolution condition from the image.
        image_key: batch key of the target volume.
        cond_key: batch key of the condition.
        ssim_kernel_size: Gaussian window of the 3D SSIM and MS-SSIM metrics.
        mmd_size: volumes are pooled to at most this many voxels per axis for the Gaussian-kernel MMD and the
            training-set metrics (`generation_metrics`).
        diversity_size: volumes are pooled to at most this many voxels per axis for the set MS-SSIM.
        fid_network: a local TorchScript 3D feature network: 3D FID of the samples (`fid`); null: none.
        fid_network_2d: a local TorchScript 2D feature network: MAISI's 2.5D FID (`fid_2p5d`); null: none.
        **diffusion: the diffusion core's settings (`DiffusionModule`): schedule, timestep sets,
            sampler, prediction type, loss reduction, EMA, sampling seed and window, optimizer.
    """

    def __init__(
        self,
        network: Callable[..., nn.Module],
        image_channels: int = 1,
        cond_channels: int = 0,
        task: str = "translation",
        activation_checkpointing: bool = False,
        low_precision_norm: bool = False,
        noise_std: float = 0.1,
        downsample_factor: int = 2,
        image_key: str = "image",
        cond_key: str = "cond",
        ssim_kernel_size: int = 11,
        mmd_size: int = 16,
        diversity_size: int = 32,
        fid_network: str | None = None,
        fid_network_2d: str | None = None,
        **diffusion: Any,
    ) -> None:
        if task not in TASKS:
            raise MedvolError(f"`model.task`: got {task!r}; expected one of {list(TASKS)}")
        super().__init__(**diffusion)
        self.save_hyperparameters(logger=False)
        if task == "translation" and int(cond_channels) < 1:
            raise MedvolError(
                f"`model.task`=translation needs a condition in the batch key `{cond_key}`, but the dataset gives none "
                "(`dataset.cond_modalities` is empty or missing); set e.g. dataset.cond_modalities=[t1]"
            )
        self.task = task
        self.image_channels = int(image_channels)
        self.cond_from_batch = task != "unconditional" and int(cond_channels) > 0
        if task == "unconditional":
            self.cond_channels = 0
        else:
            self.cond_channels = int(cond_channels) if self.cond_from_batch else self.image_channels
        self.attach_network(
            network(in_channels=self.cond_channels + self.image_channels, out_channels=self.image_channels)
        )
        if activation_checkpointing:
            checkpoint_unet(self.network)
        if low_precision_norm:
            low_precision_group_norms(self.network)
        generation = generation_metrics(mmd_size, diversity_size, ssim_kernel_size, fid_network, fid_network_2d)
        self.set_metrics(ssim_kernel_size, loss=MeanMetric(), **generation)

    @classmethod
    def check_settings(cls, settings: Mapping[str, Any]) -> None:
        for key in ("fid_network", "fid_network_2d"):
            if settings.get(key):
                load_feature_network(settings.get(key), key=f"model.{key}")

    # ---- condition and noise -------------------------------------------------------------

    def condition(self, batch: dict[str, Any], noise: SubjectNoise | None = None) -> torch.Tensor | None:
        """The condition volume of `batch` (None when unconditional), on the image grid."""
        if self.task == "unconditional":
            return None
        image = batch[self.hparams.image_key]
        if self.cond_from_batch:
            cond = batch.get(self.hparams.cond_key)
            if cond is None:
                raise MedvolError(
                    f"`model.cond_channels`={self.cond_channels} but the batch has no `{self.hparams.cond_key}`; "
                    "use a dataset with `cond_modalities`, or set model.cond_channels=0"
                )
            if cond.shape[1] != self.cond_channels or cond.shape[2:] != image.shape[2:]:
                raise MedvolError(
                    f"`{self.hparams.cond_key}` has shape {tuple(cond.shape)}, expected {self.cond_channels} channels "
                    f"on the image grid {tuple(image.shape[2:])}; match model.cond_channels and the dataset"
                )
            return cond.float()
        if self.task == "denoising":
            return image.float() + self.hparams.noise_std * self.noise_like(image, noise)
        factor = int(self.hparams.downsample_factor)
        low = F.avg_pool3d(image.float(), kernel_size=factor)
        return F.interpolate(low, size=image.shape[2:], mode="trilinear", align_corners=False)

    def subject_generators(self, batch: dict[str, Any], batch_idx: int, draw: int = 0) -> SubjectNoise:
        """The batch's per-subject noise stream: a subject's condition noise, x_T and validation step and noise,
        drawn in that order, are the same on any rank and in any batch position. Draw k (predict's
        `num_samples`) is seeded as `model.sample_seed` + k would seed draw 0."""
        key = self.hparams.image_key if self.hparams.image_key in batch else self.hparams.cond_key
        names = subject_names(batch, batch_idx, batch[key].shape[0])
        return SubjectNoise(names, self.sample_seed + draw, salt="sample")

    # ---- network, loss, sampling ---------------------------------------------------------

    @staticmethod
    def conditioning(cond: torch.Tensor | None) -> Conditioning:
        """The condition volume, cut to each window when sampling is windowed."""
        return Conditioning(volumes={} if cond is None else {"cond": cond})

    def network_output(
        self, network: nn.Module, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor | None = None
    ) -> torch.Tensor:
        return network(self.network_input(x_t, cond), t)

    def conditioning_examples(
        self, x_t: torch.Tensor, larger: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, dict[int, str]]]:
        """The condition volume on x_t's grid (concatenated first inside the call), where the task has one."""
        if not self.cond_channels:
            return {}
        generator = torch.Generator().manual_seed(1)
        shapes = [(x.shape[0], self.cond_channels, *x.shape[2:]) for x in (x_t, larger)]
        first, second = (torch.randn(shape, generator=generator) for shape in shapes)
        return {"cond": (first, second, DYNAMIC_AXES)}

    def denoiser(self, network: nn.Module, cond: torch.Tensor | None) -> Denoise:
        """`denoise(x_t, t) -> (x0, eps)` for the samplers, on the whole volume."""
        return self.denoiser_for(network, self.conditioning(cond))

    def network_input(self, x_t: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
        # Condition first, as in Fast-DDPM's reference (MONAI's DiffusionInferer uses the other order).
        return x_t if cond is None else torch.cat([cond.to(x_t.dtype), x_t], dim=1)

    def diffusion_loss(
        self, network: nn.Module, x0: torch.Tensor, cond: torch.Tensor | None, t: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        output, target, _ = self.training_prediction(network, x0, t, noise, self.conditioning(cond))
        return self.regression_loss(output, target)

    # ---- Lightning steps -----------------------------------------------------------------

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        x0 = batch[self.hparams.image_key]
        cond = self.condition(batch)
        t = self.draw_timesteps(x0.shape[0], x0.device)
        loss = self.diffusion_loss(self.network, x0, cond, t, self.noise_like(x0))
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, prog_bar=True, batch_size=x0.shape[0])
        return loss

    def _evaluate(self, batch: dict[str, Any], batch_idx: int, metrics: MetricCollection) -> dict[str, Any]:
        x0 = batch[self.hparams.image_key].float()
        noise = self.subject_generators(batch, batch_idx)
        cond = self.condition(batch, noise)
        prefix = metrics.prefix
        size = x0.shape[0]
        sample = self.sample(self.noise_like(x0, noise), self.conditioning(cond), noise).clamp(-1.0, 1.0)
        # A fixed (per-subject) step and noise make the validation loss comparable across epochs and ranks.
        t = self.train_timesteps[noise.integers(len(self.train_timesteps))].to(x0.device)
        loss = self.diffusion_loss(self.sampling_network, x0, cond, t, self.noise_like(x0, noise))
        metrics[f"{prefix}loss"].update(loss, weight=size)
        volumes: dict[str, torch.Tensor] = {}
        if cond is not None:
            volumes["condition"] = cond.detach()
            metrics[f"{prefix}psnr"].update(sample, x0)
            metrics[f"{prefix}ssim"].update(sample, x0)
        volumes["sample"] = sample.detach()
        volumes["target"] = x0.detach()
        update_generation_metrics(metrics, prefix, sample, x0)
        # Unconditional samples have no paired target: PSNR/SSIM against one would mean nothing.
        logged = {n: m for n, m in metrics.items() if cond is not None or not n.endswith(("/psnr", "/ssim"))}
        self.log_evaluation(logged, size, [f"{prefix}psnr", f"{prefix}ssim"])
        # The condition is in the units of the batch's `cond` (e.g. T1), the rest in those of `image`.
        return {"volumes": volumes, "units": {"condition": "cond"}}

    # ---- condition-only generation (predict.py) ------------------------------------------------

    def generation_inputs(self) -> dict[str, int]:
        return {} if self.task == "unconditional" else {self.hparams.cond_key: self.cond_channels}

    @property
    def refines_resolution(self) -> bool:
        return self.task == "super_resolution"

    @torch.no_grad()
    def generate_volumes(self, batch: dict[str, Any], draw: int = 0) -> dict[str, Any]:
        """The seeded sample of each subject from its condition alone: a T1 (translation), a noisy scan
        (denoising) or a coarse scan resampled to the training grid (super-resolution). With the target in
        the batch the condition is made as `test_step` makes it; draw 0 is `test_step`'s sample."""
        cond_key, image_key = self.hparams.cond_key, self.hparams.image_key
        noise = self.subject_generators(batch, 0, draw)
        if image_key in batch:
            cond = self.condition(batch, noise)
        else:
            cond = batch[cond_key].float()
            if cond.shape[1] != self.cond_channels:
                raise MedvolError(
                    f"`{cond_key}` has {cond.shape[1]} channels, the model was trained on {self.cond_channels}; "
                    "give condition volumes with as many channels"
                )
        # A whole scan of any size: padded at the far end (with its darkest value) to what the UNet's levels halve.
        levels = len(getattr(self.network, "block_out_channels", ())) or 1
        size = cond.shape[2:]
        pad = [-n % 2 ** (levels - 1) for n in size]
        cond = F.pad(cond, (0, pad[2], 0, pad[1], 0, pad[0]), value=float(cond.min()))
        x_T = noise.draw((self.image_channels, *cond.shape[2:]), cond.device)
        sample = self.sample(x_T, self.conditioning(cond), noise).clamp(-1.0, 1.0)[..., : size[0], : size[1], : size[2]]
        # A denoised or refined scan is in its input's units; a translation in those of the training targets.
        same_modality = image_key not in batch and self.task in ("denoising", "super_resolution")
        return {"volumes": {"sample": sample}, "units": {"sample": cond_key} if same_modality else {}}
