"""X-ray-to-CT: one stage of a progressive 3D diffusion cascade conditioned on radiographs.

Stage 1 generates a low-resolution CT from the views alone; stage k >= 2 also sees the
previous stage's output, upsampled to its grid, as an extra input channel (cascaded
diffusion). In training that input is the ground truth degraded to the previous stage's grid
plus Gaussian noise of a random level (conditioning augmentation, Ho et al. 2021), so the
stage learns to correct an imperfect previous output; in validation and test it is the actual
output of the previous stages, run from their best weights (held frozen inside this module,
so a stage's checkpoint generates from X-rays on its own).

The diffusion core (fp32 noise tables, v/epsilon/x0 algebra, samplers over any timestep set,
EMA) is the Fast-DDPM one in `lightning_modules.diffusion`. The projection-consistency loss
compares the DRRs of the predicted clean volume (x0 recovered from v) with the input views.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

from lightning_modules.base import MedvolModule
from lightning_modules.diffusion.ema import EMA
from lightning_modules.diffusion.prediction import check_prediction_type, to_x0_and_epsilon, training_target
from lightning_modules.diffusion.samplers import sample_ddim
from lightning_modules.diffusion.schedule import NoiseSchedule
from lightning_modules.diffusion.timesteps import antithetic_indices, timestep_set
from lightning_modules.xray2ct.denoiser import (
    ViewConditionedDenoiser,
    load_from_previous_stage,
    network_settings,
)
from lightning_modules.xray2ct.physics import ProjectionLoss
from medvol.core.errors import MedvolError

log = logging.getLogger("medvol")


def as_size(size: int | Sequence[int]) -> list[int]:
    """A volume size as three ints (an int means a cube)."""
    return [int(size)] * 3 if isinstance(size, int) else [int(s) for s in size]


def _load_stage(path: str) -> tuple[dict[str, Any], ViewConditionedDenoiser]:
    """A finished stage's hyperparameters and its EMA network, from its checkpoint."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise MedvolError(f"`model.previous_stages`: {path} does not exist; expected a finished stage's best.ckpt") from None
    hparams = dict(checkpoint.get("hyper_parameters", {}))
    if "stage" not in hparams or "views" not in hparams:
        raise MedvolError(f"`model.previous_stages`: {path} is not an X-ray-to-CT stage checkpoint")
    network = ViewConditionedDenoiser(**network_settings(hparams))
    prefix = "ema.module."
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    network.load_state_dict(state)
    return hparams, network.eval().requires_grad_(False)


