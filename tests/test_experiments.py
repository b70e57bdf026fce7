"""Every experiment file composes, says only what differs, and trains on a tiny stand-in of its data."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
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



@pytest.mark.parametrize("hardware", ["gpu", "a100x4", "h200x4", "multinode", "cpu"])
def test_gpu_hardware_lets_cudnn_time_its_kernels_for_the_fixed_training_size(tmp_path, hardware):
    cfg = compose_cfg(tmp_path, [f"hardware={hardware}"], tiny=False)
    assert cfg.trainer.benchmark is (hardware != "cpu")

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


# ---- every preset on a file dataset a user names (issue 38 item 3) --------------------------------------------------

TINY_VQGAN_MODEL = [o for o in TINY_MODEL["vqgan"] if o != "model.ssim_kernel_size=5"]
TINY_RUN = ["hardware=cpu", "strategy=auto", "logger=none", "callbacks.volume_slices=null",
            "callbacks.progress_bar=null", "callbacks.model_summary=null", "dataset.num_workers=0"]
TINY_LDM_STAGE = [f"cascade.stage2.{o}" for o in TINY_MODEL["ldm"]]


def ct_files(root, spacings: list[float], shape=(40, 40, 36)):
    """CT phantoms as `<root>/case<i>.nii.gz`, each at its own isotropic spacing (HU, RAS)."""
    root.mkdir(parents=True)
    for i, spacing in enumerate(spacings):
        image = nib.Nifti1Image(make_phantom(0, i, shape).channels["ct"], phantom_affine(shape, spacing))
        nib.save(image, root / f"case{i}.nii.gz")
    return root


def test_the_ldm_pipeline_preset_takes_a_users_brats_folder_as_the_issue_typed_it(tmp_path):
    from datamodules.sources.example_data import write_brats

    # On its phantoms the preset keeps their size and count (conf/experiment_data/ldm_cpu_synthetic.yaml).
    phantoms = compose_cfg(tmp_path / "phantoms", ["experiment=ldm_cpu"], tiny=False)
    assert (phantoms.dataset.size, phantoms.dataset.num_subjects) == (32, 24)
    root = write_brats(tmp_path / "brats", subjects=4, year=2021, size=20)
    cfg = compose_cfg(tmp_path / "run", [
        "experiment=ldm_cpu", "dataset=brats", f"dataset.root={root}", "dataset.image_modalities=[t1]",
        "dataset.label=false", *TINY_RUN, *TINY_VQGAN_MODEL, *TINY_LDM_STAGE, "test=false", "dataset.batch_size=2",
        "dataset.transforms.spacing=[1.25,1.25,1.25]", "dataset.transforms.spatial_size=[16,16,16]",
        "dataset.val_fraction=0.25", "dataset.test_fraction=0", "cascade.stage1.trainer.max_epochs=1",
        "cascade.stage2.trainer.max_epochs=1",
    ], tiny=False)
    # The phantoms' count and size (experiment_data/ldm_cpu_synthetic.yaml) stay with the phantoms.
    assert "size" not in cfg.dataset and "num_subjects" not in cfg.dataset
    metrics = run(cfg)
    assert "stage1/val/psnr" in metrics and "stage2/val/mmd" in metrics


def test_a_dataset_key_the_dataset_does_not_take_is_one_line_naming_it(tmp_path):
    from medvol.core.errors import MedvolError
    from medvol.run.training import check_config

    cfg = compose_cfg(tmp_path, ["dataset=brats", "dataset.root=/data", "+dataset.size=32"], tiny=False)
    with pytest.raises(MedvolError, match=r"`dataset.size`: BratsDataModule .* takes no such setting") as refused:
        check_config(cfg)
    assert "\n" not in str(refused.value)
    check_config(compose_cfg(tmp_path, ["dataset=brats", "dataset.root=/data"], tiny=False))


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "dataset").glob("*.yaml")))
def test_every_dataset_file_sets_only_keys_its_dataset_takes(tmp_path, name):
    from medvol.core.build import target_class
    from medvol.run.run_check import constructor_settings

    cfg = compose_cfg(tmp_path, [f"dataset={name}"], tiny=False)
    accepted = constructor_settings(target_class(cfg.dataset._target_))
    assert accepted is not None and set(cfg.dataset) - {"_target_"} <= accepted


def test_ctpa_ldm_trains_on_scans_at_their_own_spacing_and_samples_from_noise_at_the_median(tmp_path):

    from medvol.run.predicting import predict
    from tests.medvol.run.test_predict import predict_cfg, saved_run

    spacings = [3.0, 4.0, 5.0, 3.5, 4.5]
    data = ct_files(tmp_path / "ctpa", spacings)
    run_dir = tmp_path / "run"
    cfg = compose_cfg(run_dir, [
        "experiment=ctpa_ldm", f"dataset.root={data}", "dataset.pattern='{subject}.nii.gz'", *TINY_RUN,
        *TINY_VQGAN_MODEL, *TINY_LDM_STAGE, "test=false", "dataset.patch_size=[16,16,16]",
        "dataset.stride=[16,16,16]", "dataset.patches_per_volume=2", "dataset.val_fraction=0.2",
        "dataset.test_fraction=0", "cascade.stage2.dataset.patch_size=[16,16,16]",
        "cascade.stage2.dataset.stride=[16,16,16]", "cascade.stage2.model.sampling_window=[4,4,4]",
        "cascade.stage2.model.network.num_res_blocks=1", "trainer.max_epochs=1",
        "cascade.stage2.trainer.max_epochs=1", "trainer.limit_train_batches=2",
    ], tiny=False)
    saved_run(run_dir, cfg)
    # Training kept each scan's spacing: predict's documented command samples at the training scans' median.
    train = json.loads((run_dir / "split.json").read_text())["train"]
    median = float(np.median([spacings[int(s.removeprefix("case"))] for s in train]))
    out = tmp_path / "samples"
    predict(predict_cfg(f"ckpt_path={run_dir}/stage2/best.ckpt", "num_samples=1", f"output_dir={out}",
                        "+model.sample_size=[16,16,16]"))
    sample = nib.load(str(out / "sample_0.nii.gz"))
    assert sample.shape == (16, 16, 16)
    np.testing.assert_allclose(sample.header.get_zooms()[:3], [median] * 3, rtol=1e-6)
    stage2 = OmegaConf.load(run_dir / "stage2" / "config.yaml").model
    assert stage2.spacing_conditioning and stage2.position_channels and stage2.activation_checkpointing


@pytest.mark.slow
def test_the_xray2ct_cascade_preset_takes_ct_files(tmp_path):
    from datamodules.sources.example_data import write_xray_ct

    data = write_xray_ct(tmp_path / "xr", 6, size=32)
    cfg = compose_cfg(tmp_path / "run", [
        "experiment=xray2ct_cascade", "dataset=xray_ct", f"dataset.root={data}",
        "dataset.pattern='{subject}_{modality}.nii.gz'", *TINY_RUN, *TINY_MODEL["xray2ct"], "cascade.stages=[1,2]",
        "test=false", "dataset.val_fraction=0.25", "dataset.test_fraction=0", "cascade.stage1.dataset.batch_size=2",
        "cascade.stage1.trainer.max_epochs=1", "cascade.stage2.trainer.max_epochs=1",
    ], tiny=False)
    assert "ct_window" not in cfg.dataset
    metrics = run(cfg)
    assert "stage2/val/psnr" in metrics


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["xray_ct", "synthetic"])
def test_the_a100_xray2ct_preset_runs_its_first_stage_on_ct_files_and_on_the_phantoms(tmp_path, dataset):
    from datamodules.sources.example_data import write_xray_ct

    if dataset == "xray_ct":
        data = [f"dataset.root={write_xray_ct(tmp_path / 'xr', 4, size=32)}",
                "dataset.pattern='{subject}_{modality}.nii.gz'",
                "cascade.stage1.dataset.transforms.spatial_size=[16,16,16]"]
    else:
        data = ["dataset=synthetic", "dataset.num_subjects=4", "cascade.stage1.dataset.size=16"]
    cfg = compose_cfg(tmp_path / "run", [
        "experiment=xray2ct_a100x4", *data, *TINY_RUN, *TINY_MODEL["xray2ct"], "cascade.stages=[1]", "test=false",
        "dataset.val_fraction=0.25", "dataset.test_fraction=0", "cascade.stage1.dataset.batch_size=2",
        "cascade.stage1.trainer.max_epochs=1", "trainer.precision=32", "model.num_head_channels=8",
        "model.norm_num_groups=8",
    ], tiny=False)
    assert run(cfg)["stage1/val/psnr"] > 0


FILE_PRESETS = {
    "mace_survival": ["model.backbone=resnet10", "model.widen_factor=0.125", "model.compile=false",
                      "dataset.transforms.spatial_size=[16,16,16]", "dataset.batch_size=4", "trainer.precision=32"],
    "mace_survival_cpu": ["model.widen_factor=0.125", "dataset.transforms.spatial_size=[16,16,16]",
                          "dataset.batch_size=4"],
    "survival_synthetic": ["dataset.image_modalities=[image]", "dataset.transforms.spatial_size=[16,16,16]",
                           "dataset.batch_size=4"],
    "prs_segmentation": ["dataset.label_file='{subject}/label.nii.gz'", "dataset.image_modalities=[ct]",
                         "dataset.transforms.spatial_size=[16,16,16]", "dataset.batch_size=2",
                         *[o for o in TINY_MODEL["segmentation"]]],
}


@pytest.mark.parametrize("name", sorted(FILE_PRESETS))
def test_a_preset_trains_one_batch_on_a_file_dataset(tmp_path, name):
    from datamodules.sources.example_data import write_mace_csv, write_nifti_folder

    if name == "prs_segmentation":
        data = ["dataset=nifti", f"dataset.root={write_nifti_folder(tmp_path / 'ct', 4, size=20)}"]
    else:
        csv = write_mace_csv(tmp_path / "mace", 8, size=20)
        data = ["dataset=csv" if name == "survival_synthetic" else "dataset.num_workers=0", f"dataset.csv_path={csv}"]
    cfg = compose_cfg(tmp_path / "run", [f"experiment={name}", *data, *TINY_RUN, "trainer.fast_dev_run=true",
                                         "dataset.val_fraction=0.25", "dataset.test_fraction=0", "test=false",
                                         *FILE_PRESETS[name]], tiny=False)
    metrics = run(cfg)
    assert any(k.startswith("val/") for k in metrics)
