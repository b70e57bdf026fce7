"""Every size a file can set is held against the memory budget before anything is allocated (issue 46): files built
as an attacker would send them (a scan, a checkpoint, a run folder), run through the real entry points with a small
`MEDVOL_VOLUME_BUDGET_GIB` and the address space capped (`tests/memory_limit.py`), so that a reader which still
allocated what a file asks for fails with a MemoryError instead of refusing in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import torch

from datamodules.sources.nifti import NiftiDataModule
from lightning_modules.base import MODEL_KEY
from lightning_modules.ldm.first_stage import PIECES, VQGAN_CLASS
from lightning_modules.vqgan.vqgan import VQGAN
from lightning_modules.xray2ct.earlier_stages import read_stage
from medvol.core.errors import MedvolError, refusal_within
from medvol.run.data_check import main as check_data
from medvol.run.predicting import predict
from medvol.run.trained_run import open_trained_run
from medvol.run.training import check_config, run
from medvol.volumes.dicom_io import Slice, series_geometry, stored_pixels
from medvol.volumes.dicom_radiograph import read_radiograph
from medvol.volumes.dicom_read import read_dicom
from medvol.volumes.volume_budget import BUDGET_ENV
from tests.conftest import ROOT, TINY_COMMON, TINY_MODEL, compose_cfg, subprocess_env
from tests.dicom_series import pydicom_file, ramp, write_series
from tests.lightning_modules.ldm.test_ldm import TINY_VQGAN, tiny_ldm, vqgan_ckpt  # noqa: F401 - a fixture
from tests.lightning_modules.xray2ct.test_earlier_stages import STAGE_ONE, _prefixed, _random_weights
from tests.medvol.run.test_cross_validation import sweep  # noqa: F401 - a fixture
from tests.medvol.run.test_predict import predict_cfg, saved_run
from tests.memory_limit import at_most_more, limited
from tests.payloads import deflated_bomb, streamed_nifti

# Small enough that every attack below asks for more, large enough for the tiny genuine runs.
BUDGET_GIB = "0.25"
# What this process may map beyond what it has when an attack is read: far below what any attack asks for.
HEADROOM_GIB = 1.0
LDM_CLASS = "lightning_modules.ldm.latent_diffusion.LatentDiffusion"
SEGMENTATION_CLASS = "lightning_modules.segmentation.segmentation.Segmenter"


@pytest.fixture(autouse=True)
def small_budget(monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, BUDGET_GIB)


@pytest.fixture(scope="module")
def phantom_run(tmp_path_factory) -> Path:
    """A tiny VQ-GAN trained on the synthetic phantoms (16^3 at 6 mm): its checkpoint records 6 mm."""
    run_dir = tmp_path_factory.mktemp("phantoms") / "run"
    return saved_run(run_dir, compose_cfg(run_dir, ["logger=none", "callbacks.volume_slices=null"]))


def copied_run(run_dir: Path, to: Path) -> Path:
    """A genuine run folder copied, for an attacker to change one file of it."""
    shutil.copytree(run_dir, to)
    return to


def one_line_refusal(call, *args, **kwargs) -> str:
    """The refusal `call` raises with at most `HEADROOM_GIB` more memory mapped, as one line."""
    with pytest.raises(MedvolError) as refused, at_most_more(HEADROOM_GIB):
        call(*args, **kwargs)
    assert "\n" not in str(refused.value)
    return str(refused.value)


def scan(path: Path, shape=(16, 16, 16), zooms=(6.0, 6.0, 6.0), dtype=np.int16) -> Path:
    """A small genuine-looking scan: random values on a RAS grid of `zooms` mm voxels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    values = np.random.default_rng(0).integers(0, 100, shape).astype(dtype)
    nib.save(nib.Nifti1Image(values, np.diag([*zooms, 1.0])), str(path))
    return path


# ---- the grid an input is resampled to ---------------------------------------------------------------------------


