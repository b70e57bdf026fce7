"""The MONAI bundle export.py writes: predict.py's outputs from MONAI alone, metadata the specification accepts.

The reference is predict.py itself, run on the same scans. Masks are judged structure by structure
(`benchmarks/export/export.py`'s `structure_agreement`): the model predicts every structure, each structure's Dice
between the two masks is at least 0.99, the label values agree on at least 99.9% of the union of their foreground, and
both hold the same label values; reconstructions agree within 1e-3 of their range. The fast tests run the bundle in this
process through MONAI's own `ConfigWorkflow` (what `python -m monai.bundle run` builds); the slow ones run `python -m
monai.bundle run` in an interpreter that can import only torch, monai, fire and the packages the bundle's metadata.json
declares (`declared_site`), on phantoms and on real anatomy (the MNI152 brain with a lesion, four
channels, scans at twice the plan's resolution, small structures).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.bundle import ConfigWorkflow
from monai.bundle.utils import DEFAULT_METADATA
from omegaconf import OmegaConf

from benchmarks.export.export import (
    SMALL_REGIONS,
    declared_site,
    real_scans,
    run_bundle,
    structure_agreement,
    with_small_regions,
    written_structures,
)
from lightning_modules.base import MODEL_KEY
from medvol.core.build import build_model
from medvol.core.errors import MedvolError
from medvol.run.bundle import METADATA_KEYS, PACKAGES_KEY, TENSOR_KEYS, metadata_problem
from medvol.run.exporting import export
from medvol.run.predicting import predict
from medvol.run.training import run
from tests.conftest import ROOT, TINY, TINY_COMMON, TINY_MODEL, compose_cfg
from tests.lightning_modules.ldm.test_ldm import save_checkpoint
from tests.medvol.run.test_predict import predict_cfg, write_lps_scans
from tests.medvol.volumes.test_source_grid import write_brats_lps

# The keys MONAI's bundle specification makes mandatory in metadata.json (MONAI's own default metadata, less the
# changelog), and in each tensor of network_data_format (docs/source/mb_specification.rst, written out from it).
SPEC_KEYS = set(DEFAULT_METADATA) - {"changelog"}
SPEC_TENSOR_KEYS = {"type", "format", "modality", "num_channels", "spatial_shape", "dtype", "value_range",
                    "is_patch_data", "channel_def"}
# Probes an interpreter's `sys.path`: which of these can it import?
PROBE = """
import importlib.util, sys
sys.path.append(sys.argv[1])
print(" ".join(m for m in sys.argv[2:] if importlib.util.find_spec(m)))
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
    # Keep the largest component of label 1 (TC outside ET), which the perturbed model scatters in pieces: the step
    # changes the masks (without it in the bundle, the mutation bundle-no-postprocessing, the test fails).
    # Recorded as chosen on cross-validation folds, so that it applies by default (a single split's would not).
    (run_dir / "postprocessing.json").write_text(
        json.dumps({"steps": [{"name": "label 1", "values": [1]}], "folds": 5})
    )
    scans = base / "scans"
    scans.mkdir()
    for path in sorted(root.glob("*/*_flair.nii.gz"))[:2]:
        shutil.copy(path, scans / path.name)
    # Output biases that make every region cover part of the first scan (a seeded perturbation alone leaves a
    # structure out as soon as the network's parameters change, e.g. PlainConvUNet's upsampling biases).
    ckpt = perturbed(run_dir / "checkpoints" / "last.ckpt", 3.0)
    return with_small_regions(ckpt, sorted(scans.glob("*.nii.gz"))[:1], {"WT": 0.3, "TC": 0.15, "ET": 0.05}), scans


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
    return perturbed(run_dir / "checkpoints" / "last.ckpt", 0.2), scans_of(data, base / "scans")


