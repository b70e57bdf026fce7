"""The frozen first stage of latent diffusion: a trained medvol VQ-GAN's encoder, codebook and decoder.

Read from a VQ-GAN checkpoint through its public pieces (`encoder`, `codebook`, `decoder`), without the
discriminators; its settings are checked against its weights' shapes and the memory budget before the network
is allocated (`medvol.core.module_size`). The settings that shape the networks (`FIRST_STAGE_SETTINGS`) are kept
beside the weights, so a latent model's checkpoint rebuilds its first stage without the VQ-GAN's file.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_modules.base import MODEL_KEY
from lightning_modules.ldm.slab_decoding import Report, run_in_slabs, to_storage
from lightning_modules.vqgan.codebook import EMACodebook
from lightning_modules.vqgan.vq_autoencoder import Decoder3d, Encoder3d
from medvol.core.checkpoint_read import load_checkpoint
from medvol.core.errors import MedvolError
from medvol.core.module_size import check_module_bytes, first_mismatch, on_meta

VQGAN_CLASS = "lightning_modules.vqgan.vqgan.VQGAN"
FIRST_STAGE_SETTINGS = ("in_channels", "embedding_dim", "n_codes", "n_hiddens", "downsample")
PIECES = ("encoder", "codebook", "decoder")
EXPECTED = "a VQ-GAN run's checkpoint, e.g. <vqgan run>/checkpoints/last.ckpt"


def _plain(value: Any) -> Any:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else value


def read_first_stage(path: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(settings, weights) of the VQ-GAN checkpoint `path` (`model.first_stage_ckpt`), else one `MedvolError` line."""
    if not path:
        raise MedvolError(f"`model.first_stage_ckpt` is not set; expected {EXPECTED}")
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise MedvolError(f"`model.first_stage_ckpt`: no file at {file}; expected {EXPECTED}")
    checkpoint = load_checkpoint(file, "model.first_stage_ckpt", EXPECTED)
    saved = checkpoint.get(MODEL_KEY) if isinstance(checkpoint, dict) else None
    if saved != VQGAN_CLASS:
        raise MedvolError(
            f"`model.first_stage_ckpt`: {file} is a checkpoint of {saved or 'an unknown model'}, not of the VQ-GAN "
            f"({VQGAN_CLASS}); expected {EXPECTED}"
        )
    hyper, state = checkpoint.get("hyper_parameters"), checkpoint.get("state_dict")
    hyper, state = (hyper if isinstance(hyper, dict) else {}), (state if isinstance(state, dict) else {})
    settings = {key: _plain(hyper[key]) for key in FIRST_STAGE_SETTINGS if key in hyper}
    weights = {k: v for k, v in state.items() if str(k).split(".")[0] in PIECES}
    check_first_stage(file, settings, weights)
    return settings, weights


def check_first_stage(file: Path, settings: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """Refuse, before any of it is allocated, a first stage whose settings build other shapes than its weights
    have (`n_codes=2**28` beside a 512-code codebook) or more than the memory budget holds."""
    source = f"`model.first_stage_ckpt`: {file}"
    module = on_meta(lambda: FirstStage(**settings), source)
    mismatch = first_mismatch(module, weights)
    if mismatch is not None:
        held = f"holds {mismatch.key} of shape {mismatch.saved}" if mismatch.saved is not None else (
            f"lacks {mismatch.key}")
        raise MedvolError(
            f"{source} {held}, but its settings ({', '.join(f'{k}={v}' for k, v in settings.items())}) build "
            f"{mismatch.key} of shape {mismatch.built}; expected {EXPECTED}"
        )
    check_module_bytes(module, source)


class FirstStage(nn.Module):
    """A VQ-GAN's encoder, codebook and decoder, frozen: no gradients, always in eval mode.

    Args:
        in_channels: image channels.
        embedding_dim: latent channels (the code vectors' size).
        n_codes: codebook size.
        n_hiddens: channels of the first encoder layer.
        downsample: per-axis reduction factor from image to latent grid.
    """

    def __init__(
        self, in_channels: int = 1, embedding_dim: int = 8, n_codes: int = 512, n_hiddens: int = 16,
        downsample: Sequence[int] = (4, 4, 4),
    ) -> None:
        super().__init__()
        self.downsample = tuple(int(d) for d in downsample)
        self.in_channels = int(in_channels)
        self.embedding_dim = int(embedding_dim)
        self.encoder = Encoder3d(in_channels, n_hiddens, self.downsample, embedding_dim)
        self.codebook = EMACodebook(n_codes, embedding_dim)
        self.decoder = Decoder3d(in_channels, n_hiddens, self.downsample, embedding_dim)
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> FirstStage:
        # Frozen: a parent's .train() must not turn on the codebook's EMA updates or dropout.
        return super().train(False)

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder's continuous latent (before quantisation) of (B, C, D, H, W) images."""
        self.check_grid(x.shape[2:])
        return self.encoder(x.float())

    @torch.no_grad()
    def decode(
        self, z: torch.Tensor, quantized: bool, slab_elements: int | None = None, offload: bool = False,
        report: Report | None = None,
    ) -> torch.Tensor:
        """Images from latents `z`, snapped to the codebook first when `quantized`; with `slab_elements`, layer by
        layer in depth slabs of at most that many values on `z`'s device (`slab_decoding`: the same output),
        the whole activations kept in pinned host memory with `offload`; `report` hears of the decoder's parts."""
        z = self.snap(z.float()) if quantized else z.float()
        if slab_elements is None:
            return self.decoder(z)
        return run_in_slabs(self.decoder, to_storage(z, offload), slab_elements, z.device, report).to(z.device)

    def snap(self, z: torch.Tensor) -> torch.Tensor:
        """Every latent vector replaced by its nearest code (exactly the code: no straight-through arithmetic).

        The distances are fp32 under any autocast, as in the codebook's own forward: in bf16 a few percent
        of the latent vectors would get a code that is not their nearest."""
        with torch.autocast(device_type=z.device.type, enabled=False):
            channels_last = z.float().movedim(1, -1)
            indices = self.codebook.nearest(channels_last.reshape(-1, self.embedding_dim))
            return self.codebook.embeddings[indices].view(channels_last.shape).movedim(-1, 1)

    def check_grid(self, size: Sequence[int]) -> None:
        bad = [int(s) for s, d in zip(size, self.downsample, strict=True) if s % d]
        if bad:
            raise MedvolError(
                f"the first stage's downsample {list(self.downsample)} must divide the volume size, got {list(size)}; "
                "crop/pad the dataset to a multiple of the downsample factors"
            )


def weights_digest(module: nn.Module) -> str:
    """sha256 of a module's weights (names, shapes and bytes): what a cache of its outputs is made from."""
    digest = hashlib.sha256()
    for name, value in module.state_dict().items():
        digest.update(f"{name}{tuple(value.shape)}{value.dtype}".encode())
        digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class EncodeLatent:
    """Item transform: the raw (unscaled) latent of the item's image as `latent`, by a CPU copy of the first stage.

    Deterministic, so the dataset cache keeps each subject's latent (`VolumeDataModule.add_cached_transform`).
    """

    def __init__(self, first_stage: FirstStage, image_key: str = "image") -> None:
        self.first_stage = copy.deepcopy(first_stage).cpu()
        self.image_key = image_key

    def __call__(self, item: dict) -> dict:
        image = item[self.image_key]
        image = image.as_tensor() if hasattr(image, "as_tensor") else torch.as_tensor(image)
        return {**item, "latent": self.first_stage.encode(image.float()[None])[0]}
