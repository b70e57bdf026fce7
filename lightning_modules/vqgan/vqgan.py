"""3D VQ-GAN: EMA-codebook autoencoder trained with L1, commitment, 3D patch and 2D slice adversarial losses.

Follows the VQ-GAN of medicaldiffusion (Khader et al.) as used in the CTPA seed: an image
(2D slice) discriminator and a video (3D volume) discriminator, optional GAN feature matching
and perceptual loss, and the discriminators switched on after `discriminator_iter_start`
training batches. Two optimizers run under manual optimization, with accumulation, clipping
and AMP handled here because Lightning does not apply them for manual optimization.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from monai.networks.nets import PatchDiscriminator
from torch import nn
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

from lightning_modules.base import DYNAMIC_AXES, ExportedNetwork, MedvolModule, spatial_examples
from lightning_modules.perceptual import SlicePerceptualLoss
from lightning_modules.vqgan.adversarial import AdversarialLoss
from lightning_modules.vqgan.codebook import EMACodebook, Quantized, snapped_to_codes
from lightning_modules.vqgan.vq_autoencoder import Decoder3d, Encoder3d
from medvol.core.errors import MedvolError
from medvol.volumes.sliding_window import SlidingWindow

_LOSS_TYPES = {"hinge": "hinge", "least_squares": "least_squares", "lsgan": "least_squares", "vanilla": "bce"}


def random_slices(volume: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The axial slice `index[b]` of each volume (B, C, D, H, W) -> (B, C, H, W)."""
    gather = index.view(-1, 1, 1, 1, 1).expand(-1, volume.shape[1], 1, *volume.shape[3:])
    return volume.gather(2, gather).squeeze(2)


def check_settings(disc_loss_type: str, perceptual_weight: float, perceptual_model_path: str | None) -> None:
    """Raise `MedvolError` for a loss type medvol does not know or a perceptual loss without its network."""
    if disc_loss_type not in _LOSS_TYPES:
        raise MedvolError(f"`model.disc_loss_type`: got {disc_loss_type!r}; expected one of {sorted(_LOSS_TYPES)}")
    if perceptual_weight > 0 and not perceptual_model_path:
        raise MedvolError(
            f"`model.perceptual_weight` is {perceptual_weight} but `model.perceptual_model_path` is not set; "
            "give a local TorchScript feature network or set perceptual_weight=0"
        )


def build_discriminators(in_channels: int, channels: int, layers: int) -> tuple[PatchDiscriminator, PatchDiscriminator]:
    """The 2D slice (image) and the 3D patch (video) discriminators of medicaldiffusion's VQ-GAN."""
    return tuple(
        PatchDiscriminator(spatial_dims=dims, channels=channels, in_channels=in_channels, num_layers_d=layers)
        for dims in (2, 3)
    )


def evaluation_metrics(ssim_kernel_size: int) -> MetricCollection:
    """Validation and test metrics; metric objects sync sums and counts across ranks, so unequal shares weigh right."""
    return MetricCollection(
        {
            "psnr": PeakSignalNoiseRatio(data_range=2.0, reduction="elementwise_mean", dim=(1, 2, 3, 4)),
            "ssim": StructuralSimilarityIndexMeasure(data_range=2.0, kernel_size=ssim_kernel_size),
            "recon_loss": MeanMetric(),
            "perplexity": MeanMetric(),
        }
    )


class Reconstruction(nn.Module):
    """image -> the reconstruction predict.py blends (encoder, nearest codes, decoder, clamped to [-1, 1]), or with
    `part` one half: `encoder` (image -> the continuous latent) or `decoder` (latent -> image, snapped to the codes
    first), as plain modules export.py traces."""

    def __init__(self, encoder: Encoder3d, codebook: EMACodebook, decoder: Decoder3d, part: str = "whole") -> None:
        super().__init__()
        self.encoder, self.codebook, self.decoder, self.part = encoder, codebook, decoder, part

    def quantized(self, z: torch.Tensor) -> torch.Tensor:
        return snapped_to_codes(z, self.codebook.embeddings)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.part == "encoder":
            return self.encoder(x)
        if self.part == "decoder":
            return self.decoder(self.quantized(x))
        return self.decoder(self.quantized(self.encoder(x))).clamp(-1.0, 1.0)


