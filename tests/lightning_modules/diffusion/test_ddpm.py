"""model=ddpm end to end: training draws from the set, EMA drives evaluation and survives resume,
test-time samples are NIfTI files, bad input gets one clear line, 2 ranks validate as one."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from monai.networks.nets import DiffusionModelUNet

from datamodules.sources.phantom import phantom_affine
from lightning_modules.diffusion.fast_ddpm import ConditionalDiffusion
from lightning_modules.diffusion.samplers import sample_ddim
from lightning_modules.diffusion.subject_noise import SubjectNoise
from medvol.core.build import build, build_model
from medvol.core.errors import MedvolError
from medvol.run.training import run
from tests.conftest import TINY_COMMON, TINY_MODEL, compose_cfg
from tests.ddp_support import validation_on_two_ranks_and_one
from tests.lightning_modules.diffusion.test_windowed_sampling import ConvDenoiser, _fast_ddpm

TINY_DDPM = ["model=ddpm", "logger=csv"]


def unet_with_live_output(**kwargs) -> DiffusionModelUNet:
    """MONAI's UNet with its zero-initialised output convolution given random weights, so that an
    untrained network's samples depend on their noise."""
    network = DiffusionModelUNet(**kwargs)
    torch.nn.init.normal_(network.out[-1].conv.weight, std=0.1)
    return network


def synthetic_batch(module, size: int = 16, batch: int = 2) -> dict:
    torch.manual_seed(0)
    return {
        "image": torch.rand(batch, module.image_channels, size, size, size) * 2 - 1,
        "cond": torch.rand(batch, module.cond_channels, size, size, size) * 2 - 1,
        "subject": [f"sub-{i}" for i in range(batch)],
    }


@pytest.fixture
def module(tmp_path):
    return build_model(compose_cfg(tmp_path, TINY_DDPM).model)


def test_translation_on_synthetic_pairs_t1_to_t2_and_concatenates_the_condition_first(tmp_path, module):
    cfg = compose_cfg(tmp_path, TINY_DDPM)
    assert (list(cfg.dataset.image_modalities), list(cfg.dataset.cond_modalities)) == (["t2"], ["t1"])
    batch = synthetic_batch(module)
    seen = []
    module.network.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    module.diffusion_loss(module.network, batch["image"], batch["cond"], torch.tensor([0, 0]),
                          torch.zeros_like(batch["image"]))
    assert torch.allclose(seen[0][:, :1], batch["cond"])
    assert torch.allclose(seen[0][:, 1:],
                          module.schedule.add_noise(batch["image"], torch.zeros_like(batch["image"]),
                                                    torch.tensor([0, 0])))


def test_training_draws_only_from_the_set_in_antithetic_pairs(module):
    steps: list[torch.Tensor] = []
    module.network.register_forward_pre_hook(lambda _, args: steps.append(args[1].clone()))
    batch = synthetic_batch(module, batch=4)
    torch.manual_seed(1)
    for _ in range(12):
        module.training_step(batch, 0)
    allowed = set(module.train_timesteps.tolist())
    assert allowed == {0, 199, 399, 599, 699, 799, 849, 899, 949, 999}
    drawn = torch.stack(steps)
    assert set(drawn.flatten().tolist()) <= allowed
    assert len(set(drawn.flatten().tolist())) == 10
    index = {t: i for i, t in enumerate(module.train_timesteps.tolist())}
    pairs = [(index[int(a)] + index[int(b)]) for a, b in zip(drawn[:, 0], drawn[:, 2], strict=True)]
    assert set(pairs) == {9}


def test_validation_and_sampling_use_the_ema_weights(module):
    batch = synthetic_batch(module)
    # Both copies perturbed (differently), so that neither's output is the zero-initialised constant and a
    # sample depends on its starting noise.
    with torch.no_grad():
        for p in [*module.network.parameters(), *module.ema.module.parameters()]:
            p.add_(torch.randn_like(p) * 0.1)
    module.log = lambda *args, **kwargs: None
    sample = module.validation_step(batch, 0)["volumes"]["sample"]
    generators = module.subject_generators(batch, 0)
    module.condition(batch, generators)
    noise = module.noise_like(batch["image"], generators)
    with torch.no_grad():
        ema = sample_ddim(module.denoiser(module.ema.module, batch["cond"]), noise, module.schedule,
                          module.sampling_timesteps)
        raw = sample_ddim(module.denoiser(module.network, batch["cond"]), noise, module.schedule,
                          module.sampling_timesteps)
        other = sample_ddim(module.denoiser(module.ema.module, batch["cond"]), torch.randn_like(noise), module.schedule,
                            module.sampling_timesteps)
    assert torch.allclose(sample, ema.clamp(-1, 1), atol=1e-6)
    assert not torch.allclose(sample, raw.clamp(-1, 1), atol=1e-3)
    # The starting noise matters: another draw gives another sample.
    assert not torch.allclose(sample, other.clamp(-1, 1), atol=1e-3)
    # The same subject gets the same sample in another batch position (what makes ranks agree).
    swapped = {k: v.flip(0) if torch.is_tensor(v) else list(reversed(v)) for k, v in batch.items()}
    assert torch.allclose(module.validation_step(swapped, 5)["volumes"]["sample"].flip(0), sample, atol=1e-6)


