"""DICOM round trips through medvol's dataset transforms and prediction writer, with an identity model.

    PYTHONPATH=$PWD python benchmarks/data/dicom_round_trip.py

A 22 x 13 x 18 phantom written as a shuffled, oblique (12 degrees), anisotropic (1.2 x 0.9 x 2.5 mm) series with
intercept -1024 and, as an independent copy, SimpleITK's NIfTI export of it. Each goes through the same
preprocessing (RAS, the native spacing or resampled to 1.5 mm, percentile scaling to [-1, 1]); the identity
model's output is written with `output_format=both`. Figures (max absolute differences): the two model-grid inputs; the
two NIfTI outputs; the derived DICOM series read back against the NIfTI output; a two-segment DICOM-SEG of the
model-grid thresholds read back with highdicom against the thresholds of SimpleITK's values (voxels that differ).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import SimpleITK as sitk
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from datamodules.sources.nifti import NiftiDataModule
from datamodules.sources.phantom import make_phantom
from medvol.volumes.dicom_io import read_series
from medvol.volumes.prediction_writer import PredictionWriter
from tests.dicom_series import oblique_orientation, write_series

SHAPE = (22, 13, 18)
SPACINGS = {"native": None, "1.5 mm": [1.5, 1.5, 1.5]}


def batch_of(root: Path, pattern: str, spacing: list[float] | None) -> dict:
    settings = {"orientation": "RAS", "spacing": spacing, "intensity": "percentile", "spatial_size": None}
    datamodule = NiftiDataModule(root=str(root), pattern=pattern, transforms=settings, num_workers=0)
    return torch.utils.data.default_collate([datamodule.build_dataset(datamodule.subjects(), "test")[0]])


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        values = np.rint(make_phantom(0, 3, SHAPE).channels["t1"] * 1000).astype(np.int16)
        folder = root / "dicom" / "s01" / "image"
        write_series(folder, values.transpose(1, 0, 2) + 1024, oblique_orientation(12.0), spacing=(0.9, 1.2), step=2.5,
                     origin=(30.0, 21.0, -40.0), intercept=-1024.0, seed=5)
        reader = sitk.ImageSeriesReader()
        names = reader.GetGDCMSeriesFileNames(str(folder))
        reader.SetFileNames(names)
        reference = reader.Execute()
        (root / "nifti" / "s01").mkdir(parents=True)
        sitk.WriteImage(reference, str(root / "nifti" / "s01" / "image.nii.gz"))
        for label, spacing in SPACINGS.items():
            from_dicom = batch_of(root / "dicom", "{subject}/{modality}", spacing)
            from_nifti = batch_of(root / "nifti", "{subject}/{modality}.nii.gz", spacing)
            print(f"spacing {label}: model-grid input, DICOM vs NIfTI: "
                  f"{float((from_dicom['image'] - from_nifti['image']).abs().max()):.3g} "
                  f"(affine {float((from_dicom['affine'] - from_nifti['affine']).abs().max()):.3g} mm)")
            out_dicom, out_nifti = root / f"out_dicom_{spacing is None}", root / f"out_nifti_{spacing is None}"
            PredictionWriter(out_dicom, output_format="both").write(
                {"volumes": {"reconstruction": from_dicom["image"]}}, from_dicom
            )
            PredictionWriter(out_nifti).write({"volumes": {"reconstruction": from_nifti["image"]}}, from_nifti)
            a = nib.load(str(out_dicom / "s01_reconstruction.nii.gz"))
            b = nib.load(str(out_nifti / "s01_reconstruction.nii.gz"))
            print(
                f"spacing {label}: NIfTI output, DICOM input vs NIfTI input: "
                f"{np.abs(a.get_fdata() - b.get_fdata()).max():.3g} (range {np.ptp(b.get_fdata()):.0f}; affine "
                f"{np.abs(a.affine - b.affine).max():.3g} mm)"
            )
        series, geometry = read_series(out_dicom / "s01_reconstruction")
        print(f"derived series read back vs NIfTI output: {np.abs(series - a.get_fdata()).max():.3g} "
              f"(RescaleSlope {float(geometry.first.RescaleSlope):.3g}; affine "
              f"{np.abs(geometry.affine - a.affine).max():.3g} mm)")
        seg = (from_dicom["image"] > -0.5).long() + (from_dicom["image"] > 0.2).long()
        # Thresholds back in HU: the writer maps the model grid onto the source slices by nearest neighbour.
        PredictionWriter(root / "out_seg", output_format="dicom").write(
            {"volumes": {"seg": seg}, "segments": {"head": [1, 2], "bright": [2]}}, from_dicom)
        written = hd.seg.segread(root / "out_seg" / "s01_seg.dcm")
        instances = [str(pydicom.dcmread(n, stop_before_pixels=True).SOPInstanceUID) for n in names]
        frames = written.get_pixels_by_source_instance(source_sop_instance_uids=instances, segment_numbers=[1, 2])
        nifti_seg = root / "out_seg_nifti"
        PredictionWriter(nifti_seg).write({"volumes": {"seg": seg}}, from_dicom)
        mask = np.asarray(nib.load(str(nifti_seg / "s01_seg.nii.gz")).dataobj).transpose(2, 1, 0)
        wrong = int(((frames[..., 0] > 0) != (mask >= 1)).sum() + ((frames[..., 1] > 0) != (mask == 2)).sum())
        print(f"DICOM-SEG read back vs the NIfTI mask on the source grid: {wrong} of {2 * mask.size} voxels differ; "
              f"{written.NumberOfFrames} frames stored of {2 * mask.shape[0]}")


if __name__ == "__main__":
    main()