def test_an_input_of_few_120_mm_voxels_is_refused_before_predict_resamples_it_to_the_training_spacing(
    phantom_run, tmp_path, monkeypatch
):
    # 32^3 voxels of 120 mm (under 50 kB) become 621^3 at the model's 6 mm: 14 GB for MONAI's Spacing. Beside a
    # genuine scan, predicted as a batch job: the coarse one is a failed subject, refused from its header with the
    # memory capped before any subject is read (its transforms never run), and the genuine one is written.
    from medvol.run import predict_job

    scan(tmp_path / "scans" / "a_genuine.nii.gz")
    coarse = scan(tmp_path / "scans" / "b_coarse.nii.gz", (32, 32, 32), (120.0, 120.0, 120.0))
    assert coarse.stat().st_size < 50_000
    out = tmp_path / "out"
    read = []
    subject_batch = predict_job.subject_batch
    monkeypatch.setattr(predict_job, "subject_batch", lambda dataset, i: read.append(i) or subject_batch(dataset, i))
    line = one_line_refusal(predict, predict_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt",
                                                 f"input={coarse.parent}", f"output_dir={out}"))
    assert read == [0], read
    assert line.startswith(f"1 of 2 subjects failed (b_coarse); listed in {out / 'predict.log'}")
    reason = next(r for r in (out / "predict.log").read_text().splitlines() if "failed: b_coarse: " in r)
    assert f"{coarse}: resampled from 120x120x120 mm voxels to 6x6x6 mm it becomes 621x621x621 = " in reason
    assert f"({BUDGET_GIB} GiB, a quarter" in reason and reason.endswith("refused before resampling it")
    assert list(out.glob("a_genuine_*.nii.gz")) and not list(out.glob("b_coarse_*"))


def test_a_checkpoint_whose_training_spacing_is_a_thirtieth_of_a_voxel_is_refused_before_resampling(
    phantom_run, tmp_path
):
    run_dir = copied_run(phantom_run, tmp_path / "run")
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["medvol_data"]["spacing"] = [0.2, 0.2, 0.2]
    torch.save(checkpoint, ckpt)
    image = scan(tmp_path / "scans" / "head.nii.gz")
    out = tmp_path / "out"
    line = one_line_refusal(predict, predict_cfg(f"ckpt_path={ckpt}", f"input={image}", f"output_dir={out}"))
    assert line.startswith(f"{image}: resampled from 6x6x6 mm voxels to 0.2x0.2x0.2 mm it becomes 451x451x451 = ")
    assert not out.exists()


def test_training_and_the_data_doctor_refuse_a_scan_too_large_at_the_dataset_spacing_from_its_header(tmp_path):
    root = tmp_path / "data"
    for subject in ("a", "b", "c"):
        scan(root / subject / "image.nii.gz", zooms=(1.0, 1.0, 1.0))
    coarse = scan(root / "d" / "image.nii.gz", (32, 32, 32), (120.0, 120.0, 120.0))
    dataset = ["dataset=nifti", f"dataset.root={root}", "dataset.transforms.spacing=[1,1,1]",
               "dataset.transforms.spatial_size=null", "dataset.num_workers=0"]
    common = [o for o in TINY_COMMON if not o.startswith("dataset.")]
    cfg = compose_cfg(tmp_path / "run", [*common, *TINY_MODEL["vqgan"], "logger=none", "callbacks.volume_slices=null",
                                         *dataset], tiny=False)
    line = one_line_refusal(run, cfg)
    assert line.startswith("the data check found 1 problem(s), training not started (first: ")
    assert f"{coarse}: too large: resampled from 120x120x120 mm voxels to 1x1x1 mm it becomes 3721x3721x3721" in line
    with at_most_more(HEADROOM_GIB):
        assert check_data([*dataset, "dataset.cache=none"]) == 1


