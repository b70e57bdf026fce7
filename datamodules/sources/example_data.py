"""Write the synthetic phantoms as real on-disk layouts (NIfTI folder, BraTS 2021/2023, MACE CSV, CTs with radiographs).

Lets anyone try the file-based datasets, the data doctor, the pipeline benchmark and predicting a
CT from radiographs without downloading data:
`python -m datamodules.sources.example_data brats2023 /tmp/brats --subjects 8 --size 32`,
`python -m datamodules.sources.example_data xray_ct /tmp/xr --subjects 4 --size 32 --seed 7`.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

from datamodules.sources.phantom import lesion_class, make_phantom, phantom_affine
from datamodules.sources.synthetic import phantom_radiographs
from medvol.volumes.projection import VIEW_AXES, VIEW_FRAME, view_pixel_spacing

BRATS_SUFFIXES = {
    2021: {"t1": "_t1", "t1ce": "_t1ce", "t2": "_t2", "flair": "_flair", "seg": "_seg"},
    2023: {"t1": "-t1n", "t1ce": "-t1c", "t2": "-t2w", "flair": "-t2f", "seg": "-seg"},
}
# Phantom labels (1 core, 2 oedema) as BraTS labels: the core's interior -> necrotic core (NCR, 1), its rim (one voxel)
# -> enhancing tumour (ET: 4 in 2021, 3 in 2023), as a ring enhances around necrosis; oedema -> ED (2).
BRATS_NECROTIC = 1
BRATS_OEDEMA = 2
BRATS_ENHANCING = {2021: 4, 2023: 3}


def _shape(size: int | Sequence[int]) -> tuple[int, int, int]:
    return (int(size),) * 3 if isinstance(size, int) else tuple(int(s) for s in size)  # type: ignore[return-value]


def write_volume(path: Path, volume: np.ndarray, affine: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(volume, affine), str(path))
    return path


def write_nifti_folder(
    root: Path, subjects: int, size: int | Sequence[int] = 32, modalities: Sequence[str] = ("ct",),
    label: bool = True, spacing: float = 2.0, seed: int = 0,
) -> Path:
    """`root/sub-NNN/<modality>.nii.gz` (+ `label.nii.gz`)."""
    shape = _shape(size)
    affine = phantom_affine(shape, spacing)
    for i in range(subjects):
        phantom = make_phantom(seed, i, shape)
        folder = Path(root) / f"sub-{i:03d}"
        for modality in modalities:
            write_volume(folder / f"{modality}.nii.gz", phantom.channels[modality], affine)
        if label:
            write_volume(folder / "label.nii.gz", phantom.label.astype(np.uint8), affine)
    return Path(root)


def brats_labels(label: np.ndarray, year: int) -> np.ndarray:
    """A phantom's label map (1 core, 2 oedema) in BraTS's values: the core's interior necrotic, its rim enhancing."""
    core = label == 1
    necrotic = ndimage.binary_erosion(core)
    seg = np.zeros(label.shape, dtype=np.uint8)
    seg[label == 2] = BRATS_OEDEMA
    seg[core] = BRATS_ENHANCING[year]
    seg[necrotic] = BRATS_NECROTIC
    return seg


def write_brats(root: Path, subjects: int, year: int = 2023, size: int | Sequence[int] = 32, seed: int = 0) -> Path:
    """BraTS case folders: 2021 `BraTS2021_00000/BraTS2021_00000_t1.nii.gz`, 2023
    `BraTS-GLI-00000-000/...-t1n.nii.gz`."""
    shape = _shape(size)
    affine = phantom_affine(shape, 1.0)
    suffixes = BRATS_SUFFIXES[year]
    for i in range(subjects):
        phantom = make_phantom(seed, i, shape)
        case = f"BraTS2021_{i:05d}" if year == 2021 else f"BraTS-GLI-{i:05d}-000"
        for modality, suffix in suffixes.items():
            if modality == "seg":
                write_volume(Path(root) / case / f"{case}{suffix}.nii.gz", brats_labels(phantom.label, year), affine)
            else:
                write_volume(Path(root) / case / f"{case}{suffix}.nii.gz", phantom.channels[modality] * 1000, affine)
    return Path(root)


def write_mace_csv(root: Path, subjects: int, size: int | Sequence[int] = 32, seed: int = 0) -> Path:
    """`root/images/ct_NNN.nii.gz` and `root/mace.csv` (subject, image, time, event, age, sex, label)."""
    shape = _shape(size)
    affine = phantom_affine(shape, 2.0)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(subjects):
        phantom = make_phantom(seed, i, shape)
        write_volume(Path(root) / "images" / f"ct_{i:03d}.nii.gz", phantom.channels["ct"], affine)
        rows.append({
            "subject": f"patient-{i:03d}", "image": f"images/ct_{i:03d}.nii.gz", "time": f"{phantom.time:.2f}",
            "event": phantom.event, "age": int(rng.integers(40, 85)), "sex": int(rng.integers(0, 2)),
            "label": lesion_class(seed, i),
        })
    table = Path(root) / "mace.csv"
    with table.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return table


