"""The diffusion core every diffusion family derives from (Fast-DDPM's `ConditionalDiffusion`, X-ray-to-CT's
`XrayToCT`).

`DiffusionModule` holds the forward process (fp32 schedule), the training and sampling timestep
sets, the prediction target and its algebra, the sampler (DDIM over any set, DDPM ancestral),
the weight EMA with its optimizer-step hook, per-subject sampling noise, the denoising walk and
windowed sampling. A family adds its network (`attach_network`), says how the network is called
(`network_output`) and what conditions it (a `Conditioning`), and writes its Lightning steps.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric, MetricCollection
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

from lightning_modules.base import DYNAMIC_AXES, ExportedNetwork, MedvolModule, spatial_examples
from lightning_modules.diffusion.ema import EMA
from lightning_modules.diffusion.generation_metrics import TrainingSetMetric, VolumeSetFID2p5D, pooled
from lightning_modules.diffusion.prediction import (
    check_prediction_type,
    clip_x0,
    to_x0_and_epsilon,
    training_target,
)
from lightning_modules.diffusion.samplers import SAMPLERS, Denoise, NoiseLike, sample_ddim, sample_ddpm
from lightning_modules.diffusion.schedule import NoiseSchedule
from lightning_modules.diffusion.subject_noise import SubjectNoise
from lightning_modules.diffusion.timesteps import antithetic_indices, timestep_set
from medvol.core.errors import MedvolError
from medvol.volumes.sliding_window import SlidingWindow

LOSS_REDUCTIONS = ("mean", "sum")
log = logging.getLogger("medvol")


@dataclass(frozen=True)
class Conditioning:
    """What a family's network sees besides x_t and the step, sorted by how a sampling window treats it.

    Args:
        volumes: (B, C, D, H, W) tensors on x_t's grid (a condition volume, coordinate channels):
            cut to each window like x_t.
        per_sample: (B, ...) tensors, one row per sample (radiographs, view tokens): each window
            gets its own sample's row whole.
    """

    volumes: Mapping[str, torch.Tensor] = field(default_factory=dict)
    per_sample: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def inputs(self) -> dict[str, torch.Tensor]:
        """Every input by name, for a call on the whole volume."""
        return {**self.volumes, **self.per_sample}


@dataclass(frozen=True)
class SamplingPlan:
    """How a denoising walk runs: the forward process, the sampler over its set, and what the network predicts.

    A module samples with its own (`DiffusionModule.sampling_plan`); a cascade samples each earlier
    stage with the plan that stage was trained and sampled with.
    """

    schedule: NoiseSchedule
    timesteps: torch.Tensor
    sampler: str
    eta: float
    clip_sample: bool
    prediction_type: str


class DenoiserCall(nn.Module):
    """A family's `network_output` as a module with positional tensor inputs (x_t, t, then the conditioning named
    `names`), for tracing: the family's own call, so an exported denoiser sees its inputs as sampling does."""

    def __init__(self, network: nn.Module, call: Callable[..., torch.Tensor], names: Sequence[str]) -> None:
        super().__init__()
        self.network = network
        self.call = call
        self.names = list(names)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, *conditioning: torch.Tensor) -> torch.Tensor:
        return self.call(self.network, x_t, t, **dict(zip(self.names, conditioning, strict=True)))


def sampling_window_size(value: int | Sequence[int] | None) -> tuple[int, int, int] | None:
    """`model.sampling_window` as (D, H, W) (an int is a cube), or None for whole-volume sampling."""
    if value is None:
        return None
    size = [int(value)] * 3 if isinstance(value, int) else [int(v) for v in value]
    if len(size) != 3 or min(size) < 1:
        raise MedvolError(
            f"`model.sampling_window`: got {value!r}; expected null (sample the whole volume at once) or a window "
            "size [D, H, W] of positive ints"
        )
    return (size[0], size[1], size[2])