@pytest.mark.slow
def test_ema_and_weights_survive_resume_exactly(tmp_path):
    common = [*TINY_DDPM, "seed=3", "trainer.deterministic=true", "dataset.num_subjects=6",
              "model.sampling_timesteps=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(compose_cfg(straight, [*common, "trainer.max_epochs=2"]))
    run(compose_cfg(resumed, [*common, "trainer.max_epochs=1"]))
    run(compose_cfg(resumed, [*common, "trainer.max_epochs=2", f"ckpt_path={resumed}/checkpoints/last.ckpt"]))
    a = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    b = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    ema_keys = [k for k in a if k.startswith("ema.")]
    # 2 epochs x 2 batches (4 training subjects, batch 2): one EMA update per optimizer step.
    assert "ema.updates" in ema_keys and int(a["ema.updates"]) == 4
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # The EMA is not the trained weights (it averaged them).
    assert not torch.equal(a["ema.module.conv_in.conv.weight"], a["network.conv_in.conv.weight"])


@pytest.mark.slow
def test_test_time_samples_are_nifti_on_the_subject_grid_with_overridable_sampler(tmp_path):
    common = [*TINY_DDPM, "dataset.num_subjects=6"]
    train_dir = tmp_path / "train"
    run(compose_cfg(train_dir, [*common, "trainer.max_epochs=1"]))
    ckpt = train_dir / "checkpoints" / "last.ckpt"
    test_dir = tmp_path / "test"
    metrics = run(compose_cfg(test_dir, [*common, "train=false", "test=true", f"ckpt_path={ckpt}"]))
    assert {"test/psnr", "test/ssim"} <= set(metrics)
    # A test-only run keeps any training record: its summary is summary-test-<stamp>.json.
    (summary,) = test_dir.glob("summary-test-*.json")
    assert "test/psnr" in summary.read_text()
    (subject,) = json.loads((test_dir / "split.json").read_text())["test"]
    written = nib.load(test_dir / "predictions" / f"{subject}_sample.nii.gz")
    assert written.shape == (16, 16, 16)
    np.testing.assert_allclose(written.affine, phantom_affine((16, 16, 16), 6.0))
    assert (test_dir / "predictions" / f"{subject}_condition.nii.gz").is_file()
    # Fewer DDIM steps at test time: another sample from the same checkpoint.
    fewer = tmp_path / "fewer"
    run(compose_cfg(fewer, [*common, "train=false", "test=true", f"ckpt_path={ckpt}", "model.sampling_timesteps=2"]))
    other = nib.load(fewer / "predictions" / f"{subject}_sample.nii.gz")
    assert not np.allclose(other.get_fdata(), written.get_fdata())


def test_translation_without_a_condition_is_one_clear_line(tmp_path):
    with pytest.raises(MedvolError) as err:
        run(compose_cfg(tmp_path, [*TINY_DDPM, "dataset.cond_modalities=[]", "trainer.fast_dev_run=true"]))
    message = str(err.value)
    assert "`model.task`=translation" in message and "dataset.cond_modalities" in message and "\n" not in message
    # Denoising and super-resolution make their condition from the image when the dataset has none.
    for task in ("denoising", "super_resolution"):
        metrics = run(compose_cfg(tmp_path / task, [*TINY_DDPM, f"model.task={task}", "trainer.fast_dev_run=true"]))
        assert "val/psnr" in metrics


def _image_batch(size: int = 8) -> dict:
    torch.manual_seed(0)
    return {"image": torch.rand(2, 1, size, size, size) * 2 - 1, "cond": torch.rand(2, 1, size, size, size) * 2 - 1,
            "subject": ["sub-a", "sub-b"]}


def test_denoising_and_super_resolution_conditions_are_the_image_degraded_by_hand():
    batch = _image_batch()
    del batch["cond"]  # a dataset without a condition: it is made from the image
    image = batch["image"]
    denoising = ConditionalDiffusion(partial(ConvDenoiser), task="denoising", noise_std=0.3, timesteps=2, sample_seed=4)
    denoising.log = lambda *args, **kwargs: None
    condition = denoising.validation_step(batch, 0)["volumes"]["condition"]
    # The image plus noise_std times the first draw of each subject's own sampling stream.
    expected = image + 0.3 * SubjectNoise(batch["subject"], seed=4, salt="sample").draw((1, 8, 8, 8))
    torch.testing.assert_close(condition, expected, rtol=0, atol=1e-6)

    resolution = ConditionalDiffusion(partial(ConvDenoiser), task="super_resolution", downsample_factor=2, timesteps=2)
    # Means of 2 x 2 x 2 blocks, trilinearly resampled back onto the image grid.
    blocks = image.reshape(2, 1, 4, 2, 4, 2, 4, 2).mean(dim=(3, 5, 7))
    expected = F.interpolate(blocks, size=(8, 8, 8), mode="trilinear", align_corners=False)
    torch.testing.assert_close(resolution.condition(batch), expected, rtol=0, atol=1e-6)


def test_validation_psnr_is_that_of_the_sample_against_the_target_by_hand():
    module = _fast_ddpm(timesteps=2)
    with torch.no_grad():
        module.ema.module.conv.weight.mul_(5)
    module.log = lambda *args, **kwargs: None
    volumes = module.validation_step(_image_batch(), 0)["volumes"]
    sample, target = volumes["sample"], volumes["target"]
    assert sample.abs().max() <= 1 and not torch.allclose(sample, volumes["condition"], atol=0.1)
    # PSNR with a data range of 2 ([-1, 1]), per sample, averaged over the batch.
    psnr = [10 * np.log10(4.0 / float(((sample[b] - target[b]) ** 2).mean())) for b in range(2)]
    assert float(module.val_metrics["val/psnr"].compute()) == pytest.approx(np.mean(psnr), rel=1e-5)


def test_bad_timestep_set_in_config_is_one_clear_line(tmp_path):
    with pytest.raises(MedvolError, match=r"`model.timesteps` is not sorted: \[999, 0\]"):
        run(compose_cfg(tmp_path, [*TINY_DDPM, "model.timesteps=[999,0]", "trainer.fast_dev_run=true"]))
    with pytest.raises(MedvolError, match="`model.sampling_timesteps` repeats"):
        run(compose_cfg(tmp_path, [*TINY_DDPM, "model.sampling_timesteps=[5,5]", "trainer.fast_dev_run=true"]))


@pytest.mark.slow
def test_checkpoint_with_other_channel_counts_is_refused(tmp_path):
    run(compose_cfg(tmp_path / "a", [*TINY_DDPM, "dataset.num_subjects=6", "trainer.max_epochs=1"]))
    ckpt = tmp_path / "a" / "checkpoints" / "last.ckpt"
    with pytest.raises(MedvolError, match=r"network.conv_in.conv.weight of shape \(8, 2, 3, 3, 3\).*\(8, 3, 3, 3, 3\)"):
        run(compose_cfg(tmp_path / "b", [*TINY_DDPM, "dataset.cond_modalities=[t1,flair]", "train=false", "test=true",
                                          f"ckpt_path={ckpt}"]))


def test_bf16_mixed_training_step_keeps_fp32_tables(tmp_path):
    metrics = run(compose_cfg(tmp_path, [*TINY_DDPM, "trainer.precision=bf16-mixed", "trainer.fast_dev_run=true"]))
    assert all(np.isfinite(v) for v in metrics.values())
    module = build_model(compose_cfg(tmp_path, TINY_DDPM).model).to(torch.bfloat16)
    assert module.schedule.alphas_cumprod.dtype == torch.float32


@pytest.mark.slow
def test_two_gloo_ranks_validate_like_one(tmp_path: Path):
    # lr = 0 keeps the weights at their (seeded) start, so only evaluation is compared: per-subject
    # noise and metrics synced over 3 validation subjects split 2 + 1.
    args = [*TINY_COMMON, *TINY_MODEL["ddpm"], *TINY_DDPM, "dataset.num_subjects=12", "dataset.val_fraction=0.25",
            "dataset.test_fraction=0", "trainer.limit_train_batches=2", "model.optimizer.lr=0", "model.ema_decay=null",
            "model.network._target_=tests.lightning_modules.diffusion.test_ddpm.unet_with_live_output",
            "+callbacks.rank_recorder._target_=tests.ddp_support.RankRecorder"]
    ranks, one = validation_on_two_ranks_and_one(args, tmp_path)
    for name in ("val/psnr", "val/ssim", "val/loss"):
        assert ranks[0][name] == ranks[1][name], name
        assert ranks[0][name] == pytest.approx(one[name], rel=1e-4), name


@pytest.mark.slow
def test_short_overfit_on_synthetic_translation_beats_the_identity_baseline(tmp_path):
    from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

    overrides = [*TINY_DDPM, "dataset.num_subjects=12", "trainer.max_epochs=12", "trainer.check_val_every_n_epoch=12",
                 "model.network.channels=[16,32]", "model.network.attention_levels=[false,false]"]
    cfg = compose_cfg(tmp_path, overrides)
    metrics = run(cfg)
    datamodule = build(cfg.dataset)
    datamodule.setup("fit")
    psnr = PeakSignalNoiseRatio(data_range=2.0, reduction="elementwise_mean", dim=(1, 2, 3, 4))
    ssim = StructuralSimilarityIndexMeasure(data_range=2.0, kernel_size=5)
    for batch in datamodule.val_dataloader():
        psnr.update(batch["cond"], batch["image"])
        ssim.update(batch["cond"], batch["image"])
    identity_psnr, identity_ssim = float(psnr.compute()), float(ssim.compute())
    assert metrics["val/psnr"] > identity_psnr + 2.0, (metrics, identity_psnr)
    assert metrics["val/ssim"] > identity_ssim, (metrics, identity_ssim)
