"""Every experiment file composes, says only what differs, and trains on a tiny stand-in of its data."""

from __future__ import annotations

import nibabel as nib
import pytest

from datamodules.sources.phantom import make_phantom, phantom_affine
from medvol.training import run
from tests.conftest import CONF_DIR, compose_cfg

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


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