# ---- what a NIfTI file's voxels take as read ---------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "refused"), [
    (np.complex128, "unusable: its voxels are complex128 (complex); medvol reads volumes of real numbers"),
    # 0.05 GiB is 4.4 bytes a voxel here: float32 alone would pass; float64 as read beside it does not.
    (np.float64, "too large: its header promises 230x230x230 = 1.22e+07 voxels (0.136 GiB as float64 read and as "
                 "float32)"),
])
def test_a_nifti_is_counted_at_the_bytes_its_reader_holds_and_complex_voxels_are_refused(
    phantom_run, tmp_path, monkeypatch, capsys, dtype, refused
):
    monkeypatch.setenv(BUDGET_ENV, "0.05")
    root = tmp_path / "data"
    path = streamed_nifti(root / "s1" / "image.nii.gz", (230, 230, 230), dtype, (6.0, 6.0, 6.0))
    out = tmp_path / "out"
    line = one_line_refusal(predict, predict_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={path}",
                                                 "spacing=native", f"output_dir={out}"))
    assert line == f"{path}: {refused.split(': ', 1)[1]}" or line.startswith(f"{path}: {refused.split(': ', 1)[1]}")
    assert not out.exists()
    capsys.readouterr()
    with at_most_more(HEADROOM_GIB):
        assert check_data(["dataset=nifti", f"dataset.root={root}", "dataset.transforms.spatial_size=null"]) == 1
    assert refused in capsys.readouterr().out


@pytest.mark.parametrize("shape", [(10_000, 10_000, 10_000), (16, 16, 16, 1, 30_000, 30_000)], ids=["1e12", "6th-axis"])
def test_a_header_promising_too_much_is_one_line_through_predict(phantom_run, tmp_path, shape):
    path = streamed_nifti(tmp_path / "scans" / "huge.nii.gz", shape, np.int16, voxels=False)
    out = tmp_path / "out"
    line = one_line_refusal(predict, predict_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={path}",
                                                 f"output_dir={out}"))
    assert line.startswith(f"{path}: its header promises {'x'.join(map(str, shape))} = ")
    assert not out.exists()


def test_a_gzip_bomb_behind_a_modest_header_is_read_no_further_than_its_header_promises(phantom_run, tmp_path):
    # 16^3 int16 voxels at 6 mm, then 2 GiB more zeros in the same stream (2 MB on disk).
    path = streamed_nifti(tmp_path / "scans" / "bomb.nii.gz", (16, 16, 16), np.int16, (6.0, 6.0, 6.0), 2 * 1024**3)
    with at_most_more(HEADROOM_GIB):
        predict(predict_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={path}",
                            f"output_dir={tmp_path / 'out'}"))
    assert nib.load(tmp_path / "out" / "bomb_reconstruction.nii.gz").shape == (16, 16, 16)


# ---- networks sized by a checkpoint's settings -----------------------------------------------------------------


def vqgan_bomb(path: Path, weights: bool) -> Path:
    """A plain-values 'VQ-GAN' checkpoint whose settings ask for 2^28 codes (8 GiB of codebook buffers): with a
    genuine tiny VQ-GAN's weights beside them, or with none at all (1.4 kB)."""
    torch.manual_seed(0)
    state = {k: v for k, v in VQGAN(**TINY_VQGAN).state_dict().items() if k.split(".")[0] in PIECES} if weights else {}
    settings = {"in_channels": 1, "embedding_dim": 4, "n_codes": 2**28, "n_hiddens": 8, "downsample": [4, 4, 4]}
    torch.save({MODEL_KEY: VQGAN_CLASS, "hyper_parameters": settings, "state_dict": state, "loops": {}}, path)
    return path


@pytest.mark.parametrize("weights", [True, False], ids=["its-weights", "none"])
def test_an_ldm_first_stage_whose_settings_ask_for_2_to_the_28_codes_is_refused_before_allocation(tmp_path, weights):
    bomb = vqgan_bomb(tmp_path / "vqgan.ckpt", weights)
    if not weights:
        assert bomb.stat().st_size < 2000
    cfg = compose_cfg(tmp_path / "run", ["model=ldm", f"model.first_stage_ckpt={bomb}", *TINY_MODEL["ldm"]])
    line = one_line_refusal(check_config, cfg)
    held = "holds codebook.embeddings of shape (32, 4)" if weights else "lacks codebook.cluster_size"
    assert line.startswith(f"`model.first_stage_ckpt`: {bomb} {held}, but its settings (")
    assert "n_codes=268435456" in line and "of shape (268435456" in line