@pytest.fixture(scope="module")
def phantom_vqgan_run(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny VQ-GAN trained on the synthetic phantoms (their 2 mm grid, no `dataset.transforms`), and two int16
    LPS scans of another spacing to reconstruct: predict.py resamples them to the phantoms' grid and writes the
    reconstruction back in the scans' units."""
    base = tmp_path_factory.mktemp("bundle-phantom-vqgan")
    run_dir = saved_run(base / "run", [*TINY, "dataset.spacing=2.0", "logger=none", "callbacks.volume_slices=null",
                                        "dataset.num_workers=0"])
    return perturbed(run_dir / "checkpoints" / "last.ckpt", 0.2), scans_of(write_lps_scans(base / "data", 2),
                                                                           base / "scans")


def scans_of(data: Path, scans: Path) -> Path:
    scans.mkdir()
    for i, path in enumerate(sorted(data.glob("*/image.nii.gz"))[:2]):
        shutil.copy(path, scans / f"scan{i}.nii.gz")
    return scans


@pytest.fixture(scope="module")
def segmentation_bundle(segmentation_run, tmp_path_factory) -> Path:
    return exported(segmentation_run[0], tmp_path_factory.mktemp("exported") / "bundle")


def exported(ckpt: Path, folder: Path, *overrides: str) -> Path:
    cfg = OmegaConf.create({"ckpt_path": str(ckpt), "format": "bundle", "output_dir": str(folder), "opset": 17,
                            "tta": None, "authors": "medvol tests", "copyright": "none", "model": {}})
    export(OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides))))
    return folder


def predicted(ckpt: Path, scans: Path, out: Path, *overrides: str) -> Path:
    predict(predict_cfg(f"ckpt_path={ckpt}", f"input={scans}", f"output_dir={out}", *overrides))
    return out


@contextmanager
def gradients_kept() -> Iterator[None]:
    """Gradient mode as it was once the block ends: a bundle's `initialize` turns gradients off for its whole
    process, which `python -m monai.bundle run` has to itself, and this test process does not."""
    grad = torch.is_grad_enabled()
    try:
        yield
    finally:
        torch.set_grad_enabled(grad)


def run_in_process(bundle: Path, scans: Path, out: Path) -> Path:
    """The bundle's inference.json through MONAI's ConfigWorkflow, as `python -m monai.bundle run` runs it."""
    workflow = ConfigWorkflow(
        config_file=str(bundle / "configs" / "inference.json"), meta_file=str(bundle / "configs" / "metadata.json"),
        workflow_type="infer", bundle_root=str(bundle), dataset_dir=str(scans), output_dir=str(out),
    )
    with gradients_kept():
        workflow.initialize()
        workflow.run()
        workflow.finalize()
        # The bundle turns gradients back on when it is done: a user's notebook is left as PyTorch starts.
        assert torch.is_grad_enabled()
    return out


