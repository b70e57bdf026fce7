"""Write outputs for a DICOM source series so a PACS viewer shows them with it: masks as DICOM-SEG, images as a series.

Both take a volume on the source series' grid ((columns, rows, slices), `dicom_io`'s axes; for a series
resampled onto an even grid, that grid: the volume goes back onto the source slices first) and the series
it came from. A mask becomes one DICOM-SEG object (highdicom) with one segment per class or region, each
coded in SNOMED CT by its name or the user's `segment_codes` (`segment_codes`), its frames referencing the
source slices, empty frames left out. An image becomes a derived series that says what it is: a new
SeriesInstanceUID, one slice per source slice at its position, each naming its source slice
(SourceImageSequence) and how it was made (DerivationCodeSequence: artificial intelligence), the source's
StudyInstanceUID and FrameOfReferenceUID, ImageType DERIVED, the Modality and SOP class of what it holds (a
CT generated from an MR is a CT: `derived_modality`), int16 stored values with RescaleSlope/Intercept giving
the values in its units. Both carry the patient and study modules of the source (a viewer files them under
the same patient), nothing else of it: no private tags, no acquisition details beyond the image plane.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import highdicom as hd
import numpy as np
from pydicom.dataset import Dataset, FileDataset, FileMetaDataset
from pydicom.sr.codedict import codes
from pydicom.sr.coding import Code
from pydicom.uid import (
    CTImageStorage,
    ExplicitVRLittleEndian,
    MRImageStorage,
    SecondaryCaptureImageStorage,
    generate_uid,
)

from medvol.core.errors import MedvolError
from medvol.volumes.dicom_io import SeriesGeometry
from medvol.volumes.segment_codes import segment_coding

# What of the source an output carries: the patient and study modules (a viewer files the output with its
# source), the frame of reference and the modality; nothing else.
PATIENT_AND_STUDY = (
    "PatientName", "PatientID", "IssuerOfPatientID", "PatientBirthDate", "PatientSex",
    "StudyInstanceUID", "StudyDate", "StudyTime", "ReferringPhysicianName", "StudyID", "AccessionNumber",
    "StudyDescription",
)
FRAME_OF_REFERENCE = ("FrameOfReferenceUID", "PositionReferenceIndicator")
MANUFACTURER = "medvol"
# Stored values span this many int16 steps: the output's range at the finest step a slope allows.
STORED_STEPS = 65000
# A dataset's channel name -> the DICOM Modality of a volume in that channel's units.
MR_NAMES = ("t1", "t2", "flair", "pd", "dwi", "adc", "swi", "mr", "mri", "bold", "dti")
# Modality -> the SOP class a derived single-frame image of it is stored as (others: secondary capture).
SOP_CLASSES = {"CT": CTImageStorage, "MR": MRImageStorage}
# How a derived slice came about (CID 7203 is extensible; DCM's code for the algorithm family) and what its
# source slice was for (CID 7202).
DERIVATION = codes.DCM.ArtificialIntelligence
SOURCE_PURPOSE = codes.DCM.SourceImageForImageProcessingOperation


def derived_modality(channel: str | None, source: Dataset) -> str:
    """The DICOM Modality of an output in the units of the dataset channel `channel` (`ct` -> CT, `t2` -> MR,
    `pet` -> PT); the source series' own where the channel says nothing (`image`, none)."""
    name = (channel or "").lower()
    if name.startswith("ct"):
        return "CT"
    if name.startswith(MR_NAMES):
        return "MR"
    if name in ("pet", "pt") or name.startswith("pet"):
        return "PT"
    return str(source.get("Modality", "OT") or "OT")


def _code_item(code: Code) -> Dataset:
    item = Dataset()
    item.CodeValue, item.CodingSchemeDesignator, item.CodeMeaning = code.value, code.scheme_designator, code.meaning
    return item


def _new_series_number(source: Dataset) -> int:
    """A series number beside the source's, in the range viewers sort by."""
    return int(source.get("SeriesNumber", 0) or 0) + 1000


