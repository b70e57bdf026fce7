"""Latent diffusion on a trained VQ-GAN: the frozen first stage, the scale factor, exact slab decoding, refusals,
predict."""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.networks.nets import DiffusionModelUNet
from omegaconf import OmegaConf
from torch import nn

from datamodules.sources.phantom import make_phantom
from lightning_modules.base import MODEL_KEY
from lightning_modules.diffusion.fast_ddpm import ConditionalDiffusion
from lightning_modules.ldm.first_stage import VQGAN_CLASS, FirstStage
from lightning_modules.ldm.latent_diffusion import LatentDiffusion
from lightning_modules.ldm.spacing_embedding import SpacingEmbedding, with_spacing_embedding
from lightning_modules.vqgan.vqgan import VQGAN
from medvol.core.build import build, build_model
from medvol.core.errors import MedvolError
from medvol.core.plain_values import plain
from medvol.run.predicting import predict
from medvol.run.trained_run import open_trained_run
from medvol.run.training import check_config, run
from tests.conftest import TINY_COMMON, TINY_MODEL, compose_cfg
from tests.ddp_support import validation_on_two_ranks_and_one
from tests.lightning_modules.diffusion.test_generation_metrics import gaussian_mmd_by_hand
from tests.medvol.run.test_predict import predict_cfg, saved_run

TINY_VQGAN = {"n_hiddens": 8, "n_codes": 32, "embedding_dim": 4, "disc_channels": 8, "disc_layers": 2}
TINY_UNET = partial(
    DiffusionModelUNet, spatial_dims=3, channels=[8, 8], attention_levels=[False, True], num_res_blocks=1,
    norm_num_groups=4, num_head_channels=4,
)


def save_checkpoint(module: nn.Module, path: Path, family: str) -> Path:
    """A checkpoint as a medvol run writes it (family, hyperparameters as plain values, weights)."""
    torch.save({MODEL_KEY: family, "hyper_parameters": plain(dict(getattr(module, "hparams", {}))),
                "state_dict": module.state_dict(), "loops": {}}, path)
    return path