def test_a_latent_models_checkpoint_whose_first_stage_settings_ask_for_2_to_the_28_codes_is_refused(tmp_path):
    cfg = compose_cfg(tmp_path / "run", ["model=ldm", "model.first_stage_ckpt=null", *TINY_MODEL["ldm"]])
    ckpt = tmp_path / "ldm.ckpt"
    torch.save({MODEL_KEY: LDM_CLASS, "state_dict": {}, "loops": {}, "hyper_parameters": {"first_stage_settings": {
        "in_channels": 1, "embedding_dim": 8, "n_codes": 2**28, "n_hiddens": 8, "downsample": [4, 4, 4]}}}, ckpt)
    line = one_line_refusal(lambda: open_trained_run(str(ckpt), config=cfg))
    # The family's bounds (medvol/run/settings_bounds.py) refuse it first; within them, the shapes on the meta device.
    assert line == (f"{ckpt}: `hyper_parameters.first_stage_settings.n_codes` is 268435456; expected a whole number "
                    "in [1, 131072]")


def test_an_earlier_cascade_stage_whose_settings_build_a_huge_network_is_refused_before_allocation(tmp_path):
    # Stage one's genuine weights, under settings whose channels make 29 GB of convolutions.
    path = tmp_path / "stage1.ckpt"
    torch.save({"hyper_parameters": {**STAGE_ONE, "channels": [2**14, 2**14]},
                "state_dict": _prefixed("network.", _random_weights(4))}, path)
    line = one_line_refusal(read_stage, str(path))
    assert line.startswith(f"`model.previous_stages`: {path} does not hold the network its settings describe")


def test_a_segmentation_checkpoint_restoring_a_billion_classes_is_refused_before_allocation(tmp_path):
    cfg = compose_cfg(tmp_path / "run", ["model=segmentation", "model.num_classes=3", "model.in_channels=1",
                                         "dataset.image_modalities=[t1]"])
    ckpt = tmp_path / "segmentation.ckpt"
    torch.save({MODEL_KEY: SEGMENTATION_CLASS, "state_dict": {}, "loops": {},
                "hyper_parameters": {"num_classes": 10**9, "in_channels": 1}}, ckpt)
    line = one_line_refusal(lambda: open_trained_run(str(ckpt), config=cfg))
    assert line == f"{ckpt}: `hyper_parameters.num_classes` is 1000000000; expected null or a whole number in [2, 1024]"


def test_a_resume_whose_network_settings_outgrow_the_checkpoint_is_refused_before_the_network_is_built(
    phantom_run, tmp_path
):
    # The model config of a resume may come from the run folder (a saved plan): 2^28 codes against its 32.
    run_dir = copied_run(phantom_run, tmp_path / "run")
    cfg = compose_cfg(run_dir, [f"ckpt_path={run_dir}/checkpoints/last.ckpt", "model.n_codes=268435456",
                                "logger=none", "callbacks.volume_slices=null"])
    line = one_line_refusal(run, cfg)
    assert line == (f"`ckpt_path`: {run_dir}/checkpoints/last.ckpt has codebook.embeddings of shape (32, 8) but the "
                    "model config gives (268435456, 8); use the model settings the checkpoint was trained with")


def test_a_run_folder_whose_window_is_4096_voxels_wide_is_refused_before_predict_pads_to_it(phantom_run, tmp_path):
    # The run's record says its volumes were 4096 voxels wide: the window predict slides.
    run_dir = copied_run(phantom_run, tmp_path / "run")
    record = json.loads((run_dir / "run.json").read_text())
    record["values"]["dataset"]["size"] = 4096
    (run_dir / "run.json").write_text(json.dumps(record))
    image = scan(tmp_path / "scans" / "head.nii.gz")
    out = tmp_path / "out"
    line = one_line_refusal(predict, predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"input={image}",
                                                 f"output_dir={out}"))
    # The family's bounds refuse it where the record is read (medvol/run/settings_bounds.py), before any window.
    assert line == (f"{run_dir / 'run.json'}: `dataset.size` is 4096; expected null or three whole numbers [D, H, W] "
                    "(or one for a cube), each in [1, 2048]")
    assert not out.exists()