class GANStep(NamedTuple):
    """One training batch's losses.

    `terms` are the generator's loss terms (values to log, in the order they are summed);
    `generator_objective` is what the autoencoder's backward pass takes: its gradient is that of
    the terms' sum, its value is not; `discriminator_loss` is None before the discriminators start.
    """

    terms: dict[str, torch.Tensor]
    generator_objective: torch.Tensor
    discriminator_loss: torch.Tensor | None
    quantized: Quantized

    @property
    def generator_loss(self) -> torch.Tensor:
        """The sum of the generator's terms (what it minimises), without a graph."""
        return torch.stack([term.detach() for term in self.terms.values()]).sum()


class VQGAN(MedvolModule):
    """3D VQ-GAN.

    Args:
        in_channels: image channels (modalities).
        embedding_dim: size of a code vector.
        n_codes: codebook size.
        n_hiddens: channels of the first encoder layer (doubled at each halving).
        downsample: per-axis reduction factor from image to latent grid.
        codebook_decay: EMA decay of the codebook.
        commitment_weight: weight of the commitment loss.
        restart_threshold: EMA usage under which a code is restarted; `random_restart` turns this off.
        l1_weight: weight of the L1 reconstruction loss.
        image_gan_weight: weight of the 2D slice discriminator's adversarial loss.
        video_gan_weight: weight of the 3D patch discriminator's adversarial loss.
        gan_feat_weight: weight of the discriminator feature-matching loss (0 turns it off).
        perceptual_weight: weight of the slice perceptual loss; needs `perceptual_model_path`.
        perceptual_model_path: local TorchScript feature network for the perceptual loss.
        disc_channels: channels of the first discriminator layer.
        disc_layers: strided layers per discriminator.
        disc_loss_type: `hinge` or `least_squares` (`vanilla` = binary cross-entropy).
        discriminator_iter_start: training batches (not optimizer steps) before the GAN losses start.
        optimizer: partial optimizer, called once for the autoencoder and once for the discriminators.
        scheduler: optional partial LR scheduler, stepped once per epoch for both optimizers.
        image_key: batch key of the volume to reconstruct.
        ssim_kernel_size: Gaussian window of the 3D SSIM metric.
        compile: `torch.compile` the encoder, decoder and discriminators when training on a CUDA device
            (the state dict keeps its names; ignored on the CPU).
        channels_last: the 3D networks' weights and the volumes in the channels-last-3d memory layout
            when training on a CUDA device (ignored on the CPU).
    """

    def __init__(
        self,
        in_channels: int = 1,
        embedding_dim: int = 8,
        n_codes: int = 512,
        n_hiddens: int = 16,
        downsample: Sequence[int] = (4, 4, 4),
        codebook_decay: float = 0.99,
        commitment_weight: float = 0.25,
        restart_threshold: float = 1.0,
        random_restart: bool = True,
        l1_weight: float = 4.0,
        image_gan_weight: float = 1.0,
        video_gan_weight: float = 1.0,
        gan_feat_weight: float = 4.0,
        perceptual_weight: float = 0.0,
        perceptual_model_path: str | None = None,
        disc_channels: int = 64,
        disc_layers: int = 3,
        disc_loss_type: str = "hinge",
        discriminator_iter_start: int = 0,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
        image_key: str = "image",
        ssim_kernel_size: int = 11,
        compile: bool = False,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        check_settings(disc_loss_type, perceptual_weight, perceptual_model_path)
        self.automatic_optimization = False
        self.downsample = tuple(int(d) for d in downsample)
        self.encoder = Encoder3d(in_channels, n_hiddens, self.downsample, embedding_dim)
        self.decoder = Decoder3d(in_channels, n_hiddens, self.downsample, embedding_dim)
        self.codebook = EMACodebook(
            n_codes, embedding_dim, codebook_decay, commitment_weight, restart_threshold, random_restart
        )
        self.image_discriminator, self.video_discriminator = build_discriminators(
            in_channels, disc_channels, disc_layers
        )
        self.adversarial = AdversarialLoss(_LOSS_TYPES[disc_loss_type])
        self.perceptual = SlicePerceptualLoss(perceptual_model_path) if perceptual_model_path else None
        self.optimizer_factory = optimizer or (lambda params: torch.optim.Adam(params, lr=3e-4, betas=(0.5, 0.9)))
        self.scheduler_factory = scheduler
        self.image_key = image_key
        self.feature_weight = 4.0 / (disc_layers + 1)
        # Set by `setup` on a CUDA device (model.compile, model.channels_last).
        self._accelerated = False
        self._memory_format = torch.contiguous_format
        # Running (sample-weighted sum, samples) of each training term over the current epoch.
        self._train_sums: dict[str, tuple[torch.Tensor, int]] = {}
        evaluation = evaluation_metrics(ssim_kernel_size)
        self.val_metrics = evaluation.clone(prefix="val/")
        self.test_metrics = evaluation.clone(prefix="test/")

    # Learning rates are logged as `lr/<name>`, in the order of `configure_optimizers`.
    optimizer_names = ("generator", "discriminator")

    def configure_optimizers(self) -> Any:
        autoencoder = [*self.encoder.parameters(), *self.decoder.parameters()]
        optimizers = [self.optimizer_factory(autoencoder), self.optimizer_factory(self.discriminator_parameters())]
        if self.scheduler_factory is None:
            return optimizers
        return optimizers, [self.scheduler_factory(opt) for opt in optimizers]

    def _check_shape(self, x: torch.Tensor) -> None:
        bad = [s for s, d in zip(x.shape[2:], self.downsample, strict=True) if s % d]
        if x.ndim != 5 or bad:
            raise MedvolError(
                f"`model.downsample` {list(self.downsample)} must divide the volume size, got input shape "
                f"{tuple(x.shape)}; crop/pad the dataset to a multiple of the downsample factors"
            )
        smallest = 4 * 2 ** self.hparams.disc_layers
        if min(x.shape[2:]) < smallest:
            raise MedvolError(
                f"`model.disc_layers`={self.hparams.disc_layers} needs volumes of at least {smallest} voxels per axis, "
                f"got input shape {tuple(x.shape)}; lower disc_layers or use larger volumes/patches"
            )

    def encode(self, x: torch.Tensor) -> Quantized:
        return self.codebook(self.encoder(x))

    def decode(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.decoder(embeddings)

    def setup(self, stage: str) -> None:
        self.accelerate(self.trainer.strategy.root_device)

    def accelerate(self, device: torch.device) -> None:
        """Apply `compile` and `channels_last` once, if `device` is a CUDA device (called by `setup`)."""
        if self._accelerated or device.type != "cuda":
            return
        self._accelerated = True
        if self.hparams.channels_last:
            self._memory_format = torch.channels_last_3d
            # The 2D slice discriminator keeps its layout: its inputs are single slices.
            for network in (self.encoder, self.decoder, self.video_discriminator):
                network.to(memory_format=self._memory_format)
        if self.hparams.compile:
            # The discriminators' graphs serve two backward passes (`gan_losses` retains them); AOT autograd's
            # donated buffers would free their saved tensors after the first and refuse the second.
            torch._functorch.config.donated_buffer = False
            # In place (nn.Module.compile), so parameter names and checkpoints are those of the eager networks.
            for network in (self.encoder, self.decoder, self.image_discriminator, self.video_discriminator):
                network.compile()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Quantized]:
        self._check_shape(x)
        x = x.contiguous(memory_format=self._memory_format)
        quantized = self.encode(x)
        return self.decode(quantized.embeddings), quantized

    def _feature_matching(self, fake: list[torch.Tensor], real: list[torch.Tensor]) -> torch.Tensor:
        loss = fake[-1].new_zeros(())
        for f, r in zip(fake[:-1], real[:-1], strict=True):
            loss = loss + self.feature_weight * F.l1_loss(f, r.detach())
        return loss

    def gan_losses(self, x: torch.Tensor, gan_on: bool, loss_scale: torch.Tensor | None = None) -> GANStep:
        """The losses of one training batch: the generator's terms and objective, and the discriminators' loss.

        Each discriminator sees the real and the reconstructed input once. Their weights do not
        change between the generator's update and their own, so one forward pass per input serves
        both losses: the generator's gradient through the discriminators is taken here, onto a
        detached copy of the reconstruction, and handed to the autoencoder as `generator_objective`
        (whose gradient is that of the terms' sum); the discriminator loss keeps the same passes'
        graph for its own backward. Neither backward reaches the other's parameters.

        Args:
            x: the batch of volumes (B, C, D, H, W).
            gan_on: whether the discriminators have started.
            loss_scale: the AMP gradient scaler's current scale (16-mixed), applied to the gradient
                taken through the discriminators and removed again in float32, so that gradient does
                not underflow in float16; None without a scaler.
        """
        hp = self.hparams
        x = x.contiguous(memory_format=self._memory_format)
        x_rec, quantized = self(x)
        slice_index = torch.randint(0, x.shape[2], (x.shape[0],), device=x.device)
        frames, frames_rec = random_slices(x, slice_index), random_slices(x_rec, slice_index)
        terms = {"recon_loss": F.l1_loss(x_rec, x) * hp.l1_weight}
        if self.perceptual is not None:
            terms["perceptual_loss"] = hp.perceptual_weight * self.perceptual(frames_rec, frames)
        direct = list(terms.values())
        if not gan_on:
            terms["commitment_loss"] = quantized.commitment_loss
            return GANStep(terms, torch.stack(list(terms.values())).sum(), None, quantized)

        fake = x_rec.detach().requires_grad_()
        image_real, image_fake = (
            self.image_discriminator(frames),
            self.image_discriminator(random_slices(fake, slice_index)),
        )
        video_real, video_fake = self.video_discriminator(x), self.video_discriminator(fake)
        terms["g_adv_loss"] = hp.image_gan_weight * self.adversarial.generator(image_fake[-1]) + (
            hp.video_gan_weight * self.adversarial.generator(video_fake[-1])
        )
        through_discriminators = terms["g_adv_loss"]
        if hp.gan_feat_weight > 0:
            matching = x.new_zeros(())
            if hp.image_gan_weight > 0:
                matching = matching + self._feature_matching(image_fake, image_real)
            if hp.video_gan_weight > 0:
                matching = matching + self._feature_matching(video_fake, video_real)
            terms["gan_feat_loss"] = hp.gan_feat_weight * matching
            through_discriminators = through_discriminators + terms["gan_feat_loss"]
        terms["commitment_loss"] = quantized.commitment_loss

        if loss_scale is not None:
            through_discriminators = through_discriminators * loss_scale
        (gradient,) = torch.autograd.grad(through_discriminators, fake, retain_graph=True)
        gradient = gradient.float() if loss_scale is None else gradient.float() / loss_scale
        # d/dx_rec of sum(x_rec * g) is g: the autoencoder receives the discriminators' gradient unchanged.
        generator_objective = torch.stack([*direct, quantized.commitment_loss, (x_rec.float() * gradient).sum()]).sum()
        discriminator_loss = hp.image_gan_weight * self.adversarial.discriminator(image_real[-1], image_fake[-1]) + (
            hp.video_gan_weight * self.adversarial.discriminator(video_real[-1], video_fake[-1])
        )
        return GANStep(terms, generator_objective, discriminator_loss, quantized)

    def discriminator_parameters(self) -> list[nn.Parameter]:
        """What the discriminator loss's backward pass computes gradients for: the discriminators' weights alone,
        not the reconstruction's detached copy they judged (nothing reads its gradient)."""
        return [*self.image_discriminator.parameters(), *self.video_discriminator.parameters()]

    def _loss_scale(self, device: torch.device) -> torch.Tensor | None:
        """The AMP gradient scaler's scale as a tensor on `device` (no host sync), or None without a scaler."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        return scaler.scale(torch.ones((), device=device))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        x = batch[self.image_key]
        opt_ae, opt_disc = self.optimizers()
        gan_on = self.batches_seen >= self.hparams.discriminator_iter_start
        step_now = self.is_accumulation_boundary(batch_idx)
        scale = 1.0 / self.accumulate_grad_batches

        # The two objectives share no graph (GANStep), so neither optimizer's parameters need freezing, and their
        # order changes no number: the discriminators' first frees their graphs before the autoencoder's backward.
        step = self.gan_losses(x, gan_on, self._loss_scale(x.device))
        losses = dict(step.terms)
        if step.discriminator_loss is not None:
            self.manual_backward(step.discriminator_loss * scale, inputs=self.discriminator_parameters())
            if step_now:
                opt_disc.step()
                opt_disc.zero_grad(set_to_none=True)
            losses["disc_loss"] = step.discriminator_loss
        self.manual_backward(step.generator_objective * scale)
        if step_now:
            opt_ae.step()
            opt_ae.zero_grad(set_to_none=True)

        generator_loss = step.generator_loss
        self._log_training(losses, generator_loss, step.quantized.perplexity, x.shape[0])
        return generator_loss

    def _log_training(
        self, losses: dict[str, torch.Tensor], generator_loss: torch.Tensor, perplexity: torch.Tensor, batch_size: int
    ) -> None:
        """Each term under its own name, the GAN terms as `train/gan_*`, and two totals.

        `train/loss` sums the terms that are on from the first batch (reconstruction,
        commitment, perceptual), so its curve does not jump when the discriminators start;
        `train/generator_loss` is what the generator minimises, GAN terms included from
        `discriminator_iter_start` on.

        Values go out as `train/<term>_step` at Lightning's logging cadence, and as the epoch's
        sample-weighted means at its end. Every `self.log` call goes through Lightning's result
        bookkeeping, and with `on_epoch` it must run at every step: for these terms it was most of
        medvol's fixed cost per step (docs/benchmarks/training.md, overhead). Here a step only adds the
        detached values to running sums.
        """
        names = {
            "g_adv_loss": "gan_generator",
            "gan_feat_loss": "gan_feature_matching",
            "disc_loss": "gan_discriminator",
        }
        values = {names.get(k, k): v.detach() for k, v in losses.items()}
        values["loss"] = sum(v.detach() for k, v in losses.items() if k not in names)
        values["generator_loss"] = generator_loss.detach()
        values["perplexity"] = perplexity.detach()
        for name, value in values.items():
            total, count = self._train_sums.get(name, (0.0, 0))
            self._train_sums[name] = (value * batch_size + total, count + batch_size)
        # The same test Lightning applies before sending step values to the loggers.
        if self.trainer._logger_connector.should_update_logs or self.trainer.fast_dev_run:
            for name, value in values.items():
                self.log(f"train/{name}_step", value, on_step=True, on_epoch=False, prog_bar=name == "loss",
                         batch_size=batch_size)

    def on_train_start(self) -> None:
        # Before the first step, so that no training step waits for the buffer's value on a GPU.
        self.codebook.read_initialized()

    def on_train_epoch_start(self) -> None:
        self._train_sums = {}

    def on_train_epoch_end(self) -> None:
        for name, (total, count) in self._train_sums.items():
            mean = total / count
            self.log(f"train/{name}_epoch", mean, on_step=False, on_epoch=True, prog_bar=name == "loss")
            # Unsuffixed, for callbacks and `optimized_metric` only, as Lightning's on_step+on_epoch logging gave.
            self.log(f"train/{name}", mean, on_step=False, on_epoch=True, logger=False)
        schedulers = self.lr_schedulers()
        if schedulers is None:
            return
        for scheduler in schedulers if isinstance(schedulers, list) else [schedulers]:
            scheduler.step()

    def _evaluate(self, batch: dict[str, Any], metrics: MetricCollection) -> dict[str, Any]:
        x = batch[self.image_key]
        x_rec, quantized = self(x)
        x_rec = x_rec.clamp(-1.0, 1.0)
        batch_size = x.shape[0]
        prefix = metrics.prefix
        metrics[f"{prefix}psnr"].update(x_rec, x)
        metrics[f"{prefix}ssim"].update(x_rec, x)
        metrics[f"{prefix}recon_loss"].update(F.l1_loss(x_rec, x), weight=batch_size)
        metrics[f"{prefix}perplexity"].update(quantized.perplexity, weight=batch_size)
        for name, metric in metrics.items():
            self.log(name, metric, prog_bar=name in ("val/psnr", "val/ssim"), batch_size=batch_size)
        return {
            "volumes": {"input": x.detach(), "reconstruction": x_rec.detach()},
            "difference": ("reconstruction", "input"),
        }

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        return self._evaluate(batch, self.val_metrics)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        outputs = self._evaluate(batch, self.test_metrics)
        # Per subject, as predict.py reports them: `<run>/predictions/metrics.csv`.
        volumes = outputs["volumes"]
        outputs["subject_metrics"] = self.subject_metrics(volumes["reconstruction"], volumes["input"])
        return outputs

    def subject_metrics(self, reconstruction: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """PSNR and SSIM of each subject's reconstruction against its input, in model units (data range 2)."""
        psnr = peak_signal_noise_ratio(reconstruction, x, data_range=2.0, reduction="none", dim=(1, 2, 3, 4))
        ssim = structural_similarity_index_measure(
            reconstruction, x, data_range=2.0, kernel_size=self.hparams.ssim_kernel_size, reduction="none"
        )
        assert isinstance(ssim, torch.Tensor)
        return {"psnr": psnr, "ssim": ssim}

    def predict_volumes(
        self, batch: dict[str, Any], window: SlidingWindow, extras: Sequence[str] = ()
    ) -> dict[str, Any]:
        """The reconstruction of whole volumes window by window; PSNR and SSIM against the input per subject.

        With `codes` in `extras`, also the codebook index of every latent voxel of the whole volume,
        encoded at once on the window's device (the latent grid of the whole scan, for a latent model).
        """
        x = batch[self.image_key].float()
        reconstruction = window(lambda patch: self(patch)[0].clamp(-1.0, 1.0), x)
        outputs: dict[str, Any] = {
            "volumes": {"input": x, "reconstruction": reconstruction},
            "difference": ("reconstruction", "input"),
            "subject_metrics": self.subject_metrics(reconstruction, x),
        }
        if "codes" in extras:
            outputs["arrays"] = {"codes": self.encode(x.to(window.device)).encodings.cpu()}
        return outputs

    def exported_networks(self, size: Sequence[int]) -> list[ExportedNetwork]:
        """The autoencoder as predict.py runs it on a window (`reconstruction`), and its `encoder` (image -> continuous
        latent) and `decoder` (latent -> image, snapped to the nearest codes first) apart; spatial sizes are
        multiples of `downsample`."""
        channels = int(self.hparams.in_channels)
        image, larger = spatial_examples(channels, size, self.downsample)
        latent_size = [int(s) // d for s, d in zip(size, self.downsample, strict=True)]
        latent, larger_latent = spatial_examples(int(self.hparams.embedding_dim), latent_size, [1, 1, 1])
        units = {"input": "image in model units [-1, 1] (the run's intensity scaling)",
                 "size_multiple": list(self.downsample)}
        return [
            ExportedNetwork(
                "reconstruction", self.bundle_network(), {"image": image}, "reconstruction",
                {"image": DYNAMIC_AXES, "reconstruction": DYNAMIC_AXES}, {"image": larger},
                {**units, "output": "reconstruction in model units, clamped to [-1, 1]"},
            ),
            ExportedNetwork(
                "encoder", Reconstruction(self.encoder, self.codebook, self.decoder, "encoder").eval(),
                {"image": image}, "latent", {"image": DYNAMIC_AXES, "latent": DYNAMIC_AXES}, {"image": larger},
                {**units, "output": "continuous latent (before quantisation), embedding_dim channels"},
            ),
            ExportedNetwork(
                "decoder", Reconstruction(self.encoder, self.codebook, self.decoder, "decoder").eval(),
                {"latent": latent}, "image", {"latent": DYNAMIC_AXES, "image": DYNAMIC_AXES},
                {"latent": larger_latent},
                {"input": "latent, snapped to the nearest code inside", "output": "image in model units (unclamped)"},
            ),
        ]

    def bundle_network(self) -> nn.Module:
        return Reconstruction(self.encoder, self.codebook, self.decoder).eval()
