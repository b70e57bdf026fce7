"""Latent diffusion (Rombach et al. 2022; medicaldiffusion's VQ-GAN + DDPM; MONAI's 3D LDM; NVIDIA MAISI) on a
trained medvol VQ-GAN.

The family on the diffusion core (`DiffusionModule`: schedule, timestep sets, prediction algebra,
samplers, EMA, per-subject noise, the walk, windowed sampling): it adds the frozen first stage
(`FirstStage`), the latent scale factor, the network over latents, and its conditioning: an image
condition encoded by the same first stage and concatenated first (as Fast-DDPM does in pixel
space), and the voxel spacing of each sample (as MAISI), given to the UNet's cross-attention as a
one-token context.

Latents are the encoder's continuous output before quantisation, times `scale_factor`: 1/std of the
training latents (Rombach et al.'s choice, not medicaldiffusion's min-max to the codebook range),
because the forward process assumes data of about unit variance against N(0, 1) noise, and one
std over every training latent voxel is robust to a few extreme codes where a min-max is set by
them. It is computed once, over the whole training split, before the first step (summed over
ranks), and kept in the checkpoint as a buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

from lightning_modules.base import DYNAMIC_AXES, ExportedNetwork
from lightning_modules.diffusion.checkpointing import checkpoint_unet
from lightning_modules.diffusion.diffusion_module import Conditioning, DiffusionModule
from lightning_modules.diffusion.generation_metrics import (
    VolumeSetMMD,
    generation_metrics,
    load_feature_network,
    sample_msssim,
    update_generation_metrics,
)
from lightning_modules.diffusion.subject_noise import SubjectNoise, subject_names
from lightning_modules.ldm.first_stage import EncodeLatent, FirstStage, read_first_stage, weights_digest
from lightning_modules.ldm.positions import latent_coordinates
from lightning_modules.ldm.slab_decoding import fits_on_device
from lightning_modules.ldm.spacing_embedding import with_spacing_embedding
from lightning_modules.vqgan.codebook import snapped_to_codes
from medvol.core.errors import MedvolError
from medvol.core.module_size import load_weights
from medvol.volumes.volume_budget import check_volume_size

log = logging.getLogger("medvol")


def voxel_spacings(affine: torch.Tensor) -> torch.Tensor:
    """(B, 3) voxel sizes in mm of (B, 4, 4) affines."""
    return torch.linalg.vector_norm(affine[:, :3, :3].double(), dim=1).float()


# Coordinate channels of `position_channels` (z, y, x).
COORDINATES = 3
# A voxel spacing (x, y, z) in mm, as `spacing_conditioning` takes it.
SPACING_DIMS = 3


class LatentCodec(nn.Module):
    """The first stage as a latent model uses it, for export: `encoder` image -> latent * scale, `decoder` latent /
    scale -> (snapped to the codes with `quantized`) -> image clamped to [-1, 1]."""

    def __init__(self, first_stage: FirstStage, scale: float, part: str, quantized: bool) -> None:
        super().__init__()
        self.first_stage, self.scale, self.part, self.quantized = first_stage, float(scale), part, quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.part == "encoder":
            return self.first_stage.encoder(x) * self.scale
        z = x / self.scale
        if self.quantized:
            z = snapped_to_codes(z, self.first_stage.codebook.embeddings)
        return self.first_stage.decoder(z).clamp(-1.0, 1.0)


class LatentDiffusion(DiffusionModule):
    """Diffusion over the latents of a frozen VQ-GAN.

    Args:
        network: partial denoiser (MONAI's `DiffusionModelUNet`), called with `in_channels` and
            `out_channels` (and, with `spacing_conditioning`, `num_class_embeds`: its class embedding becomes the
            spacing embedding).
        first_stage_ckpt: the trained VQ-GAN, `<vqgan run>/checkpoints/<file>`; read at construction
            for training (its settings and weights then travel in this model's checkpoint).
        first_stage_settings: the VQ-GAN's network settings, recorded in this model's hyperparameters;
            a module restored from its checkpoint builds the first stage from them and reads no file.
        cond_channels: channels of the batch's `cond` image (0: unconditional); encoded by the first stage.
        spacing_conditioning: condition every sample on its voxel spacing (mm, from the batch's `affine`): a
            learned embedding of it added to the time embedding, as MAISI (`spacing_embedding`).
        position_channels: give the network each latent voxel's place in its whole volume as three coordinate
            channels (PatchDDM), from the batch's `patch_origin` and `volume_shape` (a crop of the patches
            dataset) or the whole volume: a model trained on crops then puts the anatomy where it belongs.
        activation_checkpointing: recompute each residual and attention block's activations in the backward pass
            instead of keeping them (the same gradients, less memory, about a third more compute).
        decode_quantized: snap generated latents to the nearest codes before decoding.
        decode_slab_elements: decode layer by layer in depth slabs of at most this many values on the
            device (`slab_decoding`: exactly the whole-volume output, for volumes whose decoder
            activations do not fit at once); null decodes the whole volume in one call.
        decode_offload: with slabs, keep each layer's whole activation in pinned host memory (only slabs on the GPU);
            null: only on a CUDA device whose free memory is less than the whole activations need
            (`slab_decoding.decoding_bytes`).
        sample_size: image size (D, H, W) of unconditional samples (null: the training volume's).
        mmd_size: volumes are pooled to at most this many voxels per axis for the MMD and the training-set
            metrics (`generation_metrics`).
        diversity_size: volumes are pooled to at most this many voxels per axis for the set MS-SSIM.
        fid_network: a local TorchScript 3D feature network: 3D FID between samples and real volumes
            (`fid`); null: no FID (features of an untrained network would not be FID).
        fid_network_2d: a local TorchScript 2D feature network (RadImageNet's ResNet-50 in MAISI): MAISI's 2.5D
            FID over the axial, coronal and sagittal slices (`fid_2p5d`, per plane `fid_2p5d_<plane>`); null: none.
        image_key: batch key of the volume to generate.
        cond_key: batch key of the condition image.
        ssim_kernel_size: Gaussian window of the SSIM and MS-SSIM metrics.
        **diffusion: the diffusion core's settings (`DiffusionModule`).
    """

    def __init__(
        self,
        network: Callable[..., nn.Module],
        first_stage_ckpt: str | None = None,
        first_stage_settings: Mapping[str, Any] | None = None,
        cond_channels: int = 0,
        spacing_conditioning: bool = False,
        position_channels: bool = False,
        activation_checkpointing: bool = False,
        decode_quantized: bool = True,
        decode_slab_elements: int | None = None,
        decode_offload: bool | None = None,
        sample_size: Sequence[int] | None = None,
        mmd_size: int = 16,
        diversity_size: int = 32,
        fid_network: str | None = None,
        fid_network_2d: str | None = None,
        image_key: str = "image",
        cond_key: str = "cond",
        ssim_kernel_size: int = 11,
        **diffusion: Any,
    ) -> None:
        super().__init__(**diffusion)
        self.save_hyperparameters(logger=False)
        if first_stage_settings is not None:
            settings, weights = dict(first_stage_settings), None
        else:
            settings, weights = read_first_stage(first_stage_ckpt)
        self.first_stage = FirstStage(**settings)
        if weights is not None:
            load_weights(self.first_stage, weights)
        self.hparams["first_stage_settings"] = settings
        self.cond_channels = int(cond_channels)
        if self.cond_channels and self.cond_channels != self.first_stage.in_channels:
            raise MedvolError(
                f"`model.cond_channels`={self.cond_channels}, but the first stage encodes "
                f"{self.first_stage.in_channels}-channel images; a condition is encoded by the same VQ-GAN, "
                "so give it as many channels"
            )
        if decode_slab_elements is not None and int(decode_slab_elements) < 1:
            raise MedvolError(f"`model.decode_slab_elements` must be null or >= 1, got {decode_slab_elements}")
        self.register_buffer("scale_factor", torch.tensor(0.0))
        # Python copy of `scale_factor`, read once: reading the buffer on a GPU is a host sync per step.
        self._scale: float | None = None
        self.register_buffer("training_latent_size", torch.zeros(3, dtype=torch.long))
        latent = self.first_stage.embedding_dim
        inputs = latent * (2 if self.cond_channels else 1) + (COORDINATES if position_channels else 0)
        if spacing_conditioning:
            unet = with_spacing_embedding(network(in_channels=inputs, out_channels=latent, num_class_embeds=1))
        else:
            unet = network(in_channels=inputs, out_channels=latent)
        if activation_checkpointing:
            checkpoint_unet(unet)
        self.attach_network(unet)
        image = {
            "psnr": PeakSignalNoiseRatio(data_range=2.0, reduction="elementwise_mean", dim=(1, 2, 3, 4)),
            "ssim": StructuralSimilarityIndexMeasure(data_range=2.0, kernel_size=ssim_kernel_size),
        }
        generation = generation_metrics(mmd_size, diversity_size, ssim_kernel_size, fid_network, fid_network_2d)
        self.set_metrics(
            ssim_kernel_size, loss=MeanMetric(), recon_psnr=image["psnr"], recon_ssim=image["ssim"],
            recon_mmd=VolumeSetMMD(mmd_size), diversity_msssim=MeanMetric(), **generation,
        )

    @classmethod
    def restoring_settings(cls, hyper_parameters: dict[str, Any]) -> dict[str, Any]:
        # The first stage comes from this checkpoint (its settings here, its weights in the state dict).
        settings = hyper_parameters.get("first_stage_settings")
        return {} if settings is None else {"first_stage_settings": dict(settings)}

    @classmethod
    def check_settings(cls, settings: Mapping[str, Any]) -> None:
        # Null here is a cascade's stage whose VQ-GAN trains first (a plain run's unset `???` is refused before).
        if settings.get("first_stage_ckpt") is not None:
            read_first_stage(settings.get("first_stage_ckpt"))
        if settings.get("fid_network"):
            load_feature_network(settings.get("fid_network"))
        if settings.get("fid_network_2d"):
            load_feature_network(settings.get("fid_network_2d"), key="model.fid_network_2d")

    @classmethod
    def generates_from_noise(cls, settings: Mapping[str, Any]) -> bool:
        return not settings.get("cond_channels")

    # ---- latents ----------------------------------------------------------------------------

    @property
    def scale(self) -> float:
        """`scale_factor` as a number, read from the buffer once (a host sync on a GPU; before the first training
        step, `on_train_start`) and again only after the buffer is set, loaded, moved or cast."""
        if self._scale is None:
            value = float(self.scale_factor)
            if value <= 0:
                raise RuntimeError(
                    "the latent scale factor is not computed yet (it is, before the first training step)"
                )
            self._scale = value
        return self._scale

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._scale = None
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> LatentDiffusion:
        self._scale = None
        return super()._apply(fn, recurse)

    def latents(self, images: torch.Tensor) -> torch.Tensor:
        """Scaled continuous latents of (B, C, D, H, W) images."""
        return self.first_stage.encode(images) * self.scale

    def raw_latents(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The unscaled latents of the batch's images: cached by the dataset (`latent`), else encoded now."""
        if batch.get("latent") is not None:
            return batch["latent"].float().to(self.device)
        return self.first_stage.encode(batch[self.hparams.image_key].float().to(self.device))

    def cached_transform(self) -> tuple[EncodeLatent, dict[str, Any]]:
        """The encoder as a dataset transform, and what its outputs are made from (the first stage's weights), for
        the run to hand the datamodule: latents are computed once per subject and cached with the images."""
        return EncodeLatent(self.first_stage, self.hparams.image_key), {"first_stage": weights_digest(self.first_stage)}

    def images(self, latents: torch.Tensor) -> torch.Tensor:
        """Images decoded from scaled latents (snapped to the codebook with `decode_quantized`), in [-1, 1]."""
        slab = self.hparams.decode_slab_elements
        slab = None if slab is None else int(slab)
        offload = self.decode_offload(latents, slab)
        report = None
        if self.progress and slab is not None:
            log.info("decoding a %s latent by depth slabs of %d values, whole activations %s",
                     "x".join(map(str, latents.shape[2:])), slab, "in pinned host memory" if offload else
                     f"on {latents.device}")

            def report(part: str, slabs: int) -> None:
                log.info("decoding: %s in %d slabs", part, slabs)

        decoded = self.first_stage.decode(
            latents / self.scale, bool(self.hparams.decode_quantized), slab, offload, report
        )
        return decoded.clamp(-1.0, 1.0)

    def decode_offload(self, latents: torch.Tensor, slab: int | None) -> bool:
        """Whether decoding keeps its whole activations in host memory: `decode_offload` where set, else only on a
        CUDA device whose free memory (`torch.cuda.mem_get_info`, plus what PyTorch's allocator holds unused) is
        less than they need (`slab_decoding.decoding_bytes`)."""
        if self.hparams.decode_offload is not None:
            return bool(self.hparams.decode_offload)
        if slab is None or latents.device.type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(latents.device)
        free += torch.cuda.memory_reserved(latents.device) - torch.cuda.memory_allocated(latents.device)
        return not fits_on_device(self.first_stage.decoder, latents.shape, slab, free)

    @torch.no_grad()
    def set_scale_factor(self, batches: Any) -> None:
        """`scale_factor` = 1/std of the raw latents of every training batch in `batches`, over all ranks."""
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        for batch in batches:
            z = self.raw_latents(batch).double()
            if not int(self.training_latent_size.sum()):
                self.training_latent_size.copy_(torch.tensor(z.shape[2:]))
            totals += torch.stack([z.sum(), z.square().sum(), torch.tensor(z.numel(), device=z.device).double()])
        if self._trainer is not None and self.trainer.world_size > 1:
            totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        mean = totals[0] / totals[2]
        std = (totals[1] / totals[2] - mean.square()).clamp_min(1e-12).sqrt()
        self.scale_factor.fill_(float(1.0 / std))
        self._scale = None

    def on_train_start(self) -> None:
        super().on_train_start()
        # Before the first step (the scale factor is set by now), so that no training step waits for it on a GPU.
        self._scale = self.scale

    def on_fit_start(self) -> None:
        # One pass over the training data: the training-set metrics' volumes, and the scale factor unless a resumed
        # run restored it with the weights (computed once per run).
        batches = self.recording_training_set(self.trainer.datamodule.train_dataloader(), self.hparams.image_key)
        if float(self.scale_factor) > 0:
            for _ in batches:
                pass
            return
        self.set_scale_factor(batches)
        sizes = self.training_latent_size.clone()
        if self.trainer.world_size > 1:
            # Every rank keeps rank 0's record, so checkpoints agree.
            sizes = self.trainer.strategy.broadcast(sizes, src=0)
        self.training_latent_size.copy_(sizes)

    # ---- conditioning -----------------------------------------------------------------------

    def latent_condition(self, batch: Mapping[str, Any]) -> torch.Tensor | None:
        """The batch's condition image encoded and scaled as the targets are (None when unconditional)."""
        if not self.cond_channels:
            return None
        cond = batch.get(self.hparams.cond_key)
        if cond is None or cond.shape[1] != self.cond_channels:
            got = "none" if cond is None else f"{cond.shape[1]} channel(s)"
            raise MedvolError(
                f"`model.cond_channels`={self.cond_channels} but the batch's `{self.hparams.cond_key}` has {got}; "
                "use a dataset with as many `cond_modalities`, or set model.cond_channels=0"
            )
        return self.latents(cond.float())

    def spacing(self, batch: Mapping[str, Any], size: int) -> torch.Tensor | None:
        """(B, 3) voxel sizes of the batch (from its `affine`), when spacing conditions the model."""
        if not self.hparams.spacing_conditioning:
            return None
        affine = batch.get("affine")
        if affine is None:
            raise MedvolError(
                "`model.spacing_conditioning` needs each sample's `affine` (its voxel spacing); the batch has none"
            )
        return voxel_spacings(affine)[:size].to(self.device)

    def positions(
        self, batch: Mapping[str, Any], latent_shape: Sequence[int], volume: Sequence[int] | None = None
    ) -> torch.Tensor | None:
        """(B, 3, D, H, W) coordinates of a (B, C, D, H, W) latent in its whole volume, with `position_channels`:
        a patch's from the batch's `patch_origin` and `volume_shape`, else those of a whole volume (of `volume` image
        voxels, default the latent's own grid)."""
        if not self.hparams.position_channels:
            return None
        size, factors = [int(s) for s in latent_shape[2:]], self.first_stage.downsample
        count = int(latent_shape[0])
        whole = torch.tensor(volume or [s * d for s, d in zip(size, factors, strict=True)], device=self.device)
        origin = batch.get("patch_origin")
        shape = batch.get("volume_shape")
        origin = torch.zeros(count, 3, device=self.device) if origin is None else origin.to(self.device)[:count]
        shape = whole.expand(count, 3) if shape is None else shape.to(self.device)[:count]
        return latent_coordinates(origin, shape, size, factors)

    def conditioning(
        self, cond: torch.Tensor | None, spacing: torch.Tensor | None, coordinates: torch.Tensor | None = None
    ) -> Conditioning:
        """The latent condition and the coordinates (both cut to each sampling window) and the spacing (one row per
        sample)."""
        volumes = {name: v for name, v in (("cond", cond), ("coordinates", coordinates)) if v is not None}
        return Conditioning(volumes=volumes, per_sample={} if spacing is None else {"spacing": spacing})

    def network_output(
        self, network: nn.Module, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor | None = None,
        spacing: torch.Tensor | None = None, coordinates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Condition first, as Fast-DDPM concatenates in pixel space, then the coordinates, then x_t.
        given = [v.to(x_t.dtype) for v in (cond, coordinates) if v is not None]
        inputs = torch.cat([*given, x_t], dim=1) if given else x_t
        if spacing is None:
            return network(inputs, t)
        return network(inputs, t, class_labels=spacing.float())

    # ---- export (export.py) -------------------------------------------------------------------

    def denoised_grid(self, size: Sequence[int]) -> tuple[int, list[int], list[int]]:
        """Latents: the first stage's channels on the training latent grid (the image `size` over `downsample`)."""
        recorded = [int(s) for s in self.training_latent_size]
        grid = recorded if all(recorded) else [int(s) // d for s, d in zip(size, self.first_stage.downsample,
                                                                              strict=True)]
        return self.first_stage.embedding_dim, grid, super().denoised_grid(size)[2]

    def conditioning_examples(
        self, x_t: torch.Tensor, larger: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, dict[int, str]]]:
        """The condition's scaled latent on x_t's grid, the voxel spacing (B, 3) in mm and the latent voxels'
        coordinates in the whole volume (B, 3, D, H, W), where the model has them."""
        generator = torch.Generator().manual_seed(1)
        examples: dict[str, tuple[torch.Tensor, torch.Tensor, dict[int, str]]] = {}
        if self.cond_channels:
            first, second = (torch.randn(x.shape, generator=generator) for x in (x_t, larger))
            examples["cond"] = (first, second, DYNAMIC_AXES)
        if self.hparams.spacing_conditioning:
            first, second = (torch.rand(x.shape[0], SPACING_DIMS, generator=generator) + 0.5 for x in (x_t, larger))
            examples["spacing"] = (first, second, {0: "batch"})
        if self.hparams.position_channels:
            first, second = (torch.rand(x.shape[0], COORDINATES, *x.shape[2:], generator=generator) * 2 - 1
                             for x in (x_t, larger))
            examples["coordinates"] = (first, second, DYNAMIC_AXES)
        return examples

    def exported_networks(self, size: Sequence[int]) -> list[ExportedNetwork]:
        """The denoiser over scaled latents, and the first stage's halves as this model uses them: `encoder` (image
        -> scaled latent, what a condition goes through) and `decoder` (scaled latent -> image in [-1, 1], snapped
        to the codes first with `decode_quantized`)."""
        denoiser = super().exported_networks(size)
        latent = denoiser[0].inputs["x_t"]
        larger_latent = denoiser[0].larger["x_t"]
        image, larger = (torch.randn(x.shape[0], self.first_stage.in_channels,
                                     *[int(n) * d for n, d in zip(x.shape[2:], self.first_stage.downsample,
                                                                  strict=True)]) for x in (latent, larger_latent))
        scale = {"scale_factor": self.scale, "size_multiple": list(self.first_stage.downsample)}
        return [
            ExportedNetwork(
                "denoiser", denoiser[0].network, denoiser[0].inputs, denoiser[0].output, denoiser[0].dynamic,
                denoiser[0].larger, {**denoiser[0].about, **scale},
            ),
            ExportedNetwork(
                "encoder", LatentCodec(self.first_stage, self.scale, "encoder", False).eval(), {"image": image},
                "latent", {"image": DYNAMIC_AXES, "latent": DYNAMIC_AXES}, {"image": larger},
                {**scale, "output": "the image's continuous latent times scale_factor"},
            ),
            ExportedNetwork(
                "decoder",
                LatentCodec(self.first_stage, self.scale, "decoder", bool(self.hparams.decode_quantized)).eval(),
                {"latent": latent}, "image", {"latent": DYNAMIC_AXES, "image": DYNAMIC_AXES}, {"latent": larger_latent},
                {**scale, "output": "image in model units, clamped to [-1, 1]"},
            ),
        ]

    # ---- Lightning steps --------------------------------------------------------------------

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        z0 = self.raw_latents(batch) * self.scale
        conditioning = self.conditioning(
            self.latent_condition(batch), self.spacing(batch, z0.shape[0]), self.positions(batch, z0.shape)
        )
        t = self.draw_timesteps(z0.shape[0], z0.device)
        output, target, _ = self.training_prediction(self.network, z0, t, self.noise_like(z0), conditioning)
        loss = self.regression_loss(output, target)
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, prog_bar=True, batch_size=z0.shape[0])
        return loss

    def draw(
        self, batch: Mapping[str, Any], shape: Sequence[int], conditioning: Conditioning, noise: SubjectNoise
    ) -> torch.Tensor:
        """One seeded sample per subject: latent noise of `shape` walked to a latent, and decoded."""
        z_T = noise.draw(shape, self.device)
        z0 = self.sample(z_T, conditioning, noise)
        return self.images(z0)

    def _evaluate(self, batch: dict[str, Any], batch_idx: int, metrics: MetricCollection) -> dict[str, Any]:
        x0 = batch[self.hparams.image_key].float()
        size, prefix = x0.shape[0], metrics.prefix
        names = subject_names(batch, batch_idx, size)
        z0 = self.raw_latents(batch) * self.scale
        cond = self.latent_condition(batch)
        conditioning = self.conditioning(cond, self.spacing(batch, size), self.positions(batch, z0.shape))
        noise = SubjectNoise(names, self.sample_seed, salt="sample")
        sample = self.draw(batch, z0.shape[1:], conditioning, noise)
        second = self.draw(batch, z0.shape[1:], conditioning, SubjectNoise(names, self.sample_seed, salt="second"))
        # A fixed (per-subject) step and noise make the validation loss comparable across epochs and ranks.
        t = self.train_timesteps[noise.integers(len(self.train_timesteps))].to(x0.device)
        output, target, _ = self.training_prediction(
            self.sampling_network, z0, t, self.noise_like(z0, noise), conditioning
        )
        reconstruction = self.images(z0)
        metrics[f"{prefix}loss"].update(self.regression_loss(output, target), weight=size)
        metrics[f"{prefix}recon_psnr"].update(reconstruction, x0)
        metrics[f"{prefix}recon_ssim"].update(reconstruction, x0)
        update_generation_metrics(metrics, prefix, sample, x0)
        metrics[f"{prefix}recon_mmd"].update(reconstruction, x0)
        diversity = sample_msssim(sample, second, int(self.hparams.ssim_kernel_size))
        metrics[f"{prefix}diversity_msssim"].update(diversity.mean(), weight=size)
        volumes = {"sample": sample.detach(), "target": x0.detach(), "reconstruction": reconstruction.detach()}
        if cond is not None:
            metrics[f"{prefix}psnr"].update(sample, x0)
            metrics[f"{prefix}ssim"].update(sample, x0)
            volumes["condition"] = batch[self.hparams.cond_key].detach()
        # Unconditional samples have no paired target: PSNR/SSIM against one would mean nothing.
        logged = {n: m for n, m in metrics.items() if cond is not None or not n.endswith(("/psnr", "/ssim"))}
        self.log_evaluation(logged, size, [n for n in logged if n.endswith(("psnr", "/mmd"))])
        return {"volumes": volumes, "units": {"condition": "cond"}}

    # ---- generation (predict.py) ------------------------------------------------------------

    def generation_inputs(self) -> dict[str, int]:
        return {self.hparams.cond_key: self.cond_channels} if self.cond_channels else {}

    def grid_multiple(self) -> list[int]:
        """Image sizes must be multiples of these: the first stage's downsampling times the UNet's halvings."""
        levels = len(getattr(self.network, "block_out_channels", ())) or 1
        return [d * 2 ** (levels - 1) for d in self.first_stage.downsample]

    def unconditional_size(self) -> list[int]:
        """Image size of an unconditional sample: `sample_size`, else the training volume's."""
        if self.hparams.sample_size:
            return [int(s) for s in self.hparams.sample_size]
        return [
            int(s) * d for s, d in zip(self.training_latent_size.tolist(), self.first_stage.downsample, strict=True)
        ]

    @torch.no_grad()
    def generate_volumes(self, batch: dict[str, Any], draw: int = 0) -> dict[str, Any]:
        """Draw `draw` of each subject: from its condition image (on its grid), or from noise alone at
        `unconditional_size` (the batch then only names the subjects and their `affine`). Draw 0 of a
        subject with a condition is the sample `test_step` gives it."""
        names = [str(s) for s in batch["subject"]]
        noise = SubjectNoise(names, self.sample_seed + draw, salt="sample")
        spacing = self.spacing(batch, len(names))
        multiple = self.grid_multiple()
        if not self.cond_channels:
            size = self.unconditional_size()
            bad = [s for s, m in zip(size, multiple, strict=True) if s % m]
            if bad or len(size) != 3:
                raise MedvolError(
                    f"`model.sample_size` {size} must be three multiples of {multiple} (the first stage's downsampling "
                    "times the denoiser's halvings)"
                )
            # The size may come from the checkpoint (its training volume's): a volume like any other.
            where = "`model.sample_size`" if self.hparams.sample_size else "the training size the checkpoint records"
            check_volume_size(where, [len(names), self.first_stage.in_channels, *size], "asks for samples of",
                              before="generating them")
            latent = [s // d for s, d in zip(size, self.first_stage.downsample, strict=True)]
            shape = [self.first_stage.embedding_dim, *latent]
            conditioning = self.conditioning(None, spacing, self.positions({}, [len(names), *shape]))
            return {"volumes": {"sample": self.draw(batch, shape, conditioning, noise)}}
        cond = batch[self.hparams.cond_key].float().to(self.device)
        size = cond.shape[2:]
        # A whole scan of any size: padded at the far end (with its darkest value) to what the grids halve.
        pad = [-n % m for n, m in zip(size, multiple, strict=True)]
        cond = F.pad(cond, (0, pad[2], 0, pad[1], 0, pad[0]), value=float(cond.min()))
        latent_cond = self.latents(cond)
        # The scan is the whole volume: the padding lies beyond its far end (coordinates above 1).
        coordinates = self.positions({}, latent_cond.shape, [int(s) for s in size])
        sample = self.draw(batch, latent_cond.shape[1:], self.conditioning(latent_cond, spacing, coordinates), noise)
        return {"volumes": {"sample": sample[..., : size[0], : size[1], : size[2]]}}