def test_an_unconditional_sample_at_a_size_its_checkpoint_records_is_refused_before_it_is_drawn(vqgan_ckpt):  # noqa: F811
    module = tiny_ldm(vqgan_ckpt).eval()
    module.scale_factor.fill_(1.0)
    module.training_latent_size.copy_(torch.tensor([1024, 1024, 1024]))
    batch = {"subject": ["sample"], "affine": torch.eye(4, dtype=torch.float64)[None]}
    line = one_line_refusal(module.generate_volumes, batch)
    assert line.startswith("the training size the checkpoint records: asks for samples of 1x1x4096x4096x4096 = ")


# ---- DICOM files in the deflated transfer syntax -----------------------------------------------------------------


@pytest.fixture(scope="module")
def deflated_series(tmp_path_factory) -> tuple[Path, Path]:
    """A genuine 3-slice series with one slice replaced by a 1 MB file that inflates to 1 GiB (before its pixels),
    and that bomb alone."""
    folder = tmp_path_factory.mktemp("dicom") / "series"
    facts = write_series(folder, ramp(8, 6, 3))
    victim = Path(facts["files"][1])
    bomb = deflated_bomb(victim, pydicom.dcmread(victim), 1024**3)
    return folder, bomb


def test_a_deflated_dicom_that_inflates_1000x_is_refused_wherever_a_series_is_read(deflated_series, phantom_run,
                                                                                     tmp_path):
    folder, bomb = deflated_series
    assert bomb.stat().st_size < 1.5 * 1024**2
    refusal = f"{bomb}: its deflated data set (transfer syntax 1.2.840.10008.1.2.1.99) inflates beyond 32 MiB"
    assert one_line_refusal(series_geometry, folder).startswith(refusal)
    out = tmp_path / "out"
    line = one_line_refusal(predict, predict_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={folder}",
                                                 f"output_dir={out}"))
    assert line.startswith(refusal) and not out.exists()


def test_a_deflated_radiograph_and_deflated_pixel_data_are_bounded_too(tmp_path):
    source = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    source.Modality, source.PatientOrientation = "DX", ["L", "F"]
    header_bomb = deflated_bomb(tmp_path / "view.dcm", source, 1024**3)
    assert "inflates beyond 32 MiB, more than its header may take" in one_line_refusal(read_radiograph, header_bomb)
    # The pixel data itself inflating past the pixels its header promises: the header reads, the pixels do not.
    pixel_bomb = deflated_bomb(tmp_path / "pixels.dcm", source, 1024**3, in_pixels=True)
    header = read_dicom(pixel_bomb, header_only=True)
    assert header.Rows == source.Rows and "PixelData" not in header
    line = one_line_refusal(stored_pixels, Slice(pixel_bomb, header))
    assert f"more than its header and the {source.Rows * source.Columns * 2:,} bytes of pixels it promises" in line


# ---- through the entry points, as a user runs them -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["coarse-input", "1e12-header", "ldm-first-stage", "export-run-record"])
def test_each_attack_ends_in_one_line_and_exit_2_through_its_entry_point(phantom_run, tmp_path, attack):
    out = tmp_path / "out"
    ckpt = f"ckpt_path={phantom_run}/checkpoints/last.ckpt"
    if attack == "coarse-input":
        named = scan(tmp_path / "scans" / "coarse.nii.gz", (32, 32, 32), (120.0, 120.0, 120.0))
        command = ["predict.py", ckpt, f"input={named}", f"output_dir={out}", "device=cpu"]
    elif attack == "1e12-header":
        named = streamed_nifti(tmp_path / "scans" / "huge.nii.gz", (10_000, 10_000, 10_000), np.int16, voxels=False)
        command = ["predict.py", ckpt, f"input={named}", f"output_dir={out}", "device=cpu"]
    elif attack == "ldm-first-stage":
        named = vqgan_bomb(tmp_path / "vqgan.ckpt", weights=False)
        command = ["train.py", "model=ldm", f"model.first_stage_ckpt={named}", "hardware=cpu", "logger=none",
                   f"hydra.run.dir={out}"]
    else:
        run_dir = copied_run(phantom_run, tmp_path / "run")
        named = run_dir / "checkpoints" / "last.ckpt"
        record = json.loads((run_dir / "run.json").read_text())
        record["values"]["model"]["n_codes"] = 2**28
        (run_dir / "run.json").write_text(json.dumps(record))
        command = ["export.py", f"ckpt_path={named}", f"output_dir={out}"]
        # The family's bounds refuse it where the record is read: the line names the record.
        named = run_dir / "run.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / command[0]), *command[1:]], cwd=tmp_path, capture_output=True, text=True,
        env=subprocess_env(OMP_NUM_THREADS="1", **{BUDGET_ENV: BUDGET_GIB}), preexec_fn=limited(3.0), timeout=300,
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, lines[-20:]
    assert lines[0].startswith("medvol: error: ") and str(named) in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("resampling", ["linear", "nnunet"])
