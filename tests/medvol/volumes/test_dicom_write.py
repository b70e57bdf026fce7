"""DICOM out on its own: a derived series and a DICOM-SEG on the source slices, read back by SimpleITK and highdicom."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import highdicom as hd
import numpy as np
import pydicom
import pytest
from pydicom.uid import CTImageStorage, MRImageStorage

from medvol.core.errors import MedvolError
from medvol.volumes.dicom_io import series_geometry
from medvol.volumes.dicom_write import write_derived_series, write_segmentation
from tests.dicom_series import oblique_orientation, ramp, write_series


@pytest.fixture
def source(tmp_path: Path):
    write_series(tmp_path / "src", ramp(6, 5, 4), oblique_orientation(15.0), spacing=(0.8, 1.2), step=2.5,
                 intercept=-1024.0, seed=2)
    return series_geometry(tmp_path / "src")


def sitk_series(folder: Path) -> tuple[np.ndarray, Any]:
    sitk = pytest.importorskip("SimpleITK")
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(folder)))
    image = reader.Execute()
    return sitk.GetArrayFromImage(image).transpose(2, 1, 0).astype(np.float64), image


def test_a_derived_series_holds_the_values_on_the_source_grid_in_a_new_series_of_the_same_study(tmp_path, source):
    volume = np.linspace(-1000.0, 2500.0, int(np.prod(source.shape))).reshape(source.shape)
    write_derived_series(volume, source, tmp_path / "out", "medvol test")
    values, image = sitk_series(tmp_path / "out")
    _, reference = sitk_series(tmp_path / "src")
    slope = float(pydicom.dcmread(next((tmp_path / "out").iterdir())).RescaleSlope)
    np.testing.assert_allclose(values, volume, atol=slope / 2 + 1e-6)
    np.testing.assert_allclose(image.GetOrigin(), reference.GetOrigin(), atol=1e-4)
    np.testing.assert_allclose(image.GetDirection(), reference.GetDirection(), atol=1e-6)
    np.testing.assert_allclose(image.GetSpacing(), reference.GetSpacing(), atol=1e-4)
    made, first = pydicom.dcmread(next((tmp_path / "out").iterdir())), source.slices[0].header
    assert made.SeriesInstanceUID != first.SeriesInstanceUID and "DERIVED" in list(made.ImageType)
    assert (made.StudyInstanceUID, made.FrameOfReferenceUID) == (first.StudyInstanceUID, first.FrameOfReferenceUID)


def test_a_derived_series_never_goes_into_a_folder_that_holds_files_or_off_the_source_grid(tmp_path, source):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.dcm").write_bytes(b"the user's")
    with pytest.raises(MedvolError, match="already holds files"):
        write_derived_series(np.zeros(source.shape), source, tmp_path / "taken", "x")
    assert (tmp_path / "taken" / "mine.dcm").read_bytes() == b"the user's"
    with pytest.raises(MedvolError, match="must lie on the source slices"):
        write_derived_series(np.zeros((2, 2, 2)), source, tmp_path / "new", "x")


def test_a_segmentation_read_back_gives_each_segment_on_its_source_slices_and_omits_empty_frames(tmp_path, source):
    mask = np.zeros(source.shape, dtype=np.int64)
    mask[1:4, 1:3, 1] = 1
    mask[2, 2, 2] = 2
    path = write_segmentation(mask, source, tmp_path / "seg.dcm", {"whole": [1, 2], "core": [2]}, "medvol seg")
    seg = hd.seg.segread(path)
    assert [s.SegmentLabel for s in seg.SegmentSequence] == ["whole", "core"]
    instances = [str(item.header.SOPInstanceUID) for item in source.slices]
    frames = seg.get_pixels_by_source_instance(source_sop_instance_uids=instances, segment_numbers=[1, 2])
    # frames: (slices, rows, columns, segments); the mask is (columns, rows, slices).
    np.testing.assert_array_equal(frames[..., 0] > 0, np.isin(mask, [1, 2]).transpose(2, 1, 0))
    np.testing.assert_array_equal(frames[..., 1] > 0, (mask == 2).transpose(2, 1, 0))
    assert seg.NumberOfFrames == 2 + 1
    with pytest.raises(MedvolError, match="must lie on the source slices"):
        write_segmentation(mask[:, :, :2], source, tmp_path / "bad.dcm", {"whole": [1]}, "x")


def test_a_ct_generated_from_an_mr_is_a_ct_that_names_its_source_slices_and_how_it_was_made(tmp_path):
    write_series(tmp_path / "mr", ramp(5, 4, 3), step=3.0, modality="MR", seed=5)
    mr = series_geometry(tmp_path / "mr")
    hounsfield = np.linspace(-1000.0, 1500.0, int(np.prod(mr.shape))).reshape(mr.shape)
    write_derived_series(hounsfield, mr, tmp_path / "ct", "medvol ct", channel="ct")
    made = sorted((pydicom.dcmread(p) for p in (tmp_path / "ct").iterdir()), key=lambda d: d.InstanceNumber)
    sources = {str(item.header.SOPInstanceUID): item.header for item in mr.slices}
    for k, ds in enumerate(made):
        assert (ds.Modality, ds.SOPClassUID, ds.file_meta.MediaStorageSOPClassUID) == ("CT", CTImageStorage,
                                                                                       CTImageStorage)
        assert ds.RescaleType == "HU" and ds.FrameOfReferenceUID == mr.first.FrameOfReferenceUID
        source = ds.SourceImageSequence[0]
        assert source.ReferencedSOPInstanceUID == str(mr.slices[k].header.SOPInstanceUID)
        assert source.ReferencedSOPClassUID == MRImageStorage
        assert (source.PurposeOfReferenceCodeSequence[0].CodeValue,
                source.PurposeOfReferenceCodeSequence[0].CodingSchemeDesignator) == ("121322", "DCM")
        assert list(ds.ImagePositionPatient) == list(sources[source.ReferencedSOPInstanceUID].ImagePositionPatient)
        derivation = ds.DerivationCodeSequence[0]
        assert (derivation.CodeValue, derivation.CodingSchemeDesignator) == ("123110", "DCM")
        assert "ScanningSequence" not in ds
    # highdicom reads it as a CT image of the same frame of reference; SimpleITK gets the HU back.
    image = hd.imread(tmp_path / "ct" / "0001.dcm")
    assert image.Modality == "CT" and image.FrameOfReferenceUID == mr.first.FrameOfReferenceUID
    values, _ = sitk_series(tmp_path / "ct")
    np.testing.assert_allclose(values, hounsfield, atol=float(made[0].RescaleSlope) / 2 + 1e-6)


def test_an_mr_output_of_an_mr_keeps_its_modality_and_borrows_only_same_modality_attributes(tmp_path):
    write_series(tmp_path / "mr", ramp(4, 4, 2), modality="MR")
    mr = series_geometry(tmp_path / "mr")
    write_derived_series(np.zeros(mr.shape), mr, tmp_path / "t2", "medvol t2", channel="t2")
    ds = pydicom.dcmread(tmp_path / "t2" / "0001.dcm")
    assert (ds.Modality, ds.SOPClassUID, ds.ScanningSequence, ds.EchoTime) == ("MR", MRImageStorage, "SE", 12)
    write_derived_series(np.zeros(mr.shape), mr, tmp_path / "other", "medvol x", channel="feature map")
    assert pydicom.dcmread(tmp_path / "other" / "0001.dcm").SOPClassUID == MRImageStorage


def test_segments_are_coded_by_their_names_or_as_the_user_says(tmp_path, source):
    mask = np.zeros(source.shape, dtype=np.int64)
    for value in range(1, 6):
        mask[value % 5, 1, value % 4] = value
    names = {"tumour": [1], "oedema": [2], "liver": [3], "ET": [4], "implant": [5]}
    given = {"implant": {"category": "SCT:260787004:Physical object", "type": "SCT:40388003:Implant"}}
    seg = hd.seg.segread(write_segmentation(mask, source, tmp_path / "seg.dcm", names, "medvol seg", given))
    coded = {s.SegmentLabel: (s.SegmentedPropertyCategoryCodeSequence[0].CodeValue,
                              s.SegmentedPropertyTypeCodeSequence[0].CodeValue) for s in seg.SegmentSequence}
    # SNOMED CT: 49755003 morphologically abnormal structure, 108369006 neoplasm, 79654002 oedema; 91723000
    # anatomical structure, 10200004 liver.
    assert coded == {"tumour": ("49755003", "108369006"), "oedema": ("49755003", "79654002"),
                     "liver": ("91723000", "10200004"), "ET": ("49755003", "108369006"),
                     "implant": ("260787004", "40388003")}
    with pytest.raises(MedvolError, match=r"`segment_codes.tumour.type` is 'Tumourous'; expected a SNOMED CT keyword"):
        write_segmentation(mask, source, tmp_path / "bad.dcm", names, "x", {"tumour": {"type": "Tumourous"}})


def test_a_resampled_series_gets_its_outputs_back_on_its_source_slices(tmp_path):
    positions = [0.0, 2.5, 5.0, 7.74, 10.48]
    write_series(tmp_path / "src", ramp(4, 3, 5), positions=positions)
    uneven = series_geometry(tmp_path / "src")
    assert uneven.resampled and len(uneven.slices) == 5 and uneven.shape[2] == 6  # 10.48 mm in 2.096 mm steps
    grid = np.arange(uneven.shape[2]) * np.linalg.norm(uneven.affine[:3, 2])
    # A mask whose slab lies between 7 and 9 mm on the even grid: on the source slices only the one at 7.74 mm.
    mask = np.zeros(uneven.shape, dtype=np.int64)
    mask[..., (grid > 7) & (grid < 9)] = 1
    seg = hd.seg.segread(write_segmentation(mask, uneven, tmp_path / "seg.dcm", {"slab": [1]}, "x"))
    instances = [str(item.header.SOPInstanceUID) for item in uneven.slices]
    frames = seg.get_pixels_by_source_instance(source_sop_instance_uids=instances, segment_numbers=[1])
    assert frames[..., 0].reshape(5, -1).any(axis=1).tolist() == [False, False, False, True, False]
    ramp_along = np.broadcast_to(grid, uneven.shape).astype(np.float64)
    write_derived_series(ramp_along, uneven, tmp_path / "out", "x")
    made = sorted((pydicom.dcmread(p) for p in (tmp_path / "out").iterdir()), key=lambda d: d.InstanceNumber)
    assert len(made) == 5
    at_source = [float(d.pixel_array[0, 0]) * float(d.RescaleSlope) + float(d.RescaleIntercept) for d in made]
    np.testing.assert_allclose(at_source, positions, atol=0.01)