def run_declared(bundle: Path, scans: Path, out: Path) -> Path:
    """`python -m monai.bundle run` where only torch, monai, fire and the bundle's declared packages import."""
    result = run_bundle(bundle, scans, out, out.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def same_masks(reference: Path, other: Path, bundle: Path) -> dict:
    """Per scan and structure the two masks compared (`structure_agreement`); asserts that they agree and that the
    model predicted every structure on some scan."""
    found = structure_agreement(reference, other, written_structures(bundle))
    assert found
    for scan, row in found.items():
        assert row["values"]["predict"] == row["values"]["bundle"], (scan, row)
        assert row["agree"] >= 0.999, (scan, row)
        assert all(s["dice"] >= 0.99 for s in row["structures"].values() if s["predict"] + s["bundle"]), (scan, row)
    predicted_somewhere = {name for row in found.values() for name, s in row["structures"].items() if s["predict"]}
    assert predicted_somewhere == set(written_structures(bundle)), found
    return found


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
    reference = predicted(ckpt, scans, tmp_path / "predict")
    out = run_in_process(segmentation_bundle, scans, tmp_path / "bundle-out")
    found = same_masks(reference, out, segmentation_bundle)
    # The perturbed model scatters its regions: this is no blob that any pipeline would find.
    assert all(row["union"] > 100 for row in found.values())


def test_bundle_and_predict_write_the_label_values_of_the_training_files(segmentation_run, segmentation_bundle,
                                                                        tmp_path):
    """BraTS 2021 stores the enhancing tumour as 4: predict.py writes 4 for a split of the run's dataset and for
    input files alike, and so does the bundle; the metadata names the written values."""
    ckpt, scans = segmentation_run
    split = tmp_path / "split"
    predict(predict_cfg(f"ckpt_path={ckpt}", "split=test", f"output_dir={split}"))
    files = predicted(ckpt, scans, tmp_path / "files")
    bundled = run_in_process(segmentation_bundle, scans, tmp_path / "bundle-out")
    for folder in (split, files, bundled):
        values = {int(v) for path in folder.glob("*_seg.nii.gz") for v in np.unique(nib.load(str(path)).dataobj)}
        assert 4 in values and values <= {0, 1, 2, 4}, (folder.name, values)
    metadata = json.loads((segmentation_bundle / "configs" / "metadata.json").read_text())
    assert metadata["medvol"]["output_file"]["labels"] == {"WT": [1, 2, 4], "TC": [1, 4], "ET": [4]}


def test_a_segmentation_bundle_without_mirroring_follows_the_command(segmentation_run, tmp_path):
    ckpt, scans = segmentation_run
    bundle = exported(ckpt, tmp_path / "bundle", "tta=false")
    reference = predicted(ckpt, scans, tmp_path / "predict", "tta=false")
    same_masks(reference, run_in_process(bundle, scans, tmp_path / "out"), bundle)


def test_a_vqgan_bundle_writes_predict_pys_reconstructions_in_the_scans_units(vqgan_run, tmp_path):
    ckpt, scans = vqgan_run
    bundle = exported(ckpt, tmp_path / "bundle")
    reference = predicted(ckpt, scans, tmp_path / "predict")
    assert nib.load(str(next(reference.glob("*.nii.gz")))).get_fdata().max() > 100  # the scans' units, not [-1, 1]
    assert max(image_differences(reference, run_in_process(bundle, scans, tmp_path / "bundle-out"))) <= 1e-3


def test_a_vqgan_trained_on_phantoms_resamples_to_their_grid_and_returns_to_the_scans_units(phantom_vqgan_run,
                                                                                          tmp_path):
    """A run without `dataset.transforms`: predict.py reads files with the defaults, at the training grid's spacing
    (2 mm, the checkpoint's record) and writes in the scan's units; the bundle does the same."""
    ckpt, scans = phantom_vqgan_run
    bundle = exported(ckpt, tmp_path / "bundle")
    metadata = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert metadata["network_data_format"]["inputs"]["image"]["spacing_mm"] == [2.0, 2.0, 2.0]
    reference = predicted(ckpt, scans, tmp_path / "predict")
    assert nib.load(str(next(reference.glob("*.nii.gz")))).get_fdata().max() > 100
    assert max(image_differences(reference, run_in_process(bundle, scans, tmp_path / "bundle-out"))) <= 1e-3


def probe(site: Path, modules: list[str], cwd: Path) -> set[str]:
    result = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE, str(site), *modules], cwd=cwd,
                            capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_the_declared_interpreter_imports_torch_monai_fire_and_the_declared_packages_alone(tmp_path):
    """The interpreter the slow tests run bundles in: from the repository's own folder, only what is declared."""
    modules = ["torch", "monai", "fire", "numpy", "nibabel", "scipy", "skimage", "nilearn", "medvol",
               "lightning_modules", "datamodules", "onnx"]
    assert probe(declared_site(["nibabel"], tmp_path / "plain"), modules, ROOT) == {
        "torch", "monai", "fire", "numpy", "nibabel"}
    assert probe(declared_site(["nibabel", "scipy"], tmp_path / "scipy"), modules, ROOT) == {
        "torch", "monai", "fire", "numpy", "nibabel", "scipy"}
    # This interpreter, started as the tests start it, would find them all: the probe can see them.
    assert {"scipy", "skimage", "medvol"} <= set(subprocess.run(
        [sys.executable, "-c", PROBE, "/nonexistent", *modules], cwd=ROOT, capture_output=True, text=True,
        timeout=120).stdout.split())