def test_a_dataset_refuses_a_grid_past_the_budget_before_monais_spacing_allocates_it(tmp_path, resampling):
    # Past the header checks (a dataset built directly): the transforms themselves refuse before resampling.
    coarse = scan(tmp_path / "data" / "d" / "image.nii.gz", (32, 32, 32), (120.0, 120.0, 120.0))
    datamodule = NiftiDataModule(root=str(tmp_path / "data"), transforms={
        "spacing": [1.0, 1.0, 1.0], "spatial_size": None, "resampling": resampling, "intensity": "none"})
    dataset = datamodule.build_dataset(datamodule.subjects(), "test")
    with pytest.raises(RuntimeError) as wrapped, at_most_more(HEADROOM_GIB):
        dataset[0]
    refusal = refusal_within(wrapped.value)
    assert refusal is not None and str(refusal).startswith(f"{coarse}: resampled from 120x120x120 mm voxels to 1x1x1")


def test_predict_passes_a_refusal_met_while_reading_pixels_as_its_one_line(phantom_run, tmp_path):
    # A series whose headers are genuine and one slice's deflated pixel data inflates to 1 GiB: met when its pixels
    # are read, inside MONAI's transforms, which wrap it in a RuntimeError. 8^3 voxels of 6 mm: as large as the model
    # takes (its per-subject SSIM needs 6x6x7 at its 6 mm), so only the pixels can refuse it.
    folder = tmp_path / "series"
    facts = write_series(folder, ramp(8, 8, 8), spacing=(6.0, 6.0), step=6.0)
    victim = Path(facts["files"][1])
    deflated_bomb(victim, pydicom.dcmread(victim), 1024**3, in_pixels=True)
    out = tmp_path / "out"
    line = one_line_refusal(predict, predict_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={folder}",
                                                 f"output_dir={out}"))
    assert line.startswith(f"{victim}: its deflated data set") and "bytes of pixels it promises" in line
    # Met in the loop, past the checks of headers: no output written (predict.log at most, beside them).
    assert not any(out.rglob("*.nii.gz"))


@pytest.mark.slow
def test_a_fold_of_a_sweep_whose_record_asks_for_a_billion_classes_is_refused_through_run_dir(
    sweep, tmp_path  # noqa: F811
):
    # The sweep's model takes its classes from its regions' label values: one of a billion names a billion classes.
    folds = copied_run(sweep, tmp_path / "sweep")
    record = json.loads((folds / "1" / "run.json").read_text())
    record["values"]["model"]["regions"]["core"] = [10**9]
    (folds / "1" / "run.json").write_text(json.dumps(record))
    out = tmp_path / "out"
    line = one_line_refusal(predict, predict_cfg(f"run_dir={folds}", "split=test", f"output_dir={out}"))
    assert line.startswith(f"`ckpt_path`: {folds}/1/checkpoints/")
    assert line.endswith(": the largest region value + 1 is 1000000001; at most 65536 classes (DICOM-SEG numbers "
                         "segments in 16 bits)")
    assert not out.exists()