def write_segmentation(
    mask: np.ndarray, geometry: SeriesGeometry, path: str | Path, segments: Mapping[str, Sequence[int]],
    description: str, segment_codes: Mapping[str, Mapping[str, str]] | None = None,
) -> Path:
    """Write a (columns, rows, slices) label map on the source grid as a DICOM-SEG referencing `geometry`'s slices.

    Args:
        mask: integer label map on the source series' grid.
        geometry: the source series.
        path: the .dcm file to write (its folder is created).
        segments: segment name -> the label values it holds (a class: one value; a nested region: several).
        description: SeriesDescription of the segmentation.
        segment_codes: segment name -> its `category` and/or `type` code (`medvol.volumes.segment_codes`);
            a segment not named is coded from its name.
    """
    if tuple(mask.shape) != geometry.shape:
        raise MedvolError(
            f"the segmentation {description!r} is {tuple(mask.shape)} voxels but its source series {geometry.uid} is "
            f"{geometry.shape}; a DICOM-SEG must lie on the source slices (patch outputs cannot be written as DICOM)"
        )
    mask = geometry.on_source_slices(mask, labels=True)
    frames = np.stack([np.isin(mask, values) for values in segments.values()], axis=-1).transpose(2, 1, 0, 3)
    # The headers suffice: a SEG references its source slices, it does not copy their pixels.
    sources = [item.header for item in geometry.slices]
    algorithm = hd.AlgorithmIdentificationSequence(
        name="medvol", version="0.1.0", family=codes.cid7162.ArtificialIntelligence
    )
    codings = {name: segment_coding(name, (segment_codes or {}).get(name)) for name in segments}
    descriptions = [
        hd.seg.SegmentDescription(
            segment_number=number, segment_label=name, segmented_property_category=codings[name][0],
            segmented_property_type=codings[name][1], algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=algorithm,
        )
        for number, name in enumerate(segments, start=1)
    ]
    seg = hd.seg.Segmentation(
        source_images=sources,
        pixel_array=frames.astype(np.uint8),
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=descriptions,
        series_instance_uid=generate_uid(),
        series_number=_new_series_number(sources[0]),
        sop_instance_uid=generate_uid(),
        instance_number=1,
        manufacturer=MANUFACTURER,
        manufacturer_model_name="medvol",
        software_versions="0.1.0",
        device_serial_number="0",
        series_description=description,
        omit_empty_frames=True,
    )
    _keep_only_the_patient_module(seg, sources[0])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    seg.save_as(path)
    return path


def _keep_only_the_patient_module(output: Dataset, source: Dataset) -> None:
    """Patient and study attributes exactly the source's; highdicom copies a few more, which are dropped."""
    for keyword in ("PatientAge", "PatientWeight", "PatientSize", "OtherPatientIDs", "EthnicGroup"):
        if keyword in output:
            delattr(output, keyword)
    for keyword in PATIENT_AND_STUDY:
        if keyword in source:
            setattr(output, keyword, source.data_element(keyword).value)


def rescale_for(volume: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) that store `volume`'s range in int16 steps; written as DICOM decimal strings."""
    low, high = float(np.min(volume)), float(np.max(volume))
    slope = float(f"{max(high - low, 1e-3) / STORED_STEPS:.6e}")
    intercept = float(f"{(high + low) / 2:.6f}")
    return slope, intercept


