"""X-ray-to-CT: one stage of a progressive 3D diffusion cascade conditioned on radiographs.

Stage 1 generates a low-resolution CT from the views alone, on the whole volume; stage k >= 2
is conditional super-resolution diffusion: it also sees the previous stage's output, upsampled
to its grid, and three global-coordinate channels (cascaded diffusion), and by default diffuses only
the residual of the CT over that upsampled volume, which it adds back (`residual`). Stage k >= 2 trains on
random crops (`crop_size`, 64^3 by default) of its grid, cut jointly from the target, the
condition and the coordinates (PatchDDM, MedSyn's super-resolution stage), so its memory
follows the crop and not the volume. In training the condition is the ground truth degraded to
the previous stage's grid plus Gaussian noise of a random level (conditioning augmentation,
Ho et al. 2021), so the stage learns to correct an imperfect previous output; in validation,
test and predict it is the actual output of the previous stages, run from their best weights
(held frozen inside this module, so a stage's checkpoint generates from X-rays on its own).
Sampling a crop-trained stage runs every denoising step window by window over the whole
volume (the core's Gaussian-blended windows, the training crop by default), the step, the view
tokens, the condition and the coordinates cut to each window.

The module derives from the diffusion core (`lightning_modules.diffusion.DiffusionModule`:
fp32 noise tables, v/epsilon/x0 algebra, timestep sets, samplers, EMA, per-subject noise, the
walk and windowed sampling) and adds the view-conditioned network, the cascade and the
projection-consistency loss, which compares the DRRs of the predicted clean volume (x0
recovered from the network's output, plus the base at a residual stage) with the input views.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric, MetricCollection

from lightning_modules.base import DYNAMIC_AXES
from lightning_modules.diffusion.diffusion_module import Conditioning, DiffusionModule, SamplingPlan
from lightning_modules.diffusion.prediction import check_prediction_type
from lightning_modules.diffusion.samplers import SAMPLERS
from lightning_modules.diffusion.schedule import NoiseSchedule
from lightning_modules.diffusion.subject_noise import SubjectNoise, subject_names
from lightning_modules.diffusion.timesteps import timestep_set
from lightning_modules.xray2ct.body_metrics import BodyMAE, BodyPSNR, BodySSIM
from lightning_modules.xray2ct.crops import coordinate_channels, random_crops
from lightning_modules.xray2ct.denoiser import (
    NETWORK_SETTINGS,
    ViewConditionedDenoiser,
    network_settings,
    zero_output,
)
from lightning_modules.xray2ct.earlier_stages import (
    EarlierStage,
    check_same_radiographs,
    read_stage,
    read_stages,
    rebuilt_stages,
    start_from_stage,
)
from lightning_modules.xray2ct.physics import ProjectionLoss
from lightning_modules.xray2ct.stage_settings import as_size, check_grids, check_stage, crop_of, window_of
from medvol.core.errors import MedvolError

log = logging.getLogger("medvol")

# The diffusion core's settings where X-ray-to-CT's defaults differ from Fast-DDPM's.
DIFFUSION_DEFAULTS = {"beta_schedule": "cosine", "prediction_type": "v", "timestep_spacing": "uniform"}


# The forward process and the walk a stage was sampled with, recorded in its checkpoint's hyperparameters; a cascade
# samples every earlier stage with that stage's own (`stage_plan`), and hands it on with its `previous_sampling_noise`.
SAMPLING_SETTINGS = (
    "num_train_timesteps", "beta_schedule", "beta_start", "beta_end", "timesteps", "timestep_spacing", "sampler",
    "sampling_timesteps", "sampling_spacing", "eta", "clip_sample", "prediction_type", "previous_sampling_noise",
)


def _plain(value: Any) -> Any:
    """A setting comparable across a config and a checkpoint (sequences as lists)."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value


def sampling_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A stage's `SAMPLING_SETTINGS` as it ran them: its own, else this family's or the core's defaults."""
    defaults = {
        name: p.default for cls in (DiffusionModule, XrayToCT)
        for name, p in inspect.signature(cls.__init__).parameters.items() if p.default is not inspect.Parameter.empty
    }
    return {key: _plain(settings.get(key, DIFFUSION_DEFAULTS.get(key, defaults[key]))) for key in SAMPLING_SETTINGS}