class DiffusionModule(MedvolModule, ABC):
    """Base class of the diffusion families: everything but the network and its conditioning.

    Training: `draw_timesteps` (from the training set, in antithetic pairs), `noise_like`,
    `training_prediction` (noise x0 to x_t, run the network, the target) and `regression_loss`.
    Sampling: `sample` walks the sampling set from x_T with the configured sampler and the EMA
    weights; every step calls the network on the whole volume or, with `sampling_window`, on
    overlapping Gaussian-blended windows that each get the step, their cut of the condition
    volumes and their sample's per-sample inputs. Noise for validation, test and predict comes
    from `SubjectNoise` streams seeded by subject name and `sample_seed`.

    Args:
        num_train_timesteps: steps of the forward process.
        beta_schedule: `linear` or `cosine`.
        beta_start: first beta (linear).
        beta_end: last beta (linear).
        prediction_type: what the network predicts: `epsilon`, `v` or `sample`.
        timesteps: the training set: its size T (with `timestep_spacing`) or an explicit list;
            T = num_train_timesteps with uniform spacing is full DDPM training.
        timestep_spacing: `non_uniform` (Fast-DDPM's) or `uniform`.
        sampler: `ddim` (the DDIM update over the sampling set: Fast-DDPM) or `ddpm` (ancestral, every step).
        sampling_timesteps: the set `ddim` walks: null = the training set, or a size (with
            `sampling_spacing`), or an explicit list.
        sampling_spacing: spacing of a sampling set given by its size.
        eta: DDIM stochasticity (0 deterministic, 1 DDPM-like).
        clip_sample: clamp each predicted x0 to [-1, 1] while sampling.
        loss_reduction: `mean` over voxels, or `sum` over voxels and mean over the batch (Fast-DDPM's reference).
        ema_decay: decay of the weight EMA used for validation, test and sampling (null: no EMA).
        ema_warmup: ramp the EMA decay up over the first steps.
        sample_seed: seed of the per-subject noise used by validation, test and predict.
        sampling_window: null (every step runs the network on the whole volume) or a window size
            (D, H, W): every step runs it window by window, Gaussian-blended.
        sampling_window_overlap: fraction of a sampling window shared with its neighbour.
        sampling_window_batch_size: sampling windows per network call.
        optimizer: partial optimizer (default Adam at the family's `default_lr`).
        scheduler: optional partial LR scheduler (stepped per epoch).
    """

    default_lr: float = 2e-5

    def __init__(
        self,
        num_train_timesteps: int = 1000,
        beta_schedule: str = "linear",
        beta_start: float = 1e-4,
        beta_end: float = 0.02,
        prediction_type: str = "epsilon",
        timesteps: int | Sequence[int] = 10,
        timestep_spacing: str = "non_uniform",
        sampler: str = "ddim",
        sampling_timesteps: int | Sequence[int] | None = None,
        sampling_spacing: str = "uniform",
        eta: float = 0.0,
        clip_sample: bool = False,
        loss_reduction: str = "mean",
        ema_decay: float | None = 0.999,
        ema_warmup: bool = True,
        sample_seed: int = 0,
        sampling_window: int | Sequence[int] | None = None,
        sampling_window_overlap: float = 0.5,
        sampling_window_batch_size: int = 4,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        if sampler not in SAMPLERS:
            raise MedvolError(f"`model.sampler`: got {sampler!r}; expected one of {list(SAMPLERS)}")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise MedvolError(
                f"`model.loss_reduction`: got {loss_reduction!r}; expected one of {list(LOSS_REDUCTIONS)}"
            )
        if not 0.0 <= float(sampling_window_overlap) < 1.0:
            raise MedvolError(f"`model.sampling_window_overlap` must be in [0, 1), got {sampling_window_overlap}")
        if int(sampling_window_batch_size) < 1:
            raise MedvolError(f"`model.sampling_window_batch_size` must be >= 1, got {sampling_window_batch_size}")
        self.prediction_type = check_prediction_type(prediction_type)
        self.schedule = NoiseSchedule(beta_schedule, num_train_timesteps, beta_start, beta_end)
        steps = self.schedule.num_train_timesteps
        self.train_timesteps = timestep_set(timesteps, timestep_spacing, steps, key="model.timesteps")
        if sampling_timesteps is None:
            self.sampling_timesteps = self.train_timesteps
        else:
            self.sampling_timesteps = timestep_set(
                sampling_timesteps, sampling_spacing, steps, key="model.sampling_timesteps"
            )
        self.sampler = sampler
        self.eta = float(eta)
        self.clip_sample = bool(clip_sample)
        self.loss_reduction = loss_reduction
        self.ema_decay = ema_decay
        self.ema_warmup = bool(ema_warmup)
        self.sample_seed = int(sample_seed)
        self.sampling_window = sampling_window_size(sampling_window)
        self.sampling_window_overlap = float(sampling_window_overlap)
        self.sampling_window_batch_size = int(sampling_window_batch_size)
        self.optimizer_factory = optimizer or partial(torch.optim.Adam, lr=self.default_lr)
        self.scheduler_factory = scheduler
        # Whether sampling (and a family's decoding) log their progress: predict.py turns it on; validation's
        # samples stay quiet.
        self.progress = False

    # ---- what a family provides ----------------------------------------------------------

    def attach_network(self, network: nn.Module) -> None:
        """Make `network` the trained one and start its EMA copy (call once its weights are initialised)."""
        self.network = network
        self.ema = EMA(network, self.ema_decay, self.ema_warmup) if self.ema_decay else None

    @abstractmethod
    def network_output(
        self, network: nn.Module, x_t: torch.Tensor, t: torch.Tensor, **conditioning: torch.Tensor
    ) -> torch.Tensor:
        """`network`'s prediction at x_t (a whole volume or one window) and steps t, given the family's conditioning."""

    def set_metrics(self, ssim_kernel_size: int, **others: Metric) -> None:
        """`val_metrics` and `test_metrics`: PSNR and 3D SSIM of samples in [-1, 1], plus the family's `others`."""
        evaluation = MetricCollection(
            {
                "psnr": PeakSignalNoiseRatio(data_range=2.0, reduction="elementwise_mean", dim=(1, 2, 3, 4)),
                "ssim": StructuralSimilarityIndexMeasure(data_range=2.0, kernel_size=ssim_kernel_size),
                **others,
            }
        )
        self.val_metrics = evaluation.clone(prefix="val/")
        self.test_metrics = evaluation.clone(prefix="test/")

    def log_evaluation(self, metrics: Mapping[str, Metric], size: int, shown: Sequence[str] = ()) -> None:
        """Log every metric of `metrics` but the 2.5D FID (logged per plane at the epoch's end), those named in
        `shown` on the progress bar."""
        for name, metric in metrics.items():
            if not isinstance(metric, VolumeSetFID2p5D):
                self.log(name, metric, prog_bar=name in shown, batch_size=size)

    def log_plane_fids(self, metrics: MetricCollection) -> None:
        """The 2.5D FID of the epoch (`VolumeSetFID2p5D`), per plane and their mean: `<prefix>fid_2p5d[_<plane>]`."""
        for name, metric in metrics.items():
            if isinstance(metric, VolumeSetFID2p5D) and metric.update_count:
                values = metric.compute()
                self.log_dict({f"{name}_{k}" if k != "mean" else name: v for k, v in values.items()})
                metric.reset()

    def on_validation_epoch_end(self) -> None:
        self.log_plane_fids(self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self.log_plane_fids(self.test_metrics)

    # ---- the training set, for the metrics that compare with it ---------------------------

    def training_set_metrics(self) -> list[TrainingSetMetric]:
        """The validation and test metrics that need the training volumes (nearest-training correlation, copies)."""
        collections = (self.val_metrics, self.test_metrics)
        return [m for c in collections for m in c.values() if isinstance(m, TrainingSetMetric)]

    def recording_training_set(self, batches: Iterable[Mapping[str, Any]], key: str = "image") -> Iterator[Any]:
        """Yield `batches`, keeping each batch's `key` volumes average-pooled; once the last has been yielded,
        hand them, gathered over ranks, to the metrics that compare with the training set (one pass of the training
        data serves both the family's own pass, e.g. the LDM's scale factor, and these)."""
        metrics = self.training_set_metrics()
        size = max((m.size for m in metrics), default=1)
        kept = []
        for batch in batches:
            if metrics:
                kept.append(pooled(batch[key], size).cpu())
            yield batch
        if not metrics or not kept:
            return
        reference = torch.cat(kept)
        if self._trainer is not None and self.trainer.world_size > 1:
            reference = self.gathered_rows(reference)
        for metric in metrics:
            metric.reference = reference

    def gathered_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's (n_rank, F) rows, concatenated in rank order (ranks may hold different counts)."""
        strategy = self.trainer.strategy
        counts = strategy.all_gather(torch.tensor([len(rows)], device=self.device)).flatten().tolist()
        padded = torch.zeros(max(counts), rows.shape[1], dtype=rows.dtype, device=self.device)
        padded[: len(rows)] = rows.to(self.device)
        every = strategy.all_gather(padded)
        return torch.cat([every[rank, :count] for rank, count in enumerate(counts)]).cpu()

    def on_train_start(self) -> None:
        # Before the first step, so that no training step waits for the EMA's update count on a GPU.
        if self.ema is not None:
            self.ema.read_updates()

    def on_fit_start(self) -> None:
        if self.training_set_metrics():
            for _ in self.recording_training_set(self.trainer.datamodule.train_dataloader(), self.generated_key):
                pass

    @property
    def generated_key(self) -> str:
        """The batch key of the volumes the family generates."""
        return str(getattr(self.hparams, "image_key", "image"))

    @abstractmethod
    def _evaluate(self, batch: dict[str, Any], batch_idx: int, metrics: MetricCollection) -> dict[str, Any]:
        """One validation or test batch: update and log `metrics` (`val_metrics` or `test_metrics`), return the
        volumes to show and write."""

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self._evaluate(batch, batch_idx, self.val_metrics)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self._evaluate(batch, batch_idx, self.test_metrics)

    # ---- export (export.py) -------------------------------------------------------------

    def denoised_grid(self, size: Sequence[int]) -> tuple[int, list[int], list[int]]:
        """(channels, training size, the multiple every size must be) of x_t; families override what differs."""
        levels = len(getattr(self.sampling_network, "block_out_channels", ())) or 1
        return int(getattr(self, "image_channels", 1)), [int(s) for s in size], [2 ** (levels - 1)] * 3

    def conditioning_examples(
        self, x_t: torch.Tensor, larger: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, dict[int, str]]]:
        """The conditioning inputs `network_output` takes besides x_t and t, each as (example beside `x_t`, example
        beside `larger`, its dynamic axes); none by default."""
        return {}

    def exported_networks(self, size: Sequence[int]) -> list[ExportedNetwork]:
        """The denoiser (the EMA weights sampling uses) as one call of the sampler's loop: x_t, the step t and the
        family's conditioning in, the prediction (`prediction_type`) out. The loop itself stays with the server."""
        channels, grid, multiple = self.denoised_grid(size)
        x_t, larger = spatial_examples(channels, grid, multiple)
        steps = self.train_timesteps.long()
        extras = self.conditioning_examples(x_t, larger)
        inputs = {"x_t": x_t, "t": steps[-1:], **{name: value[0] for name, value in extras.items()}}
        seconds = {"x_t": larger, "t": steps[:2], **{name: value[1] for name, value in extras.items()}}
        dynamic = {"x_t": DYNAMIC_AXES, "t": {0: "batch"}, "prediction": DYNAMIC_AXES,
                   **{name: value[2] for name, value in extras.items()}}
        about = {
            "prediction_type": self.prediction_type, "num_train_timesteps": self.schedule.num_train_timesteps,
            "sampling_timesteps": [int(t) for t in self.sampling_timesteps], "sampler": self.sampler, "eta": self.eta,
            "size_multiple": multiple,
        }
        call = DenoiserCall(self.sampling_network, self.network_output, list(extras)).eval()
        return [ExportedNetwork("denoiser", call, inputs, "prediction", dynamic, seconds, about)]

    def not_exportable(self) -> str:
        return (
            "its outputs come from a sampler loop of many network calls, which a bundle's sliding window cannot run; "
            "format=onnx or format=torchscript exports the denoiser, for a server that runs the loop (docs/export.md)"
        )

    # ---- optimization and EMA ------------------------------------------------------------

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.network.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        # Lightning calls this once per accumulated batch, so the EMA follows optimizer steps.
        super().optimizer_step(*args, **kwargs)
        if self.ema is not None:
            self.ema.update(self.network)

    def sampling_plan(self) -> SamplingPlan:
        """This module's own way of sampling: its schedule, sampler, sampling set, eta, clipping and target."""
        return SamplingPlan(
            self.schedule, self.sampling_timesteps, self.sampler, self.eta, self.clip_sample, self.prediction_type
        )

    @property
    def sampling_network(self) -> nn.Module:
        """The weights validation, test and sampling use: the EMA copy when there is one."""
        return self.ema.module if self.ema is not None else self.network

    # ---- training ------------------------------------------------------------------------

    def draw_timesteps(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """Training steps drawn only from the training set, in antithetic pairs."""
        index = antithetic_indices(batch_size, len(self.train_timesteps))
        # Drawn on the host (the CPU generator keeps a run's steps those of any device); a blocking copy to a GPU
        # would wait for all the work queued before it.
        return self.train_timesteps[index].to(device, non_blocking=True)

    def noise_like(self, x: torch.Tensor, subject_noise: SubjectNoise | None = None) -> torch.Tensor:
        """fp32 N(0, 1) noise shaped like x: from the global RNG (training), or from per-subject streams."""
        if subject_noise is None:
            return torch.randn(x.shape, device=x.device, dtype=torch.float32)
        return subject_noise(x)

    def training_prediction(
        self, network: nn.Module, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, conditioning: Conditioning
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, target, x_t): x0 noised to step t (fp32), the network's output there and its regression target."""
        x_t = self.schedule.add_noise(x0, noise, t)
        output = self.network_output(network, x_t, t, **conditioning.inputs())
        target = training_target(self.prediction_type, x0.float(), noise.float(), self.schedule.alpha_bar(t))
        return output, target, x_t

    def regression_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Squared error, averaged over voxels (`mean`) or summed over them and averaged over the batch (`sum`)."""
        squared = (output.float() - target).square()
        if self.loss_reduction == "sum":
            return squared.flatten(1).sum(1).mean()
        return squared.mean()

    def x0_and_epsilon(
        self, output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, prediction_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x0, eps) implied by the network's `output` at x_t and steps t, in fp32 (output of `prediction_type`,
        default this module's)."""
        return to_x0_and_epsilon(prediction_type or self.prediction_type, output, x_t, self.schedule.alpha_bar(t))

    # ---- sampling ------------------------------------------------------------------------

    def sliding_window(self, size: Sequence[int], device: torch.device) -> SlidingWindow:
        """The sampling window of `size` (Gaussian blending, this module's overlap), run and blended on `device`."""
        return SlidingWindow.of(
            size, overlap=self.sampling_window_overlap, mode="gaussian", batch_size=self.sampling_window_batch_size,
            device=device, output_device=device,
        )

    def denoiser_for(
        self, network: nn.Module, conditioning: Conditioning, window: SlidingWindow | None = None,
        plan: SamplingPlan | None = None,
    ) -> Denoise:
        """`denoise(x_t, t) -> (x0, eps)` for the samplers: the network (predicting `plan`'s target, default this
        module's) on the whole volume, or window by window."""
        plan = plan or self.sampling_plan()

        def predict(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            if window is None:
                return self.network_output(network, x_t, t, **conditioning.inputs())
            call = partial(self.network_output, network)
            return window(call, x_t, conditioning.volumes, {"t": t, **conditioning.per_sample})

        steps = plan.schedule.num_train_timesteps if plan.sampler == "ddpm" else len(plan.timesteps)
        taken = itertools.count(1)

        def denoise(x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if self.progress:
                self.log_step(next(taken), steps, x_t.shape, window)
            alpha_bar = plan.schedule.alpha_bar(t)
            x0, eps = to_x0_and_epsilon(plan.prediction_type, predict(x_t, t), x_t, alpha_bar)
            return clip_x0(x0, x_t, alpha_bar) if plan.clip_sample else (x0, eps)

        return denoise

    @staticmethod
    def log_step(step: int, steps: int, shape: Sequence[int], window: SlidingWindow | None) -> None:
        """`sampling step k/K` and what it runs (the first, the last and every tenth of the walk)."""
        if step not in (1, steps) and step % max(1, steps // 10):
            return
        grid = "x".join(map(str, shape[2:]))
        calls = "the whole volume" if window is None or tuple(shape[2:]) == window.roi else (
            f"{window.windows(shape)} windows of {'x'.join(map(str, window.roi))}, {window.batch_size} a call")
        log.info("sampling %s: step %d/%d, %s", grid, step, steps, calls)

    @torch.no_grad()
    def sample(
        self,
        x_T: torch.Tensor,
        conditioning: Conditioning | None = None,
        noise: NoiseLike | None = None,
        network: nn.Module | None = None,
        window: Sequence[int] | None = None,
        plan: SamplingPlan | None = None,
    ) -> torch.Tensor:
        """The denoising walk: x0 generated from x_T by the configured sampler over the sampling set.

        Args:
            x_T: (B, C, D, H, W) starting noise (e.g. `SubjectNoise(...).draw`).
            conditioning: the family's condition for `network_output`.
            noise: the stochastic samplers' noise (DDPM, DDIM with eta > 0); default the global RNG.
            network: the weights to call; default `sampling_network` (the EMA copy).
            window: the sampling window size; default `sampling_window`. A window the size of the
                volume (or no window configured) runs the whole volume at once.
            plan: the schedule, sampler, set and target to walk with; default this module's (a cascade
                samples each earlier stage with that stage's own).
        """
        size = window if window is not None else self.sampling_window
        if size is not None and any(w > s for w, s in zip(size, x_T.shape[2:], strict=True)):
            # MONAI would pad x_t with zeros, which is not noise the network was trained on.
            raise MedvolError(
                f"`model.sampling_window` {list(size)} is larger than the volume {list(x_T.shape[2:])}; "
                "expected a window no larger than the volume along every axis (or null: the whole volume)"
            )
        sliding = None if size is None else self.sliding_window(size, x_T.device)
        plan = plan or self.sampling_plan()
        denoise = self.denoiser_for(
            network if network is not None else self.sampling_network, conditioning or Conditioning(), sliding, plan
        )
        noise_like = noise if noise is not None else self.noise_like
        if plan.sampler == "ddpm":
            return sample_ddpm(denoise, x_T, plan.schedule, noise_like)
        return sample_ddim(denoise, x_T, plan.schedule, plan.timesteps, plan.eta, noise_like)