def radiograph_affine(view: str, row_mm: float, column_mm: float, extent: Sequence[float]) -> np.ndarray:
    """The RAS affine of a 2D `view` file in the projector's display convention (`VIEW_FRAME`): rows toward the feet,
    columns toward the patient's left (AP) or back (lateral), the third axis along the beam (AP front to back,
    lateral right to left); pixel (0, 0) at the head and the patient's right (AP) or front (lateral) of the field of
    view `extent` (x, y, z mm), which is centred on the origin."""
    affine = np.eye(4)
    affine[:3, :3] = 0.0
    (row_axis, row_sign), (column_axis, column_sign) = VIEW_FRAME[view]
    affine[row_axis, 0], affine[column_axis, 1] = row_sign * row_mm, column_sign * column_mm
    affine[VIEW_AXES[view], 2] = -1.0
    affine[row_axis, 3] = -row_sign * (float(extent[row_axis]) - row_mm) / 2
    affine[column_axis, 3] = -column_sign * (float(extent[column_axis]) - column_mm) / 2
    return affine


def write_xray_ct(
    root: Path, subjects: int, size: int = 32, field_of_view: float = 192.0, xray_size: Sequence[int] = (32, 32),
    mu_water: float = 0.02, seed: int = 0, xray_grid: int = 64,
) -> Path:
    """`root/<subject>_ct.nii.gz` (HU, RAS, centred) with `<subject>_ap.nii.gz` and `<subject>_lateral.nii.gz` beside
    it.

    The radiographs are what `dataset=synthetic dataset.views=[ap,lateral]` computes from the same
    phantom (`datamodules.sources.synthetic.phantom_radiographs`: the phantom at `xray_grid`^3 over the
    field of view, whatever `size`, projected with `medvol.volumes.projection.radiographs`),
    stored as 1 - I/I0 in [0, 1) in the projector's display convention (rows from head to feet, AP
    columns from the patient's right to left, lateral from front to back), with their pixel spacing
    and that orientation in the header (a 2D RAS affine, `radiograph_affine`).
    The phantom fills the `field_of_view` (mm), as the synthetic dataset's does at any size, so
    the views of a 16^3 and a 32^3 phantom cover the same body.
    """
    shape = _shape(size)
    spacing = field_of_view / shape[0]
    affine = phantom_affine(shape, spacing)
    rows, columns = (int(s) for s in xray_size)
    extent = [n * spacing for n in shape]
    for i in range(subjects):
        ct = make_phantom(seed, i, shape).channels["ct"]
        subject = f"phantom-{seed}-{i:04d}"  # the name dataset=synthetic gives the same phantom
        write_volume(Path(root) / f"{subject}_ct.nii.gz", ct, affine)
        views = phantom_radiographs(
            seed, i, extent, ["ap", "lateral"], (rows, columns), mu_water, xray_grid, (0.0, 1.0)
        )
        for name, view in zip(("ap", "lateral"), views, strict=True):
            pixels = radiograph_affine(name, *view_pixel_spacing(name, extent, (rows, columns)), extent)
            write_volume(Path(root) / f"{subject}_{name}.nii.gz", view.numpy().astype(np.float32), pixels)
    return Path(root)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layout", choices=["nifti", "brats2021", "brats2023", "mace", "xray_ct"])
    parser.add_argument("root", type=Path)
    parser.add_argument("--subjects", type=int, default=8)
    parser.add_argument("--size", type=int, nargs="+", default=[32])
    parser.add_argument("--seed", type=int, default=0, help="phantom seed (xray_ct; the training phantoms use 0..)")
    parser.add_argument("--xray-size", type=int, nargs=2, default=[32, 32], help="radiograph rows, columns (xray_ct)")
    args = parser.parse_args(argv)
    size = args.size[0] if len(args.size) == 1 else args.size
    if args.layout == "nifti":
        write_nifti_folder(args.root, args.subjects, size)
    elif args.layout == "xray_ct":
        write_xray_ct(args.root, args.subjects, args.size[0], xray_size=args.xray_size, seed=args.seed)
    elif args.layout == "mace":
        write_mace_csv(args.root, args.subjects, size)
    else:
        write_brats(args.root, args.subjects, int(args.layout[-4:]), size)
    print(f"wrote {args.subjects} {args.layout} subjects under {args.root}")


if __name__ == "__main__":
    main()
