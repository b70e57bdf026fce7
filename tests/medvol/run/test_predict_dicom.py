"""DICOM series through training, test=true and predict.py: the same outputs as the volume given as NIfTI, derived
series and DICOM-SEG written on the source slices, refusals before any work, no patient attribute in what medvol
makes."""

from __future__ import annotations

import json
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
import torch

from datamodules.sources.nifti import NiftiDataModule
from datamodules.sources.phantom import make_phantom
from medvol.core.errors import MedvolError
from medvol.run.predicting import predict
from medvol.run.training import run
from medvol.volumes.dicom_io import is_dicom_file, read_series
from medvol.volumes.prediction_writer import PredictionWriter
from tests.conftest import TINY_COMMON, TINY_MODEL, compose_cfg
from tests.dicom_series import PATIENT, oblique_orientation, write_series
from tests.medvol.run.test_predict import predict_cfg, saved_run

SHAPE = (22, 13, 18)


def write_phantom_series(folder: Path, seed: int, uid: str | None = None, description: str = "t1") -> dict:
    """A T1-like int16 phantom as a shuffled, oblique, anisotropic series with intercept -1024 (stored = value +
    1024)."""
    values = np.rint(make_phantom(0, seed, SHAPE).channels["t1"] * 1000).astype(np.int16)
    return write_series(folder, values.transpose(1, 0, 2) + 1024, oblique_orientation(12.0), spacing=(0.9, 1.2),
                        step=2.5, origin=(30.0, 21.0, -40.0), intercept=-1024.0, uid=uid, description=description,
                        seed=seed)


def as_nifti(folder: Path, path: Path) -> Path:
    """SimpleITK's NIfTI export of a series: the same volume, read by an independent reader."""
    sitk = pytest.importorskip("SimpleITK")
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(folder)))
    sitk.WriteImage(reader.Execute(), str(path))
    return path


@pytest.fixture(scope="module")
def dicom_run(tmp_path_factory) -> Path:
    """A tiny VQ-GAN trained on series folders (`{subject}/image/`, matched by the default
    `{subject}/{modality}.nii.gz`), tested with test=true output_format=both, logged to TensorBoard."""
    base = tmp_path_factory.mktemp("dicom")
    for i in range(8):
        write_phantom_series(base / "scans" / f"case{i:02d}" / "image", i)
    run_dir = base / "run"
    common = [o for o in TINY_COMMON if not o.startswith("dataset.")]
    cfg = compose_cfg(run_dir, [
        *common, *TINY_MODEL["vqgan"], "dataset=nifti", f"dataset.root={base / 'scans'}",
        "dataset.transforms.spatial_size=[16,16,16]", "dataset.batch_size=2", "dataset.num_workers=0", "test=true",
        "output_format=both", "callbacks.volume_slices=null",
    ], tiny=False)
    return saved_run(run_dir, cfg)


def test_test_true_writes_derived_series_beside_the_nifti_outputs(dicom_run: Path):
    predictions = dicom_run / "predictions"
    niftis = sorted(predictions.glob("*_reconstruction.nii.gz"))
    assert niftis
    for path in niftis:
        series, geometry = read_series(predictions / path.name.removesuffix(".nii.gz"))
        image = nib.load(str(path))
        np.testing.assert_allclose(geometry.affine, image.affine, atol=1e-4)
        span = float(np.ptp(image.get_fdata()))
        np.testing.assert_allclose(series, image.get_fdata(), atol=span / 65000 + 1e-3)


def test_a_dicom_input_predicts_what_the_same_volume_as_nifti_predicts(dicom_run: Path, tmp_path: Path):
    write_phantom_series(tmp_path / "studies" / "anon01", 11)
    (tmp_path / "nifti").mkdir()
    as_nifti(tmp_path / "studies" / "anon01", tmp_path / "nifti" / "anon01.nii.gz")
    ckpt = f"ckpt_path={dicom_run}/checkpoints/last.ckpt"
    predict(predict_cfg(ckpt, f"input={tmp_path / 'studies'}", f"output_dir={tmp_path / 'from_dicom'}"))
    predict(predict_cfg(ckpt, f"input={tmp_path / 'nifti'}", f"output_dir={tmp_path / 'from_nifti'}"))
    a = nib.load(str(tmp_path / "from_dicom" / "anon01_reconstruction.nii.gz"))
    b = nib.load(str(tmp_path / "from_nifti" / "anon01_reconstruction.nii.gz"))
    assert a.shape == b.shape == SHAPE
    np.testing.assert_allclose(a.affine, b.affine, atol=1e-4)
    np.testing.assert_allclose(a.get_fdata(), b.get_fdata(), atol=1e-3)


