"""3D conditional diffusion (Fast-DDPM): trains on a timestep set, samples it with DDIM; DDPM/DDIM baselines.

Tasks: `translation` (condition from the batch key `cond`, e.g. BraTS T1 -> T2), `denoising`
and `super_resolution` (the batch's `cond`, or, when the dataset has none, the image with
added Gaussian noise / average-pooled and resampled to the image grid), `unconditional`.
The condition is concatenated first, `cat([cond, x_t])`, as in the reference code.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

from lightning_modules.base import MedvolModule
from lightning_modules.diffusion.checkpointing import checkpoint_blocks, unet_blocks
from lightning_modules.diffusion.ema import EMA
from lightning_modules.diffusion.prediction import (
    check_prediction_type,
    clip_x0,
    to_x0_and_epsilon,
    training_target,
)
from lightning_modules.diffusion.samplers import SAMPLERS, sample_ddim, sample_ddpm
from lightning_modules.diffusion.schedule import NoiseSchedule
from lightning_modules.diffusion.timesteps import antithetic_indices, timestep_set
from medvol.core.errors import MedvolError

TASKS = ("translation", "denoising", "super_resolution", "unconditional")
LOSS_REDUCTIONS = ("mean", "sum")


class ConditionalDiffusion(MedvolModule):
    """3D diffusion model around a pluggable denoiser (MONAI's `DiffusionModelUNet` by default).

    Args:
        network: partial denoiser, called with `in_channels` and `out_channels`; the module it
            returns maps (x, timesteps) -> a tensor shaped like the image.
        image_channels: channels of the generated volume (`image`).
        cond_channels: channels of the batch's `cond` (0: the dataset gives none).
        task: `translation`, `denoising`, `super_resolution` or `unconditional`.
        num_train_timesteps: steps of the forward process.
        beta_schedule: `linear` or `cosine`.
        beta_start: first beta (linear).
        beta_end: last beta (linear).
        timesteps: the training set: its size T (with `timestep_spacing`) or an explicit list;
            T = num_train_timesteps with uniform spacing is full DDPM training.
        timestep_spacing: `non_uniform` (Fast-DDPM's default) or `uniform`.
        sampler: `ddim` (the DDIM update over the sampling set: Fast-DDPM) or `ddpm` (ancestral, every step).
        sampling_timesteps: the set `ddim` walks: null = the training set, or a size (with
            `sampling_spacing`), or an explicit list.
        sampling_spacing: spacing of a sampling set given by its size.
        eta: DDIM stochasticity (0 deterministic, 1 DDPM-like).
        clip_sample: clamp each predicted x0 to [-1, 1] while sampling (the reference does not; it
            steadies short, CPU-sized trainings).
        prediction_type: what the network predicts: `epsilon`, `v` or `sample`.
        loss_reduction: `mean` over voxels, or `sum` over voxels and mean over the batch (the reference).
        ema_decay: decay of the weight EMA used for validation, test and sampling (null: no EMA).
        ema_warmup: ramp the EMA decay up over the first steps.
        activation_checkpointing: recompute the UNet blocks' activations in the backward pass.
        noise_std: std of the Gaussian noise that makes a denoising condition from the image.
        downsample_factor: pooling factor that makes a super-resolution condition from the image.
        sample_seed: seed of the per-subject noise used by validation and test sampling.
        optimizer: partial optimizer.
        scheduler: optional partial LR scheduler (stepped per epoch).
        image_key: batch key of the target volume.
        cond_key: batch key of the condition.
        ssim_kernel_size: Gaussian window of the 3D SSIM metric.
    """

    def __init__(
        self,
        network: Callable[..., nn.Module],
        image_channels: int = 1,
        cond_channels: int = 0,
        task: str = "translation",
        num_train_timesteps: int = 1000,
        beta_schedule: str = "linear",
        beta_start: float = 1e-4,
        beta_end: float = 0.02,
        timesteps: int | Sequence[int] = 10,
        timestep_spacing: str = "non_uniform",
        sampler: str = "ddim",
        sampling_timesteps: int | Sequence[int] | None = None,
        sampling_spacing: str = "uniform",
        eta: float = 0.0,
        clip_sample: bool = False,
        prediction_type: str = "epsilon",
        loss_reduction: str = "mean",
        ema_decay: float | None = 0.999,
        ema_warmup: bool = True,
        activation_checkpointing: bool = False,
        noise_std: float = 0.1,
        downsample_factor: int = 2,
        sample_seed: int = 0,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
        image_key: str = "image",
        cond_key: str = "cond",
        ssim_kernel_size: int = 11,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        if task not in TASKS:
            raise MedvolError(f"`model.task`: got {task!r}; expected one of {list(TASKS)}")
        if sampler not in SAMPLERS:
            raise MedvolError(f"`model.sampler`: got {sampler!r}; expected one of {list(SAMPLERS)}")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise MedvolError(f"`model.loss_reduction`: got {loss_reduction!r}; expected one of {list(LOSS_REDUCTIONS)}")
        if task == "translation" and int(cond_channels) < 1:
            raise MedvolError(
                f"`model.task`=translation needs a condition in the batch key `{cond_key}`, but the dataset gives none "
                "(`dataset.cond_modalities` is empty or missing); set e.g. dataset.cond_modalities=[t1]"
            )
        self.prediction_type = check_prediction_type(prediction_type)
        self.task = task
        self.image_channels = int(image_channels)
        self.cond_from_batch = task != "unconditional" and int(cond_channels) > 0
        if task == "unconditional":
            self.cond_channels = 0
        else:
            self.cond_channels = int(cond_channels) if self.cond_from_batch else self.image_channels
        self.schedule = NoiseSchedule(beta_schedule, num_train_timesteps, beta_start, beta_end)
        steps = self.schedule.num_train_timesteps
        self.train_timesteps = timestep_set(timesteps, timestep_spacing, steps, key="model.timesteps")
        if sampling_timesteps is None:
            self.sampling_timesteps = self.train_timesteps
        else:
            self.sampling_timesteps = timestep_set(
                sampling_timesteps, sampling_spacing, steps, key="model.sampling_timesteps"
            )
        self.network = network(in_channels=self.cond_channels + self.image_channels, out_channels=self.image_channels)
        self.ema = EMA(self.network, ema_decay, ema_warmup) if ema_decay else None
        if activation_checkpointing:
            checkpoint_blocks(unet_blocks(self.network))
        self.optimizer_factory = optimizer or (lambda params: torch.optim.Adam(params, lr=2e-5))
        self.scheduler_factory = scheduler
        evaluation = MetricCollection(
            {
                "psnr": PeakSignalNoiseRatio(data_range=2.0, reduction="elementwise_mean", dim=(1, 2, 3, 4)),
                "ssim": StructuralSimilarityIndexMeasure(data_range=2.0, kernel_size=ssim_kernel_size),
                "loss": MeanMetric(),
            }
        )
        self.val_metrics = evaluation.clone(prefix="val/")
        self.test_metrics = evaluation.clone(prefix="test/")

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.network.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.ema is not None:
            self.ema.update(self.network)

    @property
    def sampling_network(self) -> nn.Module:
        """The weights validation, test and sampling use: the EMA copy when there is one."""
        return self.ema.module if self.ema is not None else self.network

    # ---- condition and noise -------------------------------------------------------------

    def condition(self, batch: dict[str, Any], generators: list[torch.Generator] | None = None) -> torch.Tensor | None:
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
                    f"`{self.hparams.cond_key}` has shape {tuple(cond.shape)}, expected {self.cond_channels} channels on the "
                    f"image grid {tuple(image.shape[2:])}; match model.cond_channels and the dataset"
                )
            return cond.float()
        if self.task == "denoising":
            return image.float() + self.hparams.noise_std * self.noise_like(image, generators)
        factor = int(self.hparams.downsample_factor)
        low = F.avg_pool3d(image.float(), kernel_size=factor)
        return F.interpolate(low, size=image.shape[2:], mode="trilinear", align_corners=False)

    def noise_like(self, x: torch.Tensor, generators: list[torch.Generator] | None) -> torch.Tensor:
        """N(0, 1) noise shaped like x: from the global RNG, or one stream per sample (per subject)."""
        if generators is None:
            return torch.randn(x.shape, device=x.device, dtype=torch.float32)
        return torch.stack([torch.randn(x.shape[1:], generator=g) for g in generators]).to(x.device)

    def subject_generators(self, batch: dict[str, Any], batch_idx: int) -> list[torch.Generator]:
        """One generator per sample, seeded by the subject's name, so a subject's sample is the same on any rank."""
        size = batch[self.hparams.image_key].shape[0]
        names = batch.get("subject") or [f"batch{batch_idx}-{i}" for i in range(size)]
        return [
            torch.Generator().manual_seed(zlib.crc32(str(name).encode()) + int(self.hparams.sample_seed)) for name in names
        ]

    # ---- network, loss, sampling ---------------------------------------------------------

    def denoiser(self, network: nn.Module, cond: torch.Tensor | None) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """`denoise(x_t, t) -> (x0, eps)` for the samplers."""

        def denoise(x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            output = network(self.network_input(x_t, cond), t)
            alpha_bar = self.schedule.alpha_bar(t)
            x0, eps = to_x0_and_epsilon(self.prediction_type, output, x_t, alpha_bar)
            return clip_x0(x0, x_t, alpha_bar) if self.hparams.clip_sample else (x0, eps)

        return denoise

    def network_input(self, x_t: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
        # Condition first, as in Fast-DDPM's reference (MONAI's DiffusionInferer uses the other order).
        return x_t if cond is None else torch.cat([cond.to(x_t.dtype), x_t], dim=1)

    def diffusion_loss(
        self, network: nn.Module, x0: torch.Tensor, cond: torch.Tensor | None, t: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        x_t = self.schedule.add_noise(x0, noise, t)
        output = network(self.network_input(x_t, cond), t)
        target = training_target(self.prediction_type, x0.float(), noise.float(), self.schedule.alpha_bar(t))
        squared = (output.float() - target).square()
        if self.hparams.loss_reduction == "sum":
            return squared.flatten(1).sum(1).mean()
        return squared.mean()

    def draw_timesteps(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """Training steps drawn only from the training set, in antithetic pairs."""
        index = antithetic_indices(batch_size, len(self.train_timesteps))
        return self.train_timesteps[index].to(device)

    @torch.no_grad()
    def sample(self, cond: torch.Tensor | None, x_T: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """Generate x0 from noise x_T with the configured sampler and the EMA weights."""
        denoise = self.denoiser(self.sampling_network, cond)

        def noise_like(x: torch.Tensor) -> torch.Tensor:
            return self.noise_like(x, generators)

        if self.hparams.sampler == "ddpm":
            return sample_ddpm(denoise, x_T, self.schedule, noise_like)
        return sample_ddim(denoise, x_T, self.schedule, self.sampling_timesteps, float(self.hparams.eta), noise_like)

    # ---- Lightning steps -----------------------------------------------------------------

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        x0 = batch[self.hparams.image_key]
        cond = self.condition(batch)
        t = self.draw_timesteps(x0.shape[0], x0.device)
        loss = self.diffusion_loss(self.network, x0, cond, t, self.noise_like(x0, None))
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, prog_bar=True, batch_size=x0.shape[0])
        return loss

    def _evaluate(self, batch: dict[str, Any], batch_idx: int, metrics: MetricCollection) -> dict[str, Any]:
        x0 = batch[self.hparams.image_key].float()
        generators = self.subject_generators(batch, batch_idx)
        cond = self.condition(batch, generators)
        prefix = metrics.prefix
        size = x0.shape[0]
        sample = self.sample(cond, self.noise_like(x0, generators), generators).clamp(-1.0, 1.0)
        # A fixed (per-subject) step and noise make the validation loss comparable across epochs and ranks.
        index = torch.tensor([int(torch.randint(len(self.train_timesteps), (1,), generator=g)) for g in generators])
        t = self.train_timesteps[index].to(x0.device)
        loss = self.diffusion_loss(self.sampling_network, x0, cond, t, self.noise_like(x0, generators))
        metrics[f"{prefix}loss"].update(loss, weight=size)
        volumes: dict[str, torch.Tensor] = {}
        if cond is not None:
            volumes["condition"] = cond.detach()
            metrics[f"{prefix}psnr"].update(sample, x0)
            metrics[f"{prefix}ssim"].update(sample, x0)
        volumes["sample"] = sample.detach()
        volumes["target"] = x0.detach()
        # Unconditional samples have no paired target: only the loss is a metric then.
        names = [name for name in metrics if cond is not None or name.endswith("loss")]
        for name in names:
            self.log(name, metrics[name], prog_bar=name in (f"{prefix}psnr", f"{prefix}ssim"), batch_size=size)
        # The condition is in the units of the batch's `cond` (e.g. T1), the rest in those of `image`.
        return {"volumes": volumes, "units": {"condition": "cond"}}

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self._evaluate(batch, batch_idx, self.val_metrics)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self._evaluate(batch, batch_idx, self.test_metrics)
