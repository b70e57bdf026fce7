"""The MONAI bundle export.py writes: predict.py's outputs from MONAI alone, metadata the specification accepts.

The reference is predict.py itself, run on the same scans: masks must agree on at least 99.9% of the voxels and
reconstructions within 1e-3 of their range. The fast tests run the bundle in this process through MONAI's own
`ConfigWorkflow` (what `python -m monai.bundle run` builds); the slow ones run `python -m monai.bundle run` in a
subprocess whose `sys.path` cannot import medvol (no `.pth` file of the venv is read, so the editable install's
finder is never installed; the subprocess checks it before it runs).
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.bundle import ConfigWorkflow
from omegaconf import OmegaConf

from lightning_modules.base import MODEL_KEY
from medvol.core.build import build_model
from medvol.core.errors import MedvolError
from medvol.run.bundle import METADATA_KEYS, TENSOR_KEYS, metadata_problem
from medvol.run.exporting import export
from medvol.run.predicting import predict
from medvol.run.training import run
from tests.conftest import TINY_COMMON, TINY_MODEL, compose_cfg
from tests.lightning_modules.ldm.test_ldm import save_checkpoint
from tests.medvol.run.test_predict import predict_cfg, write_lps_scans
from tests.medvol.volumes.test_source_grid import write_brats_lps

# The keys MONAI's bundle specification (docs/source/mb_specification.rst, "metadata.json File") makes mandatory,
# written out from the specification: the reference the exporter's own list is checked against.
SPEC_KEYS = {"version", "monai_version", "pytorch_version", "numpy_version", "optional_packages_version", "task",
             "description", "authors", "copyright", "network_data_format"}
SPEC_TENSOR_KEYS = {"type", "format", "modality", "num_channels", "spatial_shape", "dtype", "value_range",
                    "is_patch_data", "channel_def"}
# Runs `python -m monai.bundle` after checking that nothing of the repository can be imported.
ISOLATED = """
import importlib.util, runpy, sys
sys.path.append(sys.argv[1])
found = [m for m in ("medvol", "lightning_modules", "datamodules", "callbacks") if importlib.util.find_spec(m)]
if found:
    sys.exit(f"importable here: {found}")
sys.argv = ["monai.bundle", *sys.argv[2:]]
runpy.run_module("monai.bundle", run_name="__main__", alter_sys=True)
"""


def saved_run(run_dir: Path, overrides: list[str]) -> Path:
    cfg = compose_cfg(run_dir, overrides, tiny=False)
    run(cfg)
    (run_dir / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save({k: v for k, v in cfg.items() if k != "hydra"}, run_dir / ".hydra" / "config.yaml")
    return run_dir


def perturbed(ckpt: Path, scale: float) -> Path:
    """A copy of `ckpt` beside it with seeded noise on every floating weight: after one epoch a tiny network gives
    nearly one answer everywhere, which would let a wrong window, mirroring or resampling pass unseen."""
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    generator = torch.Generator().manual_seed(0)
    for name, value in checkpoint["state_dict"].items():
        if value.is_floating_point() and "scale_factor" not in name:
            value.add_(torch.randn(value.shape, generator=generator) * scale * (float(value.std()) if
                                                                                 value.numel() > 1 else 1.0))
    path = ckpt.with_name(f"perturbed-{ckpt.name}")
    torch.save(checkpoint, path)
    return path


@pytest.fixture(scope="module")
def segmentation_run(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny BraTS-region model (one MR channel, the plan's 1.5 mm spacing, z-score, foreground crop, mirroring),
    its weights perturbed, post-processing keeping label 1's largest component; the scans it predicts."""
    base = tmp_path_factory.mktemp("bundle-seg")
    root = write_brats_lps(base / "brats", subjects=4)
    tiny = [o for o in [*TINY_COMMON, *TINY_MODEL["segmentation"]] if not o.startswith("dataset.")]
    run_dir = saved_run(base / "run", [
        *tiny, "experiment=brats_segmentation", f"dataset.root={root}", "dataset.image_modalities=[flair]",
        "model.plan.patch_size=[16,16,16]", "model.plan.features=[4,8,16]", "dataset.transforms.spacing=[1.5,1.5,1.5]",
        "dataset.val_fraction=0.25", "dataset.test_fraction=0.25", "dataset.batch_size=1", "dataset.num_workers=0",
        "logger=none", "callbacks.volume_slices=null",
    ])
    # Keep the largest component of label 1 (TC outside ET), which the perturbed model scatters in some 50 pieces:
    # that step changes about 4% of the voxels (ET's or all foreground's would change none, one blob each).
    # Recorded as chosen on cross-validation folds, so that it applies by default (a single split's would not).
    (run_dir / "postprocessing.json").write_text(
        json.dumps({"steps": [{"name": "label 1", "values": [1]}], "folds": 5})
    )
    scans = base / "scans"
    scans.mkdir()
    for path in sorted(root.glob("*/*_flair.nii.gz"))[:2]:
        shutil.copy(path, scans / path.name)
    return perturbed(run_dir / "checkpoints" / "last.ckpt", 3.0), scans