def test_derived_series_carry_the_source_study_and_patient_module_and_nothing_of_the_patient_leaks(
    dicom_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    source = write_phantom_series(tmp_path / "in" / "anon02", 12)
    out = tmp_path / "out"
    predict(predict_cfg(f"ckpt_path={dicom_run}/checkpoints/last.ckpt", f"input={tmp_path / 'in' / 'anon02'}",
                        f"output_dir={out}", "output_format=dicom"))
    files = sorted((out / "anon02_reconstruction").iterdir())
    assert len(files) == SHAPE[2] and not (out / "anon02_reconstruction.nii.gz").exists()
    first, original = pydicom.dcmread(files[0]), pydicom.dcmread(source["files"][0])
    assert first.SeriesInstanceUID != original.SeriesInstanceUID and list(first.ImageType)[0] == "DERIVED"
    assert (first.StudyInstanceUID, first.FrameOfReferenceUID) == (original.StudyInstanceUID,
                                                                   original.FrameOfReferenceUID)
    assert {k: str(first.get(k)) for k in PATIENT} == PATIENT
    assert not any(element.tag.is_private for element in first)
    # Every file medvol made but the DICOM outputs (which carry the patient module): logs, TensorBoard events,
    # summary.json, split.json, configs, checkpoints, NIfTI and CSV outputs.
    made = [p for folder in (out, dicom_run) for p in folder.rglob("*")]
    contents = [p.read_bytes() for p in made if p.is_file() and not is_dicom_file(p)]
    assert any(p.name.startswith("events.out.tfevents") for p in made) and (dicom_run / "summary.json").is_file()
    printed = capsys.readouterr()
    for value in PATIENT.values():
        assert not any(value in p.name for p in made)
        assert not any(value.encode() in content for content in contents) and value not in printed.out + printed.err
    assert json.loads((dicom_run / "split.json").read_text())


def test_predict_refuses_a_folder_of_two_series_listing_them_and_reads_the_one_chosen(dicom_run: Path, tmp_path: Path):
    first = write_phantom_series(tmp_path / "in" / "anon03", 13, description="t1 axial")
    write_phantom_series(tmp_path / "in" / "anon03", 14, description="t1 repeat")
    ckpt = f"ckpt_path={dicom_run}/checkpoints/last.ckpt"
    with pytest.raises(MedvolError, match=f"holds 2 DICOM series: .*{first['uid']} \\('t1 axial', 18 slices\\)"):
        predict(predict_cfg(ckpt, f"input={tmp_path / 'in'}", f"output_dir={tmp_path / 'out'}"))
    assert not (tmp_path / "out").exists()
    predict(predict_cfg(ckpt, f"input={tmp_path / 'in'}", f"output_dir={tmp_path / 'out'}", "series='t1 axial'"))
    assert (tmp_path / "out" / "anon03_reconstruction.nii.gz").is_file()


def test_dicom_output_for_a_nifti_input_and_an_unknown_format_are_refused(dicom_run: Path, tmp_path: Path):
    write_phantom_series(tmp_path / "s", 15)
    nifti = as_nifti(tmp_path / "s", tmp_path / "scan.nii.gz")
    ckpt = f"ckpt_path={dicom_run}/checkpoints/last.ckpt"
    with pytest.raises(MedvolError, match="`output_format`: dicom, but subject scan comes from .*not a DICOM series"):
        predict(predict_cfg(ckpt, f"input={nifti}", f"output_dir={tmp_path / 'out'}", "output_format=dicom"))
    with pytest.raises(MedvolError, match="`output_format` is 'dcm'; expected one of"):
        predict(predict_cfg(ckpt, f"input={nifti}", f"output_dir={tmp_path / 'out'}", "output_format=dcm"))


def test_a_mask_is_written_as_dicom_seg_on_the_source_slices(tmp_path: Path):
    """A threshold of the model-grid image, written as SEG, read back with highdicom = the threshold of SimpleITK's
    values."""
    sitk = pytest.importorskip("SimpleITK")
    write_phantom_series(tmp_path / "scans" / "anon04" / "image", 16)
    datamodule = NiftiDataModule(root=str(tmp_path / "scans"), pattern="{subject}/{modality}",
                                 transforms={"orientation": "RAS", "intensity": "none", "spatial_size": None})
    batch = torch.utils.data.default_collate([datamodule.build_dataset(datamodule.subjects(), "test")[0]])
    seg = (batch["image"] > 300).long() + (batch["image"] > 700).long()
    outputs = {"volumes": {"seg": seg}, "segments": {"brain": [1, 2], "bright": [2]}}
    PredictionWriter(tmp_path / "out", output_format="dicom").write(outputs, batch)
    written = hd.seg.segread(tmp_path / "out" / "anon04_seg.dcm")
    assert [s.SegmentLabel for s in written.SegmentSequence] == ["brain", "bright"]
    folder = tmp_path / "scans" / "anon04" / "image"
    reader = sitk.ImageSeriesReader()
    names = reader.GetGDCMSeriesFileNames(str(folder))
    reader.SetFileNames(names)
    values = sitk.GetArrayFromImage(reader.Execute())  # (slices, rows, columns), in GDCM's slice order
    instances = [str(pydicom.dcmread(name, stop_before_pixels=True).SOPInstanceUID) for name in names]
    frames = written.get_pixels_by_source_instance(source_sop_instance_uids=instances, segment_numbers=[1, 2])
    np.testing.assert_array_equal(frames[..., 0] > 0, values > 300)
    np.testing.assert_array_equal(frames[..., 1] > 0, values > 700)
    # Empty frames are left out: only slices where a segment has a voxel are stored.
    assert written.NumberOfFrames == int(((values > 300).any(axis=(1, 2))).sum() + ((values > 700).any(axis=(1,
                                                                                                             2))).sum())
    assert str(written.SeriesInstanceUID) != str(pydicom.dcmread(names[0]).SeriesInstanceUID)
    assert {k: str(written.get(k)) for k in PATIENT} == PATIENT and "PatientAge" not in written


def test_test_true_with_dicom_output_on_data_without_series_is_refused_before_training(tmp_path: Path):
    cfg = compose_cfg(tmp_path / "run",
                      ["test=true", "output_format=dicom", "logger=none", "callbacks.volume_slices=null"])
    with pytest.raises(MedvolError, match="`output_format`: dicom, but subject .* comes from no file"):
        run(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()