@pytest.fixture
def vqgan_ckpt(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    return save_checkpoint(VQGAN(**TINY_VQGAN), tmp_path / "vqgan.ckpt", VQGAN_CLASS)


def tiny_ldm(ckpt: Path, **settings) -> LatentDiffusion:
    torch.manual_seed(1)
    return LatentDiffusion(TINY_UNET, first_stage_ckpt=str(ckpt), ssim_kernel_size=3, **settings)


def phantoms(count: int = 2, size: int = 16, modality: str = "t1") -> torch.Tensor:
    volumes = [make_phantom(0, i, size).channels[modality] for i in range(count)]
    stacked = torch.from_numpy(np.stack(volumes))[:, None].float()
    return stacked / stacked.amax() * 2 - 1


def test_the_first_stage_is_the_vqgans_encoder_codebook_and_decoder_frozen(vqgan_ckpt):
    vqgan = VQGAN(**TINY_VQGAN)
    vqgan.load_state_dict(torch.load(vqgan_ckpt, weights_only=True)["state_dict"])
    module = tiny_ldm(vqgan_ckpt)
    module.train()
    x = phantoms()
    # The VQ-GAN's own encoder output (before quantisation) and its decoder.
    torch.testing.assert_close(module.first_stage.encode(x), vqgan.encoder(x), rtol=0, atol=0)
    z = torch.randn(2, 4, 4, 4, 4)
    torch.testing.assert_close(module.first_stage.decode(z, quantized=False), vqgan.decoder(z), rtol=0, atol=0)
    assert not any(p.requires_grad for p in module.first_stage.parameters())
    assert not any(m.training for m in module.first_stage.modules())
    assert all(p.requires_grad for p in module.network.parameters())


def test_the_scale_factor_makes_training_latents_unit_variance_and_is_undone_before_decoding(vqgan_ckpt):
    module = tiny_ldm(vqgan_ckpt, decode_quantized=False)
    x = phantoms(4)
    module.set_scale_factor([{"image": x[:2]}, {"image": x[2:]}])
    raw = module.first_stage.encode(x).double().numpy()
    assert float(module.scale_factor) == pytest.approx(1.0 / np.std(raw), rel=1e-6)
    assert module.training_latent_size.tolist() == [4, 4, 4]
    scaled = module.latents(x)
    assert float(scaled.double().std(unbiased=False)) == pytest.approx(1.0, rel=1e-5)
    # encode -> scale -> unscale -> decode equals decoding the raw latent.
    expected = module.first_stage.decoder(module.first_stage.encoder(x)).clamp(-1, 1)
    torch.testing.assert_close(module.images(scaled), expected, rtol=0, atol=1e-5)


def test_activation_checkpointing_gives_the_denoiser_the_same_gradients_and_keeps_its_weights_names(vqgan_ckpt):
    plain, recomputing = tiny_ldm(vqgan_ckpt), tiny_ldm(vqgan_ckpt, activation_checkpointing=True)
    assert plain.state_dict().keys() == recomputing.state_dict().keys()
    for weight in plain.network.parameters():
        if not weight.any():  # MONAI zeroes the output convolution: gradients would not reach the blocks before it
            torch.nn.init.normal_(weight, std=0.1)
    recomputing.load_state_dict(plain.state_dict())
    calls = []
    recomputing.network.up_blocks[-1].resnets[-1].conv1.register_forward_hook(lambda *args: calls.append(1))
    x = phantoms(2)
    gradients = []
    for module in (plain, recomputing):
        module.set_scale_factor([{"image": x}])
        torch.manual_seed(3)
        loss = module.training_step({"image": x}, 0)
        gradients.append(torch.autograd.grad(loss, list(module.network.parameters())))
    assert calls == [1, 1]  # the block ran again in the backward pass
    for (name, _), a, b in zip(plain.network.named_parameters(), *gradients, strict=True):
        torch.testing.assert_close(b, a, msg=name)


def test_decoding_quantized_snaps_every_latent_vector_to_its_nearest_code(vqgan_ckpt):
    module = tiny_ldm(vqgan_ckpt)
    z = torch.randn(1, 4, 3, 3, 3)
    codes = module.first_stage.codebook.embeddings
    flat = z.movedim(1, -1).reshape(-1, 4)
    nearest = codes[torch.cdist(flat, codes).argmin(1)].view(1, 3, 3, 3, 4).movedim(-1, 1)
    torch.testing.assert_close(module.first_stage.snap(z), nearest, rtol=0, atol=0)
    torch.testing.assert_close(module.first_stage.decode(z, quantized=True), module.first_stage.decoder(nearest))


@pytest.mark.parametrize("codes", [2048, 16384])
def test_snapping_under_bf16_autocast_picks_the_nearest_codes_in_full_precision(codes):
    from scipy.spatial.distance import cdist

    torch.manual_seed(0)
    first_stage = FirstStage(1, 8, codes, 8, (4, 4, 4))
    z = torch.randn(1, 8, 12, 12, 12)
    embeddings = first_stage.codebook.embeddings.numpy().astype(np.float64)
    flat = z.movedim(1, -1).reshape(-1, 8).numpy().astype(np.float64)
    nearest = embeddings[cdist(flat, embeddings, "sqeuclidean").argmin(1)]
    # The CTPA preset samples under bf16 autocast: 3-5% of these vectors got another code in bf16.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        snapped = first_stage.snap(z)
    np.testing.assert_array_equal(snapped.movedim(1, -1).reshape(-1, 8).double().numpy(), nearest)


@pytest.mark.parametrize("elements", [1, 3000, 10**9])
def test_slab_decoding_equals_decoding_the_whole_volume(elements):
    torch.manual_seed(0)
    first_stage = FirstStage(1, 4, 16, 8, (4, 2, 4))
    z = torch.cat([first_stage.encode(phantoms(1, 24)), torch.randn(1, 4, 6, 12, 6)])
    whole = first_stage.decode(z, quantized=False)
    assert whole.shape == (2, 1, 24, 24, 24)
    for offload in (False, True):
        slabs = first_stage.decode(z, quantized=False, slab_elements=elements, offload=offload)
        torch.testing.assert_close(slabs, whole, rtol=0, atol=2e-5)


class Oracle(nn.Module):
    """The perfect denoiser of a one-volume training set: the noise that took `z0` to x_t."""

    def __init__(self, z0: torch.Tensor, alpha_bar) -> None:
        super().__init__()
        self.z0, self.alpha_bar = z0, alpha_bar

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ab = self.alpha_bar(t).view(-1, 1, 1, 1, 1)
        return (x_t - ab.sqrt() * self.z0) / (1 - ab).sqrt()


def test_a_perfect_denoiser_returns_the_training_latents_and_their_decoded_volume(vqgan_ckpt):
    module = tiny_ldm(vqgan_ckpt, ema_decay=None, decode_quantized=False)
    x = phantoms(1)
    module.set_scale_factor([{"image": x}])
    z0 = module.latents(x)
    module.network = Oracle(z0, module.schedule.alpha_bar)
    generated = module.sample(torch.randn_like(z0))
    torch.testing.assert_close(generated, z0, rtol=0, atol=1e-4)
    expected = module.first_stage.decoder(module.first_stage.encoder(x)).clamp(-1, 1)
    torch.testing.assert_close(module.images(generated), expected, rtol=0, atol=1e-4)


class VelocityOracle(Oracle):
    """The perfect v-denoiser of a one-volume training set: v = sqrt(a) eps - sqrt(1 - a) z0 for the noise that took
    `z0` to x_t (Salimans and Ho 2022), written out here."""

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ab = self.alpha_bar(t).view(-1, 1, 1, 1, 1)
        eps = (x_t - ab.sqrt() * self.z0) / (1 - ab).sqrt()
        return ab.sqrt() * eps - (1 - ab).sqrt() * self.z0


def test_a_perfect_v_denoiser_returns_the_training_latent_through_the_ten_step_set(vqgan_ckpt):
    # The presets' target (conf/model/ldm.yaml: v) over Fast-DDPM's 10-step non-uniform set.
    module = tiny_ldm(vqgan_ckpt, ema_decay=None, decode_quantized=False, prediction_type="v")
    assert module.sampling_timesteps.tolist() == [0, 199, 399, 599, 699, 799, 849, 899, 949, 999]
    x = phantoms(1)
    module.set_scale_factor([{"image": x}])
    z0 = module.latents(x)
    module.network = VelocityOracle(z0, module.schedule.alpha_bar)
    torch.manual_seed(3)
    generated = module.sample(torch.randn_like(z0))
    torch.testing.assert_close(generated, z0, rtol=0, atol=1e-4)


def test_a_condition_is_encoded_by_the_same_first_stage_and_concatenated_first(vqgan_ckpt):
    module = tiny_ldm(vqgan_ckpt, cond_channels=1)
    x = phantoms(2)
    module.set_scale_factor([{"image": x}])
    seen = {}

    def record(inputs: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        seen["inputs"] = inputs
        return inputs[:, 4:]

    cond = module.latent_condition({"cond": x})
    module.network_output(record, torch.zeros_like(cond), torch.zeros(2, dtype=torch.long), cond=cond)
    expected = module.first_stage.encoder(x) * float(module.scale_factor)
    torch.testing.assert_close(seen["inputs"][:, :4], expected, rtol=0, atol=0)


def test_validation_feeds_the_set_metrics_its_samples_against_the_real_volumes_and_the_training_set(vqgan_ckpt):
    module = tiny_ldm(vqgan_ckpt, ema_decay=None)
    torch.nn.init.normal_(module.network.out[-1].conv.weight, std=0.1)
    x, training = phantoms(3), torch.rand(4, 1, 16, 16, 16) * 2 - 1
    module.set_scale_factor([{"image": x}])
    for _ in module.recording_training_set([{"image": training}]):
        pass
    out = module.validation_step({"image": x, "subject": ["a", "b", "c"]}, 0)
    sample, real = (out["volumes"][k].flatten(1).double().numpy() for k in ("sample", "target"))
    paired = ("val/psnr", "val/ssim", "val/recon_psnr", "val/recon_ssim", "val/loss")
    metrics = {k: float(v.compute()) for k, v in module.val_metrics.items() if k not in paired}
    assert metrics["val/mmd"] == pytest.approx(gaussian_mmd_by_hand(real, sample), rel=1e-4)
    reconstruction = out["volumes"]["reconstruction"].flatten(1).double().numpy()
    assert metrics["val/recon_mmd"] == pytest.approx(gaussian_mmd_by_hand(real, reconstruction), rel=1e-4)
    correlations = np.corrcoef(np.concatenate([sample, real]), training.flatten(1).numpy())[:6, 6:].max(1)
    assert metrics["val/nearest_train_corr"] == pytest.approx(correlations[:3].mean(), rel=1e-5)
    assert metrics["val/real_nearest_train_corr"] == pytest.approx(correlations[3:].mean(), rel=1e-5)
    assert 0 < metrics["val/real_msssim"] < 1 and 0 < metrics["val/sample_msssim"] <= 1


# No attention level at all: a cross-attention token (the old spacing conditioning) could not reach this network.
ATTENTION_FREE = {"spatial_dims": 3, "channels": [8, 8], "attention_levels": [False, False], "num_res_blocks": 1,
                  "norm_num_groups": 4}


def spacing_module(vqgan_ckpt: Path) -> LatentDiffusion:
    torch.manual_seed(1)
    module = LatentDiffusion(partial(DiffusionModelUNet, **ATTENTION_FREE), first_stage_ckpt=str(vqgan_ckpt),
                             spacing_conditioning=True, ema_decay=None, ssim_kernel_size=3, prediction_type="sample")
    # MONAI zero-initialises the UNet's last layer: random weights make the output depend on its inputs.
    count = sum(p.numel() for p in module.network.parameters())
    nn.utils.vector_to_parameters(0.1 * torch.randn(count), module.network.parameters())
    module.scale_factor.fill_(1.0)
    return module


def test_the_spacing_embedding_is_added_to_the_time_embedding_of_every_block_as_maisi_does(vqgan_ckpt):
    module = spacing_module(vqgan_ckpt)
    affines = torch.eye(4).repeat(2, 1, 1)
    affines[1, :3, :3] = torch.diag(torch.tensor([0.7, 0.7, 2.5]))
    spacing = module.spacing({"affine": affines}, 2)
    np.testing.assert_allclose(spacing.numpy(), [[1.0, 1.0, 1.0], [0.7, 0.7, 2.5]], rtol=1e-6)
    # The same UNet without a class embedding, its time embedding shifted by MAISI's spacing module written out:
    # Linear(3, D), SiLU, Linear(D, D).
    assert isinstance(module.network.class_embedding, SpacingEmbedding)
    unconditioned = DiffusionModelUNet(in_channels=4, out_channels=4, **ATTENTION_FREE)
    with pytest.raises(TypeError, match="num_class_embeds"):
        with_spacing_embedding(unconditioned)
    weights = {k: v for k, v in module.network.state_dict().items() if not k.startswith("class_embedding.")}
    unconditioned.load_state_dict(weights)
    first, second = (layer for layer in module.network.class_embedding if isinstance(layer, nn.Linear))
    hidden = spacing.double().numpy() @ first.weight.double().detach().numpy().T + first.bias.double().detach().numpy()
    hidden = hidden / (1 + np.exp(-hidden))
    embedding = hidden @ second.weight.double().detach().numpy().T + second.bias.double().detach().numpy()
    unconditioned.time_embed.register_forward_hook(lambda _, __, out: out + torch.from_numpy(embedding).float())
    z, t = torch.randn(2, 4, 4, 4, 4), torch.tensor([5, 700])
    with torch.no_grad():
        torch.testing.assert_close(module.network_output(module.network, z, t, spacing=spacing), unconditioned(z, t))


def test_two_spacings_give_different_samples_from_the_same_noise(vqgan_ckpt):
    module = spacing_module(vqgan_ckpt)
    affines = torch.eye(4).repeat(2, 1, 1)
    affines[1, :3, :3] *= 2.0
    spacing = module.spacing({"affine": affines}, 2)
    z_T = torch.randn(1, 4, 4, 4, 4).repeat(2, 1, 1, 1, 1)
    sampled = module.sample(z_T, module.conditioning(None, spacing))
    assert (sampled[0] - sampled[1]).abs().mean() > 0.01 * sampled.abs().mean()
    again = module.sample(z_T, module.conditioning(None, spacing[:1].repeat(2, 1)))
    torch.testing.assert_close(again[0], again[1])


def test_a_first_stage_of_another_family_or_a_missing_one_is_refused_in_one_line(tmp_path, vqgan_ckpt):
    ddpm = ConditionalDiffusion(TINY_UNET, task="unconditional")
    other = save_checkpoint(ddpm, tmp_path / "ddpm.ckpt", "lightning_modules.diffusion.fast_ddpm.ConditionalDiffusion")
    for path, expected in [(other, "is a checkpoint of lightning_modules.diffusion.fast_ddpm.ConditionalDiffusion, not "
                            "of the VQ-GAN"), (tmp_path / "missing.ckpt", "no file at")]:
        cfg = compose_cfg(tmp_path / "run", ["model=ldm", f"model.first_stage_ckpt={path}", *TINY_MODEL["ldm"]])
        with pytest.raises(MedvolError, match=expected) as refused:
            check_config(cfg)
        assert "\n" not in str(refused.value)
    check_config(compose_cfg(tmp_path / "run",
                             ["model=ldm", f"model.first_stage_ckpt={vqgan_ckpt}", *TINY_MODEL["ldm"]]))


# ---- trained runs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ldm_run(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny VQ-GAN trained on CT phantoms, then an unconditional LDM on it with spacing conditioning."""
    base = tmp_path_factory.mktemp("ldm")
    common = ["dataset.image_modalities=[ct]", "logger=none", "callbacks.volume_slices=null"]
    vq_cfg = compose_cfg(base / "vqgan", ["model=vqgan", *common])
    saved_run(base / "vqgan", vq_cfg)
    first_stage = base / "vqgan" / "checkpoints" / "last.ckpt"
    ldm_cfg = compose_cfg(base / "ldm", [
        "model=ldm", f"model.first_stage_ckpt={first_stage}", *TINY_MODEL["ldm"], *common, "trainer.max_epochs=2",
        "model.spacing_conditioning=true", "optimized_metric=val/loss", "optimized_mode=min",
    ])
    return first_stage, saved_run(base / "ldm", ldm_cfg)


def test_training_leaves_the_first_stage_bit_identical_and_the_checkpoint_carries_it(ldm_run):
    first_stage, run_dir = ldm_run
    vqgan = torch.load(first_stage, weights_only=True)["state_dict"]
    ldm = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    carried = {k.removeprefix("first_stage."): v for k, v in ldm["state_dict"].items() if k.startswith("first_stage.")}
    assert carried and set(carried) == {k for k in vqgan if k.split(".")[0] in ("encoder", "codebook", "decoder")}
    for key, value in carried.items():
        assert torch.equal(value, vqgan[key]), key
    assert float(ldm["state_dict"]["scale_factor"]) > 0
    assert ldm["hyper_parameters"]["first_stage_settings"]["embedding_dim"] == 8


def test_predict_with_no_input_writes_n_samples_at_the_spacing_asked_in_hounsfield_units(ldm_run, tmp_path):
    first_stage, run_dir = ldm_run
    # The run moved: its first stage's file is gone, the LDM checkpoint carries it.
    moved = first_stage.with_suffix(".moved")
    first_stage.rename(moved)
    try:
        out = tmp_path / "out"
        predict(predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"output_dir={out}", "num_samples=2",
                            "spacing=[2.0,2.0,3.0]"))
    finally:
        moved.rename(first_stage)
    written = sorted(p.name for p in out.glob("*.nii.gz"))
    assert written == ["sample_0.nii.gz", "sample_1.nii.gz"] and (out / "predict.log").is_file()
    # Its progress: each draw's walk (every step of Fast-DDPM's ten, on the whole 4^3 latent), its decoding by slabs
    # (the decoder's parts), and at the end the peak memory.
    log = (out / "predict.log").read_text()
    assert log.count("sampling 4x4x4: step 1/10, the whole volume") == 2 and log.count("step 10/10") == 2
    assert log.count("decoding a 4x4x4 latent by depth slabs of 67108864 values, whole activations on cpu") == 2
    for part in ("conv_in from 4x4x4", "upsampling from 4x4x4", "upsampling from 8x8x8", "out from 16x16x16"):
        assert log.count(f"decoding: {part} in 1 slabs") == 2, part
    assert "peak host memory:" in log.splitlines()[-1]
    images = [nib.load(str(out / name)) for name in written]
    for image in images:
        assert image.shape == (16, 16, 16)
        assert np.allclose(np.diag(image.affine)[:3], [2.0, 2.0, 3.0]) and nib.aff2axcodes(image.affine) == ("R", "A",
                                                                                                             "S")
    first, second = (image.get_fdata() for image in images)
    # Each file is the model's own draw (the same seed: subject `sample`, draw k) mapped from [-1, 1] to the
    # phantoms' CT window [-1000, 1000] HU by hand.
    module = open_trained_run(str(run_dir / "checkpoints" / "last.ckpt")).module(torch.device("cpu"))
    for draw, written in enumerate((first, second)):
        batch = {"subject": ["sample"], "affine": torch.from_numpy(np.diag([2.0, 2.0, 3.0, 1.0]))[None]}
        model_units = module.generate_volumes(batch, draw)["volumes"]["sample"][0, 0].double().numpy()
        np.testing.assert_allclose(written, -1000.0 + (model_units + 1.0) * 1000.0, atol=0.05)
    assert not np.allclose(first, second)


def test_the_cpu_preset_trains_the_vqgan_then_the_ldm_on_its_best_checkpoint(tmp_path):
    tiny_stage2 = [f"cascade.stage2.{o}" for o in TINY_MODEL["ldm"]]
    cfg = compose_cfg(tmp_path, [
        "experiment=ldm_cpu", "logger=none", "callbacks.volume_slices=null", "cascade.stage1.trainer.max_epochs=2",
        "cascade.stage2.trainer.max_epochs=1", "test=false", *tiny_stage2,
    ])
    metrics = run(cfg)
    best = tmp_path / "stage1" / "best.ckpt"
    assert OmegaConf.load(tmp_path / "stage2" / "config.yaml").model.first_stage_ckpt == str(best)
    assert "stage1/val/psnr" in metrics and "stage2/val/recon_psnr" in metrics
    vqgan = torch.load(best, weights_only=True)["state_dict"]
    ldm = torch.load(tmp_path / "stage2" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    for key, value in ldm.items():
        if key.startswith("first_stage."):
            assert torch.equal(value, vqgan[key.removeprefix("first_stage.")]), key


@pytest.fixture(scope="module")
def conditional_run(ldm_run, tmp_path_factory) -> Path:
    """A tiny CT-from-T1 LDM on the `ldm_run` VQ-GAN: the T1 condition encoded by the same first stage."""
    first_stage, _ = ldm_run
    base = tmp_path_factory.mktemp("conditional")
    cfg = compose_cfg(base, [
        "model=ldm", f"model.first_stage_ckpt={first_stage}", *TINY_MODEL["ldm"], "model.cond_channels=1",
        "dataset.image_modalities=[ct]", "dataset.cond_modalities=[t1]", "logger=none", "callbacks.volume_slices=null",
        "optimized_metric=val/psnr",
    ])
    return saved_run(base, cfg)


def test_predict_from_condition_files_gives_n_samples_with_mean_and_spread_on_each_files_grid(conditional_run,
                                                                                              tmp_path):
    inputs = tmp_path / "t1"
    inputs.mkdir()
    shape = (20, 18, 16)
    affine = np.diag([1.5, 1.5, 2.0, 1.0])
    for i in range(2):
        nib.save(nib.Nifti1Image(make_phantom(3, i, shape).channels["t1"], affine), inputs / f"case{i}.nii.gz")
    out = tmp_path / "out"
    predict(predict_cfg(f"ckpt_path={conditional_run}/checkpoints/last.ckpt", f"input={inputs}", f"output_dir={out}",
                        "num_samples=2", "spacing=native"))
    names = ["sample_0", "sample_1", "sample_mean", "sample_std"]
    expected = [f"case{i}_{n}.nii.gz" for i in range(2) for n in names]
    assert sorted(p.name for p in out.iterdir()) == sorted([*expected, "predict.log", ".predicted"])
    written = {n: nib.load(str(out / f"case0_{n}.nii.gz")) for n in names}
    assert all(image.shape == shape and np.allclose(image.affine, affine) for image in written.values())
    draws = np.stack([written[n].get_fdata() for n in names[:2]])
    np.testing.assert_allclose(written["sample_mean"].get_fdata(), draws.mean(0), atol=1e-2)
    np.testing.assert_allclose(written["sample_std"].get_fdata(), draws.std(0, ddof=1), atol=1e-2)
    assert not np.allclose(draws[0], draws[1])


def test_a_resumed_ldm_run_ends_with_the_weights_of_an_uninterrupted_one(ldm_run, tmp_path):
    first_stage, _ = ldm_run
    common = ["model=ldm", f"model.first_stage_ckpt={first_stage}", *TINY_MODEL["ldm"], "dataset.image_modalities=[ct]",
              "logger=none", "callbacks.volume_slices=null", "optimized_metric=val/loss", "optimized_mode=min"]
    run(compose_cfg(tmp_path / "straight", [*common, "trainer.max_epochs=2"]))
    run(compose_cfg(tmp_path / "resumed", [*common, "trainer.max_epochs=1"]))
    run(compose_cfg(tmp_path / "resumed", [*common, "trainer.max_epochs=2",
                                           f"ckpt_path={tmp_path / 'resumed' / 'checkpoints' / 'last.ckpt'}"]))
    straight, resumed = (torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
                         for name in ("straight", "resumed"))
    assert straight.keys() == resumed.keys()
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key


@pytest.mark.slow
def test_two_gloo_ranks_give_the_metrics_and_scale_factor_of_one(vqgan_ckpt, tmp_path):
    # lr = 0 keeps the denoiser at its seeded start: the scale factor (summed over the ranks' shares of the
    # 8 training subjects) and the evaluation (per-subject noise, metrics synced over 4 validation subjects
    # split 2 + 2; the MMD over the gathered volumes) are compared.
    args = [*TINY_COMMON, *TINY_MODEL["ldm"], "model=ldm", f"model.first_stage_ckpt={vqgan_ckpt}",
            "dataset.num_subjects=12", "dataset.val_fraction=0.34", "dataset.test_fraction=0",
            "trainer.limit_train_batches=2", "model.optimizer.lr=0", "model.ema_decay=null", "logger=none",
            "callbacks.volume_slices=null", "optimized_metric=val/loss", "optimized_mode=min",
            "model.network._target_=tests.lightning_modules.diffusion.test_ddpm.unet_with_live_output",
            "+callbacks.rank_recorder._target_=tests.ddp_support.RankRecorder"]
    ranks, one = validation_on_two_ranks_and_one(args, tmp_path)
    for name in ("val/loss", "val/recon_psnr", "val/recon_ssim", "val/mmd", "val/recon_mmd", "val/diversity_msssim",
                 "val/sample_msssim", "val/real_msssim", "val/nearest_train_corr", "val/real_nearest_train_corr",
                 "val/closer_than_real"):
        assert ranks[0][name] == ranks[1][name], name
        assert ranks[0][name] == pytest.approx(one[name], rel=1e-4), name
    scales = [torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]["scale_factor"]
              for d in (tmp_path / "ddp", tmp_path / "single")]
    assert float(scales[0]) == pytest.approx(float(scales[1]), rel=1e-6)


def test_fid_is_the_frechet_distance_of_the_given_networks_features_and_absent_without_one(tmp_path, vqgan_ckpt,
                                                                                          sqrtm_without_disp):
    from scipy import linalg

    torch.manual_seed(0)
    network = torch.jit.script(nn.Sequential(nn.Conv3d(1, 3, 3), nn.AdaptiveAvgPool3d(1), nn.Flatten()))
    torch.jit.save(network, str(tmp_path / "features.pt"))
    module = tiny_ldm(vqgan_ckpt, fid_network=str(tmp_path / "features.pt"))
    assert "val/fid" not in tiny_ldm(vqgan_ckpt).val_metrics
    generated, real = torch.randn(8, 1, 8, 8, 8), 0.5 * torch.randn(8, 1, 8, 8, 8) + 0.3
    fid = module.val_metrics["val/fid"]
    for half in (slice(0, 4), slice(4, 8)):
        fid.update(generated[half], real[half])
    with torch.no_grad():
        a, b = (network(v).double().numpy() for v in (generated, real))
    covariance = linalg.sqrtm(np.cov(a, rowvar=False) @ np.cov(b, rowvar=False)).real
    trace = np.trace(np.cov(a, rowvar=False) + np.cov(b, rowvar=False) - 2 * covariance)
    expected = np.sum((a.mean(0) - b.mean(0)) ** 2) + trace
    assert float(fid.compute()) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(MedvolError, match="`model.fid_network`: no file at"):
        LatentDiffusion.check_settings({"first_stage_ckpt": str(vqgan_ckpt), "fid_network": str(tmp_path / "none.pt")})


def test_the_2p5d_fid_is_logged_per_plane_and_as_their_mean_at_the_epochs_end(tmp_path, vqgan_ckpt, sqrtm_without_disp):
    torch.jit.save(torch.jit.script(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh())), str(tmp_path / "net2d.pt"))
    module = tiny_ldm(vqgan_ckpt, ema_decay=None, fid_network_2d=str(tmp_path / "net2d.pt"))
    x = phantoms(3)
    module.set_scale_factor([{"image": x}])
    logged = {}
    module.log = lambda *args, **kwargs: None
    module.log_dict = lambda values, **kwargs: logged.update({k: float(v) for k, v in values.items()})
    module.validation_step({"image": x, "subject": ["a", "b", "c"]}, 0)
    expected = {k: float(v) for k, v in module.val_metrics["val/fid_2p5d"].compute().items()}
    module.on_validation_epoch_end()
    assert logged == pytest.approx({"val/fid_2p5d": expected["mean"], **{f"val/fid_2p5d_{p}": expected[p]
                                                                          for p in ("sagittal", "coronal", "axial")}})
    assert module.val_metrics["val/fid_2p5d"].update_count == 0
    with pytest.raises(MedvolError, match="`model.fid_network_2d`: no file at"):
        LatentDiffusion.check_settings({"fid_network_2d": str(tmp_path / "none.pt")})