@pytest.mark.slow
def test_the_bundles_run_with_only_their_declared_packages_and_give_predict_pys_outputs(
        segmentation_run, vqgan_run, phantom_vqgan_run, tmp_path):
    for ckpt, scans in (segmentation_run, vqgan_run, phantom_vqgan_run):
        name = ckpt.parents[2].name
        bundle = exported(ckpt, tmp_path / f"{name}-bundle")
        reference = predicted(ckpt, scans, tmp_path / f"{name}-predict")
        out = run_declared(bundle, scans, tmp_path / f"{name}-out")
        if ckpt is segmentation_run[0]:
            same_masks(reference, out, bundle)
        else:
            assert max(image_differences(reference, out)) <= 1e-3


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A BraTS-regions model planned at 8 mm on four real-anatomy brains (the MNI152 brain with a lesion, four MR
    channels), its output biases set so that WT, TC and ET cover 3%, 1% and 0.4% of a brain, its post-processing
    keeping the largest component of ET; two unseen brains at 4 mm as nnU-Net channel files (predict.py) and as 4D
    files (the bundle)."""
    pytest.importorskip("nilearn", reason="the real-anatomy brains need nilearn's MNI152 templates (dev extra)")
    from datamodules.sources.brain_lesions import write_brain_lesions

    base = tmp_path_factory.mktemp("bundle-real")
    root = write_brain_lesions(base / "train", 4, (8.0, 8.0, 8.0))
    tiny = [o for o in TINY_COMMON if not o.startswith("dataset.")]
    run_dir = saved_run(base / "run", [
        *tiny, "model=segmentation", "dataset=brats", "dataset.label_regions=[WT,TC,ET]", f"dataset.root={root}",
        "model.plan.features=[4,8,16]", "model.plan.iterations_per_epoch=2", "dataset.val_fraction=0.25",
        "dataset.test_fraction=0.25", "dataset.num_workers=0", "logger=none", "callbacks.volume_slices=null",
    ])
    # ET's largest component alone: the regions stay scattered in hundreds of voxels, ET is cut to one piece.
    # Recorded as chosen on cross-validation folds, so that it applies by default (a single split's would not).
    (run_dir / "postprocessing.json").write_text(json.dumps({"steps": [{"name": "ET", "values": [3]}], "folds": 5}))
    source = write_brain_lesions(base / "scans-brats", 2, (4.0, 4.0, 4.0), seed=7)
    real_scans(source, base / "channels", base / "scans", ["t1", "t1ce", "t2", "flair"])
    first = sorted((base / "channels").glob("*.nii.gz"))[:4]
    ckpt = with_small_regions(run_dir / "checkpoints" / "last.ckpt", first, SMALL_REGIONS)
    return ckpt, base / "channels", base / "scans"


@pytest.mark.slow
def test_on_real_anatomy_the_bundle_with_its_declared_packages_gives_predict_pys_masks(real_run, tmp_path):
    ckpt, channels, scans = real_run
    bundle = exported(ckpt, tmp_path / "bundle")
    assert json.loads((bundle / "configs" / "metadata.json").read_text())["network_data_format"]["inputs"][
        "image"]["spacing_mm"] == [8.0, 8.0, 8.0]
    reference = predicted(ckpt, channels, tmp_path / "predict")
    found = same_masks(reference, run_declared(bundle, scans, tmp_path / "out"), bundle)
    # predict.py read nnU-Net channel files, so it wrote nnU-Net's `<case>.nii.gz`.
    voxels = int(np.prod(nib.load(str(next(reference.glob("*.nii.gz")))).shape))
    for row in found.values():
        # Small structures: the tumour a few percent of the scan at most, ET written as BraTS 2021's 4.
        assert row["union"] < 0.05 * voxels and 4 in row["values"]["predict"], row


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
    with gradients_kept():
        workflow.initialize()
    assert workflow.check_properties() == []
    assert metadata_problem({k: v for k, v in metadata.items() if k != "copyright"}) == "missing copyright"
    readme = (bundle / "README.md").read_text()
    assert "python -m monai.bundle run --config_file configs/inference.json" in readme
    assert torch.jit.load(str(bundle / "models" / "model.ts")) is not None


def install_line(text: str) -> set[str]:
    """The packages of the first `pip install monai ...` command in `text`."""
    line = re.search(r"pip install (monai[^`#\n]*)", text)
    assert line, text
    return set(line.group(1).split())


def test_the_declared_packages_are_what_the_bundle_imports_with_their_versions_and_the_docs_install_them(
        segmentation_bundle, vqgan_run, tmp_path):
    """A segmentation bundle imports nibabel (NIfTI in and out) and scipy (spline resampling, the filled non-zero
    mask, the largest component); a VQ-GAN's nibabel alone. The README and docs/export.md install exactly those."""
    declared = json.loads((segmentation_bundle / "configs" / "metadata.json").read_text())[PACKAGES_KEY]
    assert declared == {name: importlib.metadata.version(name) for name in ("nibabel", "scipy")}
    inference = (segmentation_bundle / "configs" / "inference.json").read_text()
    assert "$import scipy.ndimage as ndimage" in inference and "KeepLargestConnectedComponent" not in inference
    vqgan = exported(vqgan_run[0], tmp_path / "vqgan")
    assert json.loads((vqgan / "configs" / "metadata.json").read_text())[PACKAGES_KEY] == {
        "nibabel": importlib.metadata.version("nibabel")}
    expected = {"monai", *declared, "fire"}
    assert install_line((segmentation_bundle / "README.md").read_text()) == expected
    assert install_line((ROOT / "docs" / "export.md").read_text()) == expected


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