class XrayToCT(MedvolModule):
    """One cascade stage: a view-conditioned 3D diffusion model of the CT at this stage's size.

    Args:
        stage: 1 for the first (lowest-resolution) stage; k >= 2 takes stage k-1's output as input.
        size: this stage's CT volume size (D, H, W): the dataset's size.
        views: the view names of the batch's `xray` channels (ap, lateral).
        xray_size: (H, W) of the views.
        token_dim, encoder_channels, channels, attention_levels, num_res_blocks, num_head_channels,
            norm_num_groups: the network (see `ViewConditionedDenoiser`).
        num_train_timesteps: length of the forward process (1000).
        beta_schedule: `cosine` (default here) or `linear`.
        prediction_type: `v` (default), `epsilon` or `sample`.
        timesteps: steps trained on and sampled (Fast-DDPM), an int or an explicit list.
        timestep_spacing: `uniform` or `non_uniform` for an int `timesteps`.
        eta: DDIM eta of the sampler (0: deterministic).
        physics_weight: weight of the projection-consistency loss.
        window: the HU window the dataset mapped onto [-1, 1] (for the physics loss and HU outputs).
        mu_water: attenuation of water per mm, as the dataset's projector used.
        previous_noise: largest std of the noise added to the previous-stage input in training.
        previous_sampling_noise: std added to the previous stages' outputs at sampling time.
        previous_stages: best checkpoints of stages 1..k-1 (set by the cascade runner).
        init_from: a checkpoint whose network weights this stage starts from (stage k-1's best).
        ema_decay: decay of the EMA weights used for validation, test and sampling.
        ema_warmup: ramp the EMA decay up over the first updates (short runs).
        optimizer: partial optimizer.
        scheduler: optional partial LR scheduler.
        sample_seed: seed of the sampling noise in validation/test (the same subjects, the same noise).
        image_key: batch key of the CT target.
    """

    def __init__(
        self,
        stage: int = 1,
        size: Sequence[int] = (16, 16, 16),
        views: Sequence[str] = ("ap", "lateral"),
        xray_size: Sequence[int] = (32, 32),
        token_dim: int = 32,
        encoder_channels: Sequence[int] = (16, 32),
        channels: Sequence[int] = (16, 32, 32),
        attention_levels: Sequence[bool] = (False, False, True),
        num_res_blocks: int = 1,
        num_head_channels: int = 16,
        norm_num_groups: int = 8,
        num_train_timesteps: int = 1000,
        beta_schedule: str = "cosine",
        prediction_type: str = "v",
        timesteps: int | Sequence[int] = 10,
        timestep_spacing: str = "uniform",
        eta: float = 0.0,
        physics_weight: float = 0.1,
        window: Sequence[float] = (-1000.0, 1000.0),
        mu_water: float = 0.02,
        previous_noise: float = 0.2,
        previous_sampling_noise: float = 0.05,
        previous_stages: Sequence[str] = (),
        init_from: str | None = None,
        ema_decay: float = 0.999,
        ema_warmup: bool = True,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
        sample_seed: int = 0,
        image_key: str = "image",
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=["optimizer", "scheduler"])
        if int(stage) < 1:
            raise MedvolError(f"`model.stage` must be >= 1, got {stage}")
        if len(previous_stages) != int(stage) - 1:
            raise MedvolError(
                f"`model.previous_stages` lists {len(previous_stages)} checkpoint(s) for stage {stage}; expected the best "
                f"checkpoints of stages 1..{int(stage) - 1} (run the cascade with `experiment=xray2ct_cascade`)"
            )
        self.prediction_type = check_prediction_type(prediction_type)
        self.network = ViewConditionedDenoiser(**network_settings(self.hparams))
        if any(s % self.network.downsampling for s in as_size(size)):
            raise MedvolError(
                f"stage {stage} volume size {as_size(size)} must divide by the network's downsampling "
                f"{self.network.downsampling} (2 ** (len(model.channels) - 1)); change the stage's size"
            )
        self.previous = nn.ModuleList()
        self.previous_settings: list[dict[str, Any]] = []
        for path in previous_stages:
            settings, network = _load_stage(path)
            if list(settings["views"]) != list(views):
                raise MedvolError(
                    f"`model.views` {list(views)} differ from the views {list(settings['views'])} of stage "
                    f"{settings['stage']} ({path}); every stage sees the same radiographs"
                )
            self.previous.append(network)
            self.previous_settings.append(settings)
        if init_from:
            _, source = _load_stage(init_from)
            skipped = load_from_previous_stage(self.network, source)
            log.info("stage %s starts from %s (%d tensors not carried over)", stage, init_from, len(skipped))
        self.ema = EMA(self.network, ema_decay, warmup=ema_warmup)
        self.schedule = NoiseSchedule(beta_schedule, num_train_timesteps)
        self.register_buffer("timesteps", timestep_set(timesteps, timestep_spacing, num_train_timesteps, "model.timesteps"))
        self.physics = ProjectionLoss(views, window, (-1.0, 1.0), mu_water)
        self.optimizer_factory = optimizer or (lambda params: torch.optim.Adam(params, lr=1e-4))
        self.scheduler_factory = scheduler
        evaluation = MetricCollection(
            {
                "psnr": PeakSignalNoiseRatio(data_range=2.0, reduction="elementwise_mean", dim=(1, 2, 3, 4)),
                "ssim": StructuralSimilarityIndexMeasure(data_range=2.0, kernel_size=5),
                "physics_loss": MeanMetric(),
            }
        )
        self.val_metrics = evaluation.clone(prefix="val/")
        self.test_metrics = evaluation.clone(prefix="test/")

    # -- data --------------------------------------------------------------------------------------------------

    def _inputs(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if "xray" not in batch:
            raise MedvolError(
                f"the batch has no `xray` views (keys: {sorted(batch)}); model=xray2ct needs dataset=xray_ct or "
                "dataset=synthetic with dataset.views=[ap,lateral] and dataset.image_modalities=[ct]"
            )
        x0, views = batch[self.hparams.image_key], batch["xray"]
        if views.shape[1] != len(self.hparams.views):
            raise MedvolError(
                f"the batch has {views.shape[1]} X-ray views, model.views lists {len(self.hparams.views)} "
                f"({list(self.hparams.views)}); set dataset.views and model.views alike"
            )
        if list(x0.shape[2:]) != as_size(self.hparams.size):
            raise MedvolError(
                f"stage {self.hparams.stage}: `model.size` is {as_size(self.hparams.size)} but the data gives volumes of "
                f"{list(x0.shape[2:])}; set model.size to the dataset's volume size"
            )
        if x0.shape[1] != 1:
            raise MedvolError(f"model=xray2ct generates one CT channel, got image shape {tuple(x0.shape)}")
        return x0, views, batch["affine"]

    def degraded(self, x0: torch.Tensor) -> torch.Tensor:
        """The ground truth at the previous stage's grid, upsampled back: what a perfect previous stage would give."""
        low = F.interpolate(x0, size=tuple(as_size(self.previous_settings[-1]["size"])), mode="area")
        return F.interpolate(low, size=x0.shape[2:], mode="trilinear", align_corners=False)

    # -- training ----------------------------------------------------------------------------------------------

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.network.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        x0, views, affine = self._inputs(batch)
        b = x0.shape[0]
        t = self.timesteps[antithetic_indices(b, len(self.timesteps)).to(self.timesteps.device)]
        noise = torch.randn_like(x0)
        x_t = self.schedule.add_noise(x0, noise, t).to(x0.dtype)
        previous = None
        if self.hparams.stage > 1:
            level = torch.rand(b, 1, 1, 1, 1, device=x0.device) * self.hparams.previous_noise
            previous = self.degraded(x0) + level * torch.randn_like(x0)
        output = self.network(x_t, t, views, previous)
        alpha_bar = self.schedule.alpha_bar(t)
        target = training_target(self.prediction_type, x0.float(), noise, alpha_bar)
        diffusion_loss = F.mse_loss(output.float(), target)
        losses = {"diffusion_loss": diffusion_loss}
        if self.hparams.physics_weight > 0:
            x0_hat, _ = to_x0_and_epsilon(self.prediction_type, output, x_t, alpha_bar)
            losses["physics_loss"] = self.physics(x0_hat, views, affine)
        loss = diffusion_loss + self.hparams.physics_weight * losses.get("physics_loss", 0.0)
        self.log_dict({f"train/{k}": v.detach() for k, v in losses.items()}, on_step=True, on_epoch=True, batch_size=b)
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, prog_bar=True, batch_size=b)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.is_accumulation_boundary(batch_idx):
            self.ema.update(self.network)

    def is_accumulation_boundary(self, batch_idx: int) -> bool:
        accumulate = int(self.trainer.accumulate_grad_batches or 1)
        return (batch_idx + 1) % accumulate == 0 or bool(self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    # -- sampling ----------------------------------------------------------------------------------------------

    def _noise(self, shape: Sequence[int], subjects: Sequence[str], device: torch.device, salt: int) -> torch.Tensor:
        """Per-subject noise from `sample_seed`, so a subject gets the same noise on any rank, batch or epoch."""
        draws = []
        for subject in subjects:
            key = f"{self.hparams.sample_seed}/{subject}/{salt}".encode()
            generator = torch.Generator().manual_seed(zlib.crc32(key))
            draws.append(torch.randn(tuple(shape), generator=generator))
        return torch.stack(draws).to(device)

    def _sample_stage(
        self, network: ViewConditionedDenoiser, views: torch.Tensor, size: Sequence[int], previous: torch.Tensor | None,
        subjects: Sequence[str], salt: int,
    ) -> torch.Tensor:
        x_T = self._noise((1, *size), subjects, views.device, salt)

        def denoise(x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            output = network(x_t.to(views.dtype), t, views, previous)
            return to_x0_and_epsilon(self.prediction_type, output, x_t, self.schedule.alpha_bar(t))

        generator = torch.Generator().manual_seed(self.hparams.sample_seed + salt)

        def noise_like(x: torch.Tensor) -> torch.Tensor:
            return torch.randn(x.shape, generator=generator).to(x.device)

        return sample_ddim(denoise, x_T, self.schedule, self.timesteps, self.hparams.eta, noise_like).clamp(-1.0, 1.0)

    @torch.no_grad()
    def generate(self, views: torch.Tensor, size: Sequence[int], subjects: Sequence[str]) -> dict[str, torch.Tensor]:
        """Run the cascade from the views: every previous stage, then this one (EMA weights); model units."""
        outputs: dict[str, torch.Tensor] = {}
        previous = None
        for index, (settings, network) in enumerate(zip(self.previous_settings, self.previous, strict=True), start=1):
            stage_size = as_size(settings["size"])
            upsampled = self._upsample(previous, stage_size, subjects, salt=index)
            previous = self._sample_stage(network, views, stage_size, upsampled, subjects, salt=index)
            outputs[f"stage{index}"] = previous
        upsampled = self._upsample(previous, size, subjects, salt=int(self.hparams.stage))
        outputs["ct"] = self._sample_stage(self.ema.module, views, size, upsampled, subjects, salt=int(self.hparams.stage))
        return outputs

    def _upsample(
        self, volume: torch.Tensor | None, size: Sequence[int], subjects: Sequence[str], salt: int
    ) -> torch.Tensor | None:
        """The previous stage's output on this grid, with the sampling-time conditioning noise."""
        if volume is None:
            return None
        upsampled = F.interpolate(volume, size=tuple(size), mode="trilinear", align_corners=False)
        noise = self._noise(upsampled.shape[1:], subjects, upsampled.device, salt=1000 + salt)
        return upsampled + self.hparams.previous_sampling_noise * noise

    def _evaluate(self, batch: dict[str, Any], metrics: MetricCollection) -> dict[str, Any]:
        x0, views, affine = self._inputs(batch)
        subjects = batch.get("subject") or [str(i) for i in range(x0.shape[0])]
        generated = self.generate(views, list(x0.shape[2:]), subjects)
        ct = generated["ct"]
        prefix = metrics.prefix
        metrics[f"{prefix}psnr"].update(ct, x0)
        metrics[f"{prefix}ssim"].update(ct, x0)
        metrics[f"{prefix}physics_loss"].update(self.physics(ct, views, affine), weight=x0.shape[0])
        for name, metric in metrics.items():
            self.log(name, metric, prog_bar=name == f"{prefix}psnr", batch_size=x0.shape[0])
        volumes: dict[str, torch.Tensor] = {}
        if self.previous_settings:
            volumes["previous"] = F.interpolate(generated[f"stage{len(self.previous)}"], size=x0.shape[2:], mode="nearest")
        volumes.update({"ct": ct, "target": x0.detach()})
        return {"volumes": volumes, "difference": ("ct", "target"), "window": tuple(self.hparams.window)}

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self._evaluate(batch, self.val_metrics)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self._evaluate(batch, self.test_metrics)