def stage_plan(settings: dict[str, Any], source: str) -> tuple[SamplingPlan, float]:
    """The plan a stage was sampled with and its hand-off noise level, from its recorded settings; refused when this
    version cannot sample it so (an unknown sampler or target, a step outside its schedule, a negative noise level)."""
    s = sampling_settings(settings)
    where = f"stage {settings['stage']} ({source}) cannot be sampled with the settings it recorded"
    try:
        if s["sampler"] not in SAMPLERS:
            raise MedvolError(f"`model.sampler` {s['sampler']!r} is not one of {list(SAMPLERS)}")
        noise = float(s["previous_sampling_noise"])
        if not noise >= 0.0:
            raise MedvolError(f"`model.previous_sampling_noise` {noise} is not a std >= 0")
        schedule = NoiseSchedule(s["beta_schedule"], s["num_train_timesteps"], s["beta_start"], s["beta_end"])
        steps = schedule.num_train_timesteps
        trained = timestep_set(s["timesteps"], s["timestep_spacing"], steps, key="model.timesteps")
        walked = trained if s["sampling_timesteps"] is None else timestep_set(
            s["sampling_timesteps"], s["sampling_spacing"], steps, key="model.sampling_timesteps"
        )
        plan = SamplingPlan(schedule, walked, s["sampler"], float(s["eta"]), bool(s["clip_sample"]),
                            check_prediction_type(s["prediction_type"]))
    except (MedvolError, ValueError, TypeError) as error:
        raise MedvolError(f"{where}: {str(error).removeprefix('medvol: error: ')}") from None
    return plan, noise


def is_residual(settings: dict[str, Any]) -> bool:
    """Whether a stage diffuses the residual over its previous-stage input (stage >= 2 with `residual`; stages
    saved before the setting existed diffuse the CT itself)."""
    return int(settings["stage"]) > 1 and bool(settings.get("residual", False))