def write_derived_series(
    volume: np.ndarray, geometry: SeriesGeometry, folder: str | Path, description: str, channel: str | None = None,
) -> list[Path]:
    """Write a (columns, rows, slices) volume in its units as a derived series, one file per source slice.

    Args:
        volume: values on the source series' grid, in the units of `channel` (HU for CT).
        geometry: the source series.
        folder: a new folder for the slices (refused if it holds files).
        description: SeriesDescription of the new series.
        channel: the dataset channel whose units the volume is in (`ct`, `t2`: its Modality and SOP class,
            `derived_modality`); None: the source's.
    """
    if tuple(volume.shape) != geometry.shape:
        raise MedvolError(
            f"the output {description!r} is {tuple(volume.shape)} voxels but its source series {geometry.uid} is "
            f"{geometry.shape}; a derived series must lie on the source slices"
        )
    volume = geometry.on_source_slices(volume, labels=False)
    modality = derived_modality(channel, geometry.first)
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise MedvolError(f"`output_dir`: {folder} already holds files; a derived series goes into a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    slope, intercept = rescale_for(volume)
    stored = np.clip(np.rint((volume - intercept) / slope), -32768, 32767).astype("<i2")
    series_uid = generate_uid()
    paths = []
    for k, item in enumerate(geometry.slices):
        dataset = _derived_slice(
            item.header, stored[:, :, k].T, series_uid, k + 1, description, (slope, intercept), modality
        )
        path = folder / f"{k + 1:04d}.dcm"
        dataset.save_as(path, enforce_file_format=True)
        paths.append(path)
    return paths


def _derived_slice(
    source: Dataset, stored: np.ndarray, series_uid: str, number: int, description: str, rescale: tuple[float, float],
    modality: str,
) -> FileDataset:
    sop_class = SOP_CLASSES.get(modality, SecondaryCaptureImageStorage)
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = sop_class
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    out = FileDataset("", Dataset(), file_meta=meta, preamble=b"\0" * 128)
    for keyword in (*PATIENT_AND_STUDY, *FRAME_OF_REFERENCE, "SpecificCharacterSet"):
        if keyword in source:
            setattr(out, keyword, source.data_element(keyword).value)
    out.Modality = modality
    out.SOPClassUID, out.SOPInstanceUID = sop_class, meta.MediaStorageSOPInstanceUID
    out.SeriesInstanceUID, out.SeriesNumber, out.InstanceNumber = series_uid, _new_series_number(source), number
    out.SeriesDescription, out.Manufacturer = description, MANUFACTURER
    out.ImageType = ["DERIVED", "SECONDARY"]
    out.DerivationDescription = f"{description} from series {source.SeriesInstanceUID}"
    out.DerivationCodeSequence = [_code_item(DERIVATION)]
    out.SourceImageSequence = [_source_image(source)]
    out.ReferencedSeriesSequence = [_reference(source)]
    _modality_module(out, source, modality)
    for keyword in (
        "ImagePositionPatient", "ImageOrientationPatient", "PixelSpacing", "SliceThickness", "SliceLocation"
    ):
        if keyword in source:
            setattr(out, keyword, source.data_element(keyword).value)
    out.Rows, out.Columns = stored.shape
    out.SamplesPerPixel, out.PhotometricInterpretation = 1, "MONOCHROME2"
    out.BitsAllocated, out.BitsStored, out.HighBit, out.PixelRepresentation = 16, 16, 15, 1
    out.RescaleSlope, out.RescaleIntercept = f"{rescale[0]:.6e}", f"{rescale[1]:.6f}"
    out.RescaleType = "HU" if modality == "CT" else "US"
    out.PixelData = np.ascontiguousarray(stored).tobytes()
    return out


def _source_image(source: Dataset) -> Dataset:
    """The source slice this slice was made from, and why it is referenced."""
    item = Dataset()
    item.ReferencedSOPClassUID, item.ReferencedSOPInstanceUID = source.SOPClassUID, source.SOPInstanceUID
    item.PurposeOfReferenceCodeSequence = [_code_item(SOURCE_PURPOSE)]
    return item


def _modality_module(out: Dataset, source: Dataset, modality: str) -> None:
    """The attributes the SOP class's image module requires (type 1 given, type 2 present, empty where unknown);
    a source of the same modality lends its acquisition attributes, another modality's would be false."""
    same = source.get("Modality") == modality
    if modality == "CT":
        for keyword in ("KVP", "AcquisitionNumber"):
            setattr(out, keyword, source.data_element(keyword).value if same and keyword in source else None)
    elif modality == "MR":
        # RM: research mode, the defined term for a sequence the scanner did not run.
        for keyword, made_up in (("ScanningSequence", "RM"), ("SequenceVariant", "NONE"), ("ScanOptions", None),
                                 ("MRAcquisitionType", None), ("EchoTime", None), ("EchoTrainLength", None),
                                 ("RepetitionTime", None)):
            setattr(out, keyword, source.data_element(keyword).value if same and keyword in source else made_up)
    else:
        out.ConversionType = "WSD"


def _reference(source: Dataset) -> Dataset:
    item = Dataset()
    item.SeriesInstanceUID = source.SeriesInstanceUID
    return item
