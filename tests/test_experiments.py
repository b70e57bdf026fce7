"""Every experiment file composes, says only what differs, and trains on a tiny stand-in of its data."""

from __future__ import annotations

import nibabel as nib
import pytest
from omegaconf import OmegaConf

from datamodules.sources.phantom import make_phantom, phantom_affine
from medvol.run.training import run
from tests.conftest import CONF_DIR, TINY_MODEL, compose_cfg

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
# A file-based diffusion experiment on CPU: 16^3 crops, one batch, a tiny UNet.
TINY_FILES_DDPM = [
    "hardware=cpu", "callbacks.progress_bar=null", "callbacks.model_summary=null", "trainer.fast_dev_run=true",
    "dataset.transforms.spatial_size=[16,16,16]", "dataset.val_fraction=0.25", "dataset.test_fraction=0",
    *TINY_MODEL["ddpm"],
]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes(tmp_path, name):
    cfg = compose_cfg(tmp_path, [f"experiment={name}"], tiny=False)
    assert cfg.task_name == name


def test_ctpa_vqgan_has_the_seed_values_and_trains_on_ct_patches(tmp_path):
    cfg = compose_cfg(tmp_path, ["experiment=ctpa_vqgan"], tiny=False)
    assert (cfg.model.n_codes, cfg.model.embedding_dim, list(cfg.model.downsample)) == (16384, 8, [4, 4, 4])
    assert (cfg.model.video_gan_weight, cfg.model.disc_channels, cfg.trainer.devices) == (0.5, 64, 4)
    assert list(cfg.dataset.patch_size) == [128, 128, 128] and cfg.strategy.find_unused_parameters

    data = tmp_path / "ctpa"
    data.mkdir()
    shape = (40, 40, 36)
    for i in range(4):
        image = nib.Nifti1Image(make_phantom(0, i, shape).channels["ct"], phantom_affine(shape, 4.0))
        nib.save(image, data / f"case{i}.nii.gz")
    cfg = compose_cfg(
        tmp_path / "run",
        [
            "experiment=ctpa_vqgan",
            f"dataset.root={data}",
            "dataset.pattern='{subject}.nii.gz'",
            "hardware=cpu",
            "strategy=auto",
            "trainer.fast_dev_run=true",
            "dataset.patch_size=[32,32,32]",
            "dataset.stride=[16,16,16]",
            "dataset.patches_per_volume=2",
            "dataset.val_fraction=0.25",
            "dataset.test_fraction=0",
            "model.n_codes=32",
            "model.n_hiddens=8",
            "model.disc_channels=8",
            "model.disc_layers=2",
            "callbacks.progress_bar=null",
        ],
        tiny=False,
    )
    metrics = run(cfg)
    assert "val/psnr" in metrics and "train/loss_step" in metrics


def test_fast_ddpm_brats_has_the_seed_values_and_trains_on_a_brats_folder(tmp_path):
    from datamodules.sources.example_data import write_brats

    cfg = compose_cfg(tmp_path, ["experiment=fast_ddpm_brats", "dataset.root=/data"], tiny=False)
    assert (cfg.dataset.batch_size, cfg.trainer.accumulate_grad_batches, cfg.trainer.sync_batchnorm) == (1, 4, True)
    assert (list(cfg.dataset.image_modalities), list(cfg.dataset.cond_modalities)) == (["t2"], ["t1"])
    assert (cfg.model.timesteps, cfg.model.timestep_spacing, cfg.model.prediction_type) == (10, "non_uniform",
                                                                                            "epsilon")
    assert list(cfg.dataset.transforms.spatial_size) == [128, 128, 128] and cfg.model.activation_checkpointing

    data = write_brats(tmp_path / "brats", subjects=4, year=2023, size=20)
    metrics = run(compose_cfg(tmp_path / "run",
                              ["experiment=fast_ddpm_brats", f"dataset.root={data}", *TINY_FILES_DDPM], tiny=False))
    assert {"val/psnr", "val/ssim", "train/loss"} <= set(metrics)


def test_fast_ddpm_ct_denoising_trains_on_a_ct_folder(tmp_path):
    from datamodules.sources.example_data import write_nifti_folder

    data = write_nifti_folder(tmp_path / "ct", subjects=4, size=20, modalities=("ct",), label=False)
    metrics = run(
        compose_cfg(tmp_path / "run", ["experiment=fast_ddpm_ct_denoising", f"dataset.root={data}", *TINY_FILES_DDPM],
                    tiny=False)
    )
    assert "val/psnr" in metrics


MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


@pytest.mark.parametrize("name", MODELS)
def test_a_model_file_touches_only_model_and_the_root_reads_its_monitor(tmp_path, name):
    text = (CONF_DIR / "model" / f"{name}.yaml").read_text()
    assert "@package" not in text, f"conf/model/{name}.yaml sets keys outside `model`"
    plain = compose_cfg(tmp_path, [], tiny=False)
    cfg = compose_cfg(tmp_path, [f"model={name}"], tiny=False)
    # Every root key and every dataset key but those that follow the model is what it is without the model.
    follow = ("hydra", "model", "optimized_metric", "optimized_mode", "fallback_metric", "fallback_mode", "dataset")

    def rest(c):
        raw = OmegaConf.to_container(c, resolve=False)  # interpolations as written: the monitor's path, not value
        return {k: v for k, v in raw.items() if k not in follow}, {k: v for k,
                                                                   v in raw["dataset"].items() if k != "stratify_by"}

    assert rest(cfg) == rest(plain)
    assert (cfg.optimized_metric, cfg.optimized_mode) == (cfg.model.monitor, cfg.model.monitor_mode)
    assert cfg.callbacks.model_checkpoint.monitor == cfg.model.monitor


def test_the_classifier_ranks_by_auroc_with_the_loss_as_fallback_and_stratifies_by_class(tmp_path):
    cfg = compose_cfg(tmp_path, ["model=classifier"], tiny=False)
    assert (cfg.optimized_metric, cfg.fallback_metric, cfg.fallback_mode) == ("val/auroc", "val/loss", "min")
    assert cfg.dataset.stratify_by == "class_label"
    assert compose_cfg(tmp_path, ["model=survival"], tiny=False).dataset.stratify_by is None