class XrayToCT(DiffusionModule):
    """One cascade stage: a view-conditioned 3D diffusion model of the CT at this stage's size.

    Args:
        stage: 1 for the first (lowest-resolution) stage; k >= 2 takes stage k-1's output as input.
        size: this stage's CT volume size (D, H, W): the dataset's size.
        views: the view names of the batch's `xray` channels (ap, lateral).
        xray_size: (H, W) of the views.
        physics_weight: weight of the projection-consistency loss.
        window: the HU window the dataset mapped onto [-1, 1] (for the physics loss and HU outputs).
        mu_water: attenuation of water per mm, as the dataset's projector used.
        field_of_view: the millimetres the stage's CT grid spans per axis (its views' field of view; null:
            unknown, a dataset at each scan's own spacing); every stage of a cascade must see the same.
        previous_noise: largest std of the noise added to the previous-stage input in training.
        previous_sampling_noise: std added to the previous stages' outputs at sampling time.
        crop_size: the training crop of a stage >= 2 (an int is a cube; capped at the volume; null:
            the whole volume); also its default sampling window. Stage 1 always trains whole.
        residual: a stage >= 2 diffuses the residual of the CT over its base, the upsampled previous stage
            (in training the ground truth degraded to the previous stage's grid, without the conditioning
            noise its network input gets), and adds the base back (SRDiff, Li et al. 2022); its output
            convolution starts at zero, so with `prediction_type=sample` an untrained stage samples its
            identity baseline. False: it diffuses the CT itself.
        previous_stages: best checkpoints of stages 1..k-1 (set by the cascade runner).
        init_from: a checkpoint whose network weights this stage starts from (stage k-1's best).
        previous_settings: the hyperparameters of stages 1..k-1. Recorded in this stage's hyperparameters
            when it reads `previous_stages`; a module restored from its checkpoint (predict.py,
            `load_from_checkpoint`) builds the earlier networks from them and reads neither `previous_stages`
            nor `init_from`, whose weights the checkpoint holds, so a moved or copied run still generates.
        image_key: batch key of the CT target.
        **settings: the network's (`ViewConditionedDenoiser`: token_dim, encoder_channels, channels,
            attention_levels, num_res_blocks, num_head_channels, norm_num_groups) and the diffusion
            core's (`DiffusionModule`: schedule, timestep sets, sampler, prediction type, EMA,
            sampling seed and window, optimizer); the core defaults to a cosine schedule,
            v-prediction and a uniform set here. `sampling_window` null means the training crop.

    The projection-consistency loss needs the whole volume: a stage trained on crops smaller than
    its volume trains without it (validation and test still report the sampled CT's).
    """

    default_lr = 1e-4

    def __init__(
        self,
        stage: int = 1,
        size: Sequence[int] = (16, 16, 16),
        views: Sequence[str] = ("ap", "lateral"),
        xray_size: Sequence[int] = (32, 32),
        physics_weight: float = 0.1,
        window: Sequence[float] = (-1024.0, 3071.0),
        mu_water: float = 0.02,
        field_of_view: Sequence[float] | None = None,
        previous_noise: float = 0.2,
        previous_sampling_noise: float = 0.05,
        crop_size: int | Sequence[int] | None = 64,
        residual: bool = True,
        previous_stages: Sequence[str] = (),
        init_from: str | None = None,
        previous_settings: Sequence[dict[str, Any]] | None = None,
        image_key: str = "image",
        **settings: Any,
    ) -> None:
        diffusion = {key: value for key, value in settings.items() if key not in NETWORK_SETTINGS}
        super().__init__(**{**DIFFUSION_DEFAULTS, **diffusion})
        self.save_hyperparameters(logger=False, ignore=["optimizer", "scheduler"])
        check_stage(stage, previous_stages, previous_settings, previous_sampling_noise)
        network = ViewConditionedDenoiser(**network_settings(self.hparams))
        check_grids(dict(self.hparams), network.downsampling)
        self.crop = crop_of(dict(self.hparams))
        self.residual = is_residual(dict(self.hparams))
        restoring = previous_settings is not None
        # A restored stage rebuilds its earlier stages from its own checkpoint, which also holds their weights.
        earlier = rebuilt_stages(previous_settings) if restoring else read_stages(previous_stages)
        self.hold_earlier_stages(earlier, views)
        if init_from and not restoring:
            start_from_stage(network, init_from, stage)
        if self.residual:
            # The residual starts at zero: what stage k-1's output layer learned predicts a whole CT, not a correction.
            zero_output(network)
        self.attach_network(network)
        self.physics = ProjectionLoss(views, window, (-1.0, 1.0), mu_water)
        body = {"window": tuple(float(w) for w in window)}
        self.set_metrics(
            5, physics_loss=MeanMetric(),
            body_mae_hu=BodyMAE(**body), body_psnr=BodyPSNR(**body), body_ssim=BodySSIM(**body),
        )

    def hold_earlier_stages(self, earlier: list[EarlierStage], views: Sequence[str]) -> None:
        """Hold each earlier stage frozen with its settings and its own sampling plan, once checked against this one."""
        self.previous = nn.ModuleList()
        self.previous_settings: list[dict[str, Any]] = []
        # Each earlier stage's own sampling plan and hand-off noise (not module state: rebuilt from its settings).
        self.previous_plans: list[tuple[SamplingPlan, float]] = []
        for previous, previous_network, source in earlier:
            check_same_radiographs(self.hparams, previous, source)
            self.previous_plans.append(stage_plan(previous, source))
            self.previous.append(previous_network)
            self.previous_settings.append(previous)
        # Kept in the checkpoint (each without its own earlier stages' settings, which come before it here).
        self.hparams["previous_settings"] = [
            {key: value for key, value in previous.items() if key != "previous_settings"}
            for previous in self.previous_settings
        ]

    @classmethod
    def check_settings(cls, settings: Mapping[str, Any]) -> None:
        """Before anything is built: the stage's grids fit its network's downsampling, and the earlier stages'
        checkpoints (`model.previous_stages`) saw the radiographs this stage is set up for."""
        if settings.get("size") is not None and settings.get("channels") is not None:
            grids = {key: settings.get(key) for key in ("stage", "size", "crop_size", "sampling_window")}
            check_grids(grids, 2 ** (len(settings["channels"]) - 1))
        for path in settings.get("previous_stages") or ():
            earlier, _ = read_stage(str(path))
            check_same_radiographs(settings, earlier, str(path))

    @classmethod
    def check_cascade(cls, stages: Mapping[int, Mapping[str, Any]]) -> None:
        """Every stage of one cascade is set up for the same radiographs as its first."""
        (first, settings), *later = sorted(stages.items())
        for stage, other in later:
            check_same_radiographs(other, {**settings, "stage": first}, f"cascade.stage{first}",
                                   key_prefix=f"cascade.stage{stage}.model.")

    @classmethod
    def restoring_settings(cls, hyper_parameters: dict[str, Any]) -> dict[str, Any]:
        """The earlier stages from the checkpoint itself: their settings (their weights are in its state dict)."""
        if hyper_parameters.get("previous_settings") is None:
            return {}  # saved before stages recorded them: read from `previous_stages`
        return {"previous_settings": hyper_parameters["previous_settings"]}

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
                f"stage {self.hparams.stage}: `model.size` is {as_size(self.hparams.size)} but the data gives "
                f"volumes of {list(x0.shape[2:])}; set model.size to the dataset's volume size"
            )
        if x0.shape[1] != 1:
            raise MedvolError(f"model=xray2ct generates one CT channel, got image shape {tuple(x0.shape)}")
        return x0, views, batch["affine"]

    def degraded(self, x0: torch.Tensor) -> torch.Tensor:
        """The ground truth at the previous stage's grid, upsampled back: what a perfect previous stage would give."""
        low = F.interpolate(x0, size=tuple(as_size(self.previous_settings[-1]["size"])), mode="area")
        return F.interpolate(low, size=x0.shape[2:], mode="trilinear", align_corners=False)

    # -- training ----------------------------------------------------------------------------------------------

    def network_output(
        self, network: nn.Module, x_t: torch.Tensor, t: torch.Tensor, views: torch.Tensor,
        previous: torch.Tensor | None = None, coordinates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return network(x_t.to(views.dtype), t, views, previous, coordinates)

    def denoised_grid(self, size: Sequence[int]) -> tuple[int, list[int], list[int]]:
        """One CT channel on the stage's training crop (its whole grid at stage 1)."""
        return 1, [int(s) for s in self.crop], [int(self.sampling_network.downsampling)] * 3

    def conditioning_examples(
        self, x_t: torch.Tensor, larger: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, dict[int, str]]]:
        """The radiographs (B, views, H, W) in model units; from stage 2 on the upsampled previous stage and the
        three global-coordinate channels, on x_t's grid."""
        generator = torch.Generator().manual_seed(1)
        height, width = (int(s) for s in self.hparams.xray_size)
        views = [torch.randn(x.shape[0], len(self.hparams.views), height, width, generator=generator)
                 for x in (x_t, larger)]
        examples = {"views": (views[0], views[1], {0: "batch"})}
        if self.hparams.stage > 1:
            for name, channels in (("previous", 1), ("coordinates", 3)):
                pair = [torch.randn(x.shape[0], channels, *x.shape[2:], generator=generator) for x in (x_t, larger)]
                examples[name] = (pair[0], pair[1], DYNAMIC_AXES)
        return examples

    def training_volumes(self, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """A stage >= 2's training target, its base (the degraded ground truth: what a perfect previous stage
        gives) and its condition volumes: random crops, cut jointly, of the target, the base, the base plus noise
        of a random level (the network's previous-stage input), and the coordinates."""
        b = x0.shape[0]
        level = torch.rand(b, 1, 1, 1, 1, device=x0.device) * self.hparams.previous_noise
        base = self.degraded(x0)
        previous = base + level * torch.randn_like(x0)
        coordinates = coordinate_channels(x0.shape[2:], b, x0.device).to(x0.dtype)
        if self.crop != list(x0.shape[2:]):
            x0, base, previous, coordinates = random_crops([x0, base, previous, coordinates], self.crop)
        return x0, base, {"previous": previous, "coordinates": coordinates}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        x0, views, affine = self._inputs(batch)
        b = x0.shape[0]
        t = self.draw_timesteps(b, x0.device)
        conditioning = Conditioning(per_sample={"views": views})
        base = None
        if self.hparams.stage > 1:
            x0, base, volumes = self.training_volumes(x0)
            conditioning = Conditioning(volumes, {"views": views})
            base = base if self.residual else None
        whole = list(x0.shape[2:]) == as_size(self.hparams.size)
        diffused = x0 if base is None else x0 - base
        noise = self.noise_like(diffused)
        output, target, x_t = self.training_prediction(self.network, diffused, t, noise, conditioning)
        diffusion_loss = self.regression_loss(output, target)
        losses = {"diffusion_loss": diffusion_loss}
        if self.hparams.physics_weight > 0 and whole:
            x0_hat, _ = self.x0_and_epsilon(output, x_t, t)
            losses["physics_loss"] = self.physics(x0_hat if base is None else base + x0_hat, views, affine)
        loss = diffusion_loss + self.hparams.physics_weight * losses.get("physics_loss", 0.0)
        self.log_dict({f"train/{k}": v.detach() for k, v in losses.items()}, on_step=True, on_epoch=True, batch_size=b)
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, prog_bar=True, batch_size=b)
        return loss

    # -- sampling ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self, views: torch.Tensor, size: Sequence[int], subjects: Sequence[str], seed: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Run the cascade from the views: every previous stage, then this one (EMA weights); model units.

        Stage k starts from its own per-subject noise (stream `stage<k>`), sees stage k-1's output
        upsampled plus conditioning noise (`stage<k>/previous`) and the coordinate channels, and each
        stage samples with its own window (`model.sampling_window` of its run, by default the
        volume its network trained on: the whole volume at stage 1, the training crop after).
        Validation, test and predict all generate here; `seed` (default `sample_seed`) seeds the noise.
        """
        seed = self.sample_seed if seed is None else int(seed)
        # Every stage as its own run was configured: its size, window, prediction type and residual setting.
        # Each with its own plan and hand-off noise, as it was sampled alone; outputs unclamped (HU beyond the window).
        own = (self.sampling_plan(), float(self.hparams.previous_sampling_noise))
        stages = [
            *zip(self.previous_settings, self.previous, self.previous_plans, strict=True),
            ({**self.hparams, "size": list(size)}, self.sampling_network, own),
        ]
        outputs: dict[str, torch.Tensor] = {}
        previous = None
        for index, (settings, network, (plan, noise_level)) in enumerate(stages, start=1):
            stage_size = as_size(settings["size"])
            if self.progress:
                window = window_of(settings)
                log.info("X-ray-to-CT stage %d/%d: a %s CT, %s", index, len(stages), "x".join(map(str, stage_size)),
                         "whole" if list(window) == list(stage_size) else f"by {'x'.join(map(str, window))} windows")
            plan.schedule.to(views.device)
            volumes: dict[str, torch.Tensor] = {}
            if previous is not None:
                upsampled = F.interpolate(previous, size=tuple(stage_size), mode="trilinear", align_corners=False)
                conditioning_noise = SubjectNoise(subjects, seed, f"stage{index}/previous")(upsampled)
                volumes["previous"] = upsampled + noise_level * conditioning_noise
                volumes["coordinates"] = coordinate_channels(stage_size, views.shape[0], views.device)
            x_T = SubjectNoise(subjects, seed, f"stage{index}").draw((1, *stage_size), views.device)
            walk_noise = SubjectNoise(subjects, seed, f"stage{index}/walk")
            conditioning = Conditioning(volumes, {"views": views})
            sampled = self.sample(x_T, conditioning, walk_noise, network, window_of(settings), plan)
            previous = (upsampled + sampled if is_residual(settings) else sampled)
            outputs[f"stage{index}"] = previous
        outputs["ct"] = outputs.pop(f"stage{len(stages)}")
        return outputs

    def generation_inputs(self) -> dict[str, int]:
        """What a CT is generated from without one: the radiographs (batch key `xray`, one channel per view)."""
        return {"xray": len(self.hparams.views)}

    def generate_volumes(self, batch: dict[str, Any], draw: int = 0) -> dict[str, Any]:
        """The CT of each subject from its radiographs alone (batch keys `xray`, `subject`), on this stage's grid.

        Draw k is seeded `sample_seed + k`; draw 0 is the CT `test_step` generates for the same views.
        """
        views = batch["xray"]
        subjects = subject_names(batch, 0, views.shape[0])
        ct = self.generate(views, as_size(self.hparams.size), subjects, self.sample_seed + int(draw))["ct"]
        return {"volumes": {"ct": ct}, "window": tuple(self.hparams.window), "unclamped": True}

    def _evaluate(self, batch: dict[str, Any], batch_idx: int, metrics: MetricCollection) -> dict[str, Any]:
        x0, views, affine = self._inputs(batch)
        subjects = subject_names(batch, batch_idx, x0.shape[0])
        generated = self.generate(views, list(x0.shape[2:]), subjects)
        ct = generated["ct"]
        prefix = metrics.prefix
        metrics[f"{prefix}psnr"].update(ct, x0)
        metrics[f"{prefix}ssim"].update(ct, x0)
        metrics[f"{prefix}physics_loss"].update(self.physics(ct, views, affine), weight=x0.shape[0])
        for name in ("body_mae_hu", "body_psnr", "body_ssim"):
            metrics[f"{prefix}{name}"].update(ct, x0)
        for name, metric in metrics.items():
            self.log(name, metric, prog_bar=name == f"{prefix}psnr", batch_size=x0.shape[0])
        volumes: dict[str, torch.Tensor] = {}
        if self.previous_settings:
            previous = generated[f"stage{len(self.previous)}"]
            volumes["previous"] = F.interpolate(previous, size=x0.shape[2:], mode="nearest")
        volumes.update({"ct": ct, "target": x0.detach()})
        # HU beyond the window is written as generated (the writer's `unclamped`).
        return {
            "volumes": volumes, "difference": ("ct", "target"), "window": tuple(self.hparams.window), "unclamped": True
        }