@pytest.fixture(scope="module")
def vqgan_run(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny VQ-GAN on int16 LPS scans (percentile scaling to [-1, 1]), and two scans to reconstruct."""
    base = tmp_path_factory.mktemp("bundle-vqgan")
    data = write_lps_scans(base / "data", 4)
    common = [o for o in TINY_COMMON if not o.startswith("dataset.")]
    run_dir = saved_run(base / "run", [
        *common, *TINY_MODEL["vqgan"], "dataset=nifti", f"dataset.root={data}",
        "dataset.transforms.spatial_size=[16,16,16]", "dataset.batch_size=2", "dataset.num_workers=0",
        "logger=none", "callbacks.volume_slices=null",
    ])
    scans = base / "scans"
    scans.mkdir()
    for i, path in enumerate(sorted(data.glob("*/image.nii.gz"))[:2]):
        shutil.copy(path, scans / f"scan{i}.nii.gz")
    return perturbed(run_dir / "checkpoints" / "last.ckpt", 0.2), scans


@pytest.fixture(scope="module")
def segmentation_bundle(segmentation_run, tmp_path_factory) -> Path:
    return exported(segmentation_run[0], tmp_path_factory.mktemp("exported") / "bundle")


def exported(ckpt: Path, folder: Path, *overrides: str) -> Path:
    cfg = OmegaConf.create({"ckpt_path": str(ckpt), "format": "bundle", "output_dir": str(folder), "opset": 17,
                            "tta": None, "authors": "medvol tests", "copyright": "none", "model": {}})
    export(OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides))))
    return folder


def predicted(ckpt: Path, scans: Path, out: Path) -> Path:
    predict(predict_cfg(f"ckpt_path={ckpt}", f"input={scans}", f"output_dir={out}"))
    return out


def run_in_process(bundle: Path, scans: Path, out: Path) -> Path:
    """The bundle's inference.json through MONAI's ConfigWorkflow, as `python -m monai.bundle run` runs it."""
    workflow = ConfigWorkflow(
        config_file=str(bundle / "configs" / "inference.json"), meta_file=str(bundle / "configs" / "metadata.json"),
        workflow_type="infer", bundle_root=str(bundle), dataset_dir=str(scans), output_dir=str(out),
    )
    workflow.initialize()
    workflow.run()
    workflow.finalize()
    return out


def run_isolated(bundle: Path, scans: Path, out: Path, cwd: Path) -> Path:
    """`python -m monai.bundle run` in a subprocess that cannot import medvol, from a folder outside the repository,
    with no PYTHONPATH: the venv's site-packages on `sys.path` without its `.pth` files (`-S`)."""
    packages = next(p for p in site.getsitepackages() if (Path(p) / "monai").is_dir())
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(cwd)}
    result = subprocess.run(
        [sys.executable, "-S", "-c", ISOLATED, packages, "run", "--config_file",
         str(bundle / "configs" / "inference.json"), "--bundle_root", str(bundle), "--dataset_dir", str(scans),
         "--output_dir", str(out)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def mask_agreement(reference: Path, other: Path) -> list[float]:
    shares = []
    for path in sorted(reference.glob("*_seg.nii.gz")):
        ours, theirs = nib.load(str(path)), nib.load(str(other / path.name))
        assert theirs.shape == ours.shape and np.allclose(theirs.affine, ours.affine)
        expected, got = np.asarray(ours.dataobj), np.asarray(theirs.dataobj)
        # The model is no constant: no one label value covers nine tenths of the scan.
        assert np.unique(expected, return_counts=True)[1].max() < 0.9 * expected.size
        shares.append(float((expected == got).mean()))
    assert shares
    return shares


def image_differences(reference: Path, other: Path) -> list[float]:
    """Per reconstruction the largest |difference| over the reference's value range."""
    differences = []
    for path in sorted(reference.glob("*_reconstruction.nii.gz")):
        ours, theirs = nib.load(str(path)), nib.load(str(other / path.name))
        assert theirs.shape == ours.shape and np.allclose(theirs.affine, ours.affine)
        expected, got = ours.get_fdata(), theirs.get_fdata()
        differences.append(float(np.abs(expected - got).max() / (expected.max() - expected.min())))
    assert differences
    return differences


def test_a_segmentation_bundle_writes_predict_pys_masks(segmentation_run, segmentation_bundle, tmp_path):
    ckpt, scans = segmentation_run
    bundle = segmentation_bundle
    reference = predicted(ckpt, scans, tmp_path / "predict")
    shares = mask_agreement(reference, run_in_process(bundle, scans, tmp_path / "bundle-out"))
    assert min(shares) >= 0.999, shares


def test_a_segmentation_bundle_without_mirroring_follows_the_command(segmentation_run, tmp_path):
    ckpt, scans = segmentation_run
    bundle = exported(ckpt, tmp_path / "bundle", "tta=false")
    reference = tmp_path / "predict"
    predict(predict_cfg(f"ckpt_path={ckpt}", f"input={scans}", f"output_dir={reference}", "tta=false"))
    assert min(mask_agreement(reference, run_in_process(bundle, scans, tmp_path / "out"))) >= 0.999


def test_a_vqgan_bundle_writes_predict_pys_reconstructions_in_the_scans_units(vqgan_run, tmp_path):
    ckpt, scans = vqgan_run
    bundle = exported(ckpt, tmp_path / "bundle")
    reference = predicted(ckpt, scans, tmp_path / "predict")
    assert nib.load(str(next(reference.glob("*.nii.gz")))).get_fdata().max() > 100  # the scans' units, not [-1, 1]
    assert max(image_differences(reference, run_in_process(bundle, scans, tmp_path / "bundle-out"))) <= 1e-3


@pytest.mark.slow
def test_the_bundles_run_without_medvol_importable_and_give_predict_pys_outputs(segmentation_run, vqgan_run,
                                                                              tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for (ckpt, scans), compare in ((segmentation_run, mask_agreement), (vqgan_run, image_differences)):
        name = ckpt.parents[2].name
        bundle = exported(ckpt, tmp_path / f"{name}-bundle")
        reference = predicted(ckpt, scans, tmp_path / f"{name}-predict")
        values = compare(reference, run_isolated(bundle, scans, tmp_path / f"{name}-out", outside))
        assert min(values) >= 0.999 if compare is mask_agreement else max(values) <= 1e-3


def test_the_isolated_interpreter_finds_monai_and_not_medvol(tmp_path):
    packages = next(p for p in site.getsitepackages() if (Path(p) / "monai").is_dir())
    probe = ISOLATED.split("sys.argv = ")[0] + "print(bool(importlib.util.find_spec('monai')))\n"
    result = subprocess.run([sys.executable, "-S", "-c", probe, packages], cwd=tmp_path, capture_output=True,
                            text=True, env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr
    # The same interpreter as the tests start it finds medvol (the editable install's finder): the check sees it.
    plain = subprocess.run([sys.executable, "-c", "import importlib.util; print(bool(importlib.util.find_spec("
                            "'medvol')))"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env={"PATH": "/usr/bin:/bin"})
    assert plain.stdout.strip() == "True"


def test_metadata_has_every_key_the_specification_makes_mandatory_and_monai_accepts_it(segmentation_bundle):
    bundle = segmentation_bundle
    metadata = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert SPEC_KEYS <= set(metadata) and set(METADATA_KEYS) == SPEC_KEYS and set(TENSOR_KEYS) == SPEC_TENSOR_KEYS
    for side in ("inputs", "outputs"):
        for tensor in metadata["network_data_format"][side].values():
            assert SPEC_TENSOR_KEYS <= set(tensor)
    image, pred = metadata["network_data_format"]["inputs"]["image"], metadata["network_data_format"]["outputs"]["pred"]
    assert image["num_channels"] == 1 and image["spacing_mm"] == [1.5, 1.5, 1.5] and image["spatial_shape"] == [16] * 3
    assert pred["format"] == "classes" and pred["num_channels"] == 3 and metadata["medvol"]["labels"] == ["WT", "TC",
                                                                                                          "ET"]
    assert metadata["medvol"]["plan"]["spacing"] == [1.5, 1.5, 1.5] and metadata["authors"] == "medvol tests"
    # MONAI's own list of a bundle's required meta properties, and of an inference workflow's ids it can check.
    workflow = ConfigWorkflow(config_file=str(bundle / "configs" / "inference.json"),
                              meta_file=str(bundle / "configs" / "metadata.json"), workflow_type=None)
    workflow.initialize()
    assert workflow.check_properties() == []
    assert metadata_problem({k: v for k, v in metadata.items() if k != "copyright"}) == "missing copyright"
    readme = (bundle / "README.md").read_text()
    assert "python -m monai.bundle run --config_file configs/inference.json" in readme
    assert torch.jit.load(str(bundle / "models" / "model.ts")) is not None


def test_a_diffusion_model_is_refused_as_a_bundle_in_one_line_and_leaves_nothing(tmp_path):
    cfg = compose_cfg(tmp_path / "run", ["model=ddpm", *TINY_MODEL["ddpm"]])
    for folder in (".hydra", "checkpoints"):
        (tmp_path / "run" / folder).mkdir(parents=True)
    OmegaConf.save({k: v for k, v in cfg.items() if k != "hydra"}, tmp_path / "run" / ".hydra" / "config.yaml")
    module = build_model(cfg.model)
    ckpt = save_checkpoint(module, tmp_path / "run" / "checkpoints" / "last.ckpt",
                           "lightning_modules.diffusion.fast_ddpm.ConditionalDiffusion")
    assert torch.load(ckpt, weights_only=True)[MODEL_KEY].endswith("ConditionalDiffusion")
    with pytest.raises(MedvolError, match=r"`format=bundle`: a ConditionalDiffusion cannot be exported as a MONAI "
                                          r"bundle: its outputs come from a sampler loop"):
        exported(ckpt, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists() and not list(tmp_path.glob(".bundle.partial-*"))