def test_latents_are_cached_once_per_subject_and_another_first_stage_never_reuses_them(tmp_path, vqgan_ckpt):
    torch.manual_seed(5)
    retrained = save_checkpoint(VQGAN(**TINY_VQGAN), tmp_path / "retrained.ckpt", VQGAN_CLASS)
    cache = tmp_path / "cache"

    def first_item(ckpt: Path) -> tuple[dict, LatentDiffusion]:
        cfg = compose_cfg(tmp_path / "run", ["model=ldm", f"model.first_stage_ckpt={ckpt}", *TINY_MODEL["ldm"],
                                             "dataset.cache=disk", f"dataset.cache_dir={cache}"])
        module, datamodule = build_model(cfg.model), build(cfg.dataset)
        datamodule.add_cached_transform(*module.cached_transform())
        datamodule.setup("fit")
        return datamodule.datasets["train"][0], module

    item, module = first_item(vqgan_ckpt)
    torch.testing.assert_close(item["latent"], module.first_stage.encoder(item["image"][None].float())[0])
    folders = sorted(p.name for p in cache.iterdir())
    first_item(vqgan_ckpt)
    assert sorted(p.name for p in cache.iterdir()) == folders
    other, other_module = first_item(retrained)
    assert len(list(cache.iterdir())) == len(folders) + 1
    torch.testing.assert_close(other["latent"], other_module.first_stage.encoder(other["image"][None].float())[0])
    assert not torch.allclose(other["latent"], item["latent"])


def test_a_shape_check_on_the_meta_device_builds_the_first_stage_without_copying_or_warning(vqgan_ckpt):
    # Resuming an LDM run builds the module on the meta device to compare its shapes with the checkpoint; its
    # constructor loads the first stage, which on meta used to print a "no-op" warning for each of its tensors.
    with warnings.catch_warnings(record=True) as caught, torch.device("meta"):
        warnings.simplefilter("always")
        module = tiny_ldm(vqgan_ckpt)
    assert not [w for w in caught if "meta parameter" in str(w.message)]
    assert all(p.is_meta for p in module.first_stage.parameters())
    # Built for real, the first stage holds the VQ-GAN's weights.
    vqgan = torch.load(vqgan_ckpt, weights_only=True)["state_dict"]
    real = tiny_ldm(vqgan_ckpt).first_stage.state_dict()
    assert real and all(torch.equal(value, vqgan[key]) for key, value in real.items())
