"""A VQ-GAN trained as `make train` trains it reconstructs an unseen whole scan at its training spacing vs the scan's
own.

    .venv/bin/pip install --no-deps nilearn     # only its bundled MNI152 template (a real head) is read
    .venv/bin/python benchmarks/data/predict_whole_volume.py [--ckpt CKPT] [--epochs 16] [--workdir DIR]
        [--scan head|phantom]
        [--overlap 0.25] [predict.py overrides ...]

Without `--ckpt`, trains `python train.py` with the defaults (`make train`: the VQ-GAN on synthetic
32^3 phantoms at 6 mm; `--epochs` changes only `trainer.max_epochs`) under `--workdir`. Then writes an
unseen scan as an int16 NIfTI on an LPS-oriented, anisotropic grid:

- `head` (default): real anatomy, the MNI152 2009a T1 template nilearn ships (1 mm, 197x233x189),
  resampled by nibabel to 2 x 2 x 3 mm over the same field of view (99x117x63), scaled to 0..1020;
- `phantom`: phantom index 1000 (no training subject) on a 96x120x100 grid of 1.5 x 1.25 x 1.8 mm.

and runs `python predict.py ckpt_path=... input=FILE output_dir=...` twice: `spacing=native` (the scan's
own voxels, what predict.py did before the training spacing travelled with the model) and the default
(resampled to the spacing recorded in the checkpoint, outputs mapped back onto the scan's grid). For each
it prints the output's grid against the source, the Pearson correlation and PSNR of output vs source on
the source grid in source units (data range: the source's), predict.py's own PSNR/SSIM (model units, data
range 2, against the model's input, so they differ in what they compare) and the wall time.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np
from nibabel.processing import resample_from_to

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT  # noqa: E402
from datamodules.sources.phantom import make_phantom  # noqa: E402

PHANTOM_SHAPE = (96, 120, 100)
# x and y flipped (LPS), anisotropic voxels: a scanner export, not the training grid.
PHANTOM_AFFINE = np.array([[-1.5, 0, 0, 72.0], [0, -1.25, 0, 75.0], [0, 0, 1.8, -90.0], [0, 0, 0, 1]])
HEAD_SHAPE = (99, 117, 63)
# The template's field of view (x -98..98, y -134..98, z -72..116 mm) in 2 x 2 x 3 mm LPS voxels.
HEAD_AFFINE = np.array([[-2.0, 0, 0, 98.0], [0, -2.0, 0, 98.0], [0, 0, 3.0, -72.0], [0, 0, 0, 1]])
TEMPLATE = "datasets/data/mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz"


def train(workdir: Path, epochs: int) -> Path:
    run_dir = workdir / "train_run"
    command = [sys.executable, str(ROOT / "train.py"), f"trainer.max_epochs={epochs}", "print_config=false",
               f"hydra.run.dir={run_dir}", "callbacks.progress_bar=null"]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    print(f"train.py ({epochs} epochs, defaults): {time.perf_counter() - started:.0f} s -> {run_dir}")
    return run_dir / "checkpoints" / "last.ckpt"


def template_path() -> Path:
    """nilearn's bundled MNI152 T1 template, found without importing nilearn (a --no-deps install is enough)."""
    spec = importlib.util.find_spec("nilearn")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "the head scan is nilearn's MNI152 template: .venv/bin/pip install --no-deps nilearn (or --scan phantom)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / TEMPLATE


def write_scan(kind: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "head":
        template = nib.load(str(template_path()))
        head = resample_from_to(template, (HEAD_SHAPE, HEAD_AFFINE), order=1)
        data, affine = np.clip(head.get_fdata(), 0, None) * 4, HEAD_AFFINE
    else:
        # Phantom index 1000: no training subject (the default run uses 0..31).
        data, affine = make_phantom(0, 1000, PHANTOM_SHAPE).channels["t1"] * 1000, PHANTOM_AFFINE
    nib.save(nib.Nifti1Image(np.rint(data).astype(np.int16), affine), str(path))


def predict(ckpt: Path, scan: Path, out: Path, overlap: float, extra: list[str]) -> float:
    command = [sys.executable, str(ROOT / "predict.py"), f"ckpt_path={ckpt}", f"input={scan}", f"output_dir={out}",
               f"overlap={overlap}", *extra]
    started = time.perf_counter()
    result = subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True)
    print("  " + result.stdout.strip().splitlines()[-1])
    return time.perf_counter() - started


def report(scan: Path, out: Path, seconds: float) -> None:
    stem = scan.name.removesuffix(".nii.gz")
    source, written = nib.load(str(scan)), nib.load(str(out / f"{stem}_reconstruction.nii.gz"))
    raw, output = source.get_fdata(), written.get_fdata()
    correlation = float(np.corrcoef(raw.ravel(), output.ravel())[0, 1])
    span = float(raw.max() - raw.min())
    psnr = 10 * np.log10(span**2 / float(np.mean((output - raw) ** 2)))
    print(f"  output {written.shape} {''.join(nib.aff2axcodes(written.affine))} spacing {written.header.get_zooms()} "
          f"range [{output.min():.0f}, {output.max():.0f}] dtype {written.get_data_dtype()}; "
          "same shape and affine as the source: "
          f"{written.shape == source.shape and np.allclose(written.affine, source.affine)}")
    print(
        f"  on the source grid, source units: correlation {correlation:.3f}, PSNR {psnr:.2f} dB (data range {span:.0f})"
    )
    with (out / "metrics.csv").open() as handle:
        for row in csv.DictReader(handle):
            print(
                f"  predict.py (model units, vs the model's input): PSNR {float(row['psnr']):.2f} dB, SSIM "
                f"{float(row['ssim']):.3f}"
            )
    print(
        f"  predict.py wall time {seconds:.1f} s (process start, model load, preprocessing, sliding windows, writing)"
    )


def resampling_ceiling(scan: Path, spacing: float) -> float:
    """The correlation an identity model would reach through the round trip alone: the scan resampled to
    `spacing` mm (nibabel, linear) and back onto its own grid."""
    source = nib.load(str(scan))
    extent = np.asarray(source.shape) * np.asarray(source.header.get_zooms()[:3])
    shape = tuple(int(n) for n in np.ceil(extent / spacing))
    coarse = resample_from_to(
        source, (shape, source.affine @ np.diag([*(spacing / np.asarray(source.header.get_zooms()[:3])), 1])), order=1
    )
    back = resample_from_to(coarse, source, order=1).get_fdata()
    return float(np.corrcoef(source.get_fdata().ravel(), back.ravel())[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=None)
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--scan", choices=("head", "phantom"), default="head")
    parser.add_argument("--overlap", type=float, default=0.25)
    args, extra = parser.parse_known_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="medvol-predict-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt or train(workdir, args.epochs)

    scan = workdir / "unseen" / f"{args.scan}.nii.gz"
    write_scan(args.scan, scan)
    source = nib.load(str(scan))
    print(f"source {source.shape} {''.join(nib.aff2axcodes(source.affine))} spacing {source.header.get_zooms()} "
          f"int16 range [{source.get_fdata().min():.0f}, {source.get_fdata().max():.0f}]")
    print(f"an identity model through the 6 mm round trip alone would correlate {resampling_ceiling(scan, 6.0):.3f}")
    for name, spacing in (("the scan's own grid (spacing=native)", ["spacing=native"]),
                          ("the training spacing from the checkpoint (default)", [])):
        print(name)
        out = workdir / f"predictions-{args.scan}-{'native' if spacing else 'trained'}"
        report(scan, out, predict(ckpt, scan, out, args.overlap, [*spacing, *extra]))


if __name__ == "__main__":
    main()
