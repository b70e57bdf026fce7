"""The predict "done when": a VQ-GAN trained as `make train` trains it reconstructs a whole 96x120x100 LPS volume.

    .venv/bin/python benchmarks/predict_whole_volume.py [--ckpt CKPT] [--epochs 16] [--workdir DIR] [--overlap 0.25]
        [--spacing MM] [predict.py overrides ...]

Without `--ckpt`, trains `python train.py` with the defaults (`make train`: the VQ-GAN on synthetic
32^3 phantoms; `--epochs` changes only `trainer.max_epochs`) under `--workdir`. Then writes an
unseen phantom as an int16 NIfTI of 96x120x100 voxels on an LPS-oriented, anisotropic grid, runs
`python predict.py ckpt_path=... input=FILE output_dir=...` on it (32^3 sliding windows, Gaussian
blending) and prints the output's shape, affine and value range against the source, the PSNR and
SSIM predict.py reports (model units, data range 2), and the wall time of each step. `--spacing MM`
resamples the scan to MM-mm voxels before the model (`+dataset.transforms.spacing`), e.g. the
phantoms' training spacing (6 mm); the output still lands on the scan's own grid.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datamodules.sources.phantom import make_phantom  # noqa: E402

SHAPE = (96, 120, 100)
# x and y flipped (LPS), anisotropic voxels: a scanner export, not the training grid.
LPS_AFFINE = np.array([[-1.5, 0, 0, 72.0], [0, -1.25, 0, 75.0], [0, 0, 1.8, -90.0], [0, 0, 0, 1]])


def train(workdir: Path, epochs: int) -> Path:
    run_dir = workdir / "train_run"
    command = [sys.executable, str(ROOT / "train.py"), f"trainer.max_epochs={epochs}", "print_config=false",
               f"hydra.run.dir={run_dir}", "callbacks.progress_bar=null"]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    print(f"train.py ({epochs} epochs, defaults): {time.perf_counter() - started:.0f} s -> {run_dir}")
    return run_dir / "checkpoints" / "last.ckpt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=None)
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--overlap", type=float, default=0.25)
    parser.add_argument("--spacing", type=float, default=None)
    args, extra = parser.parse_known_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="medvol-predict-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt or train(workdir, args.epochs)

    scan = workdir / "unseen" / "head.nii.gz"
    scan.parent.mkdir(parents=True, exist_ok=True)
    # Phantom index 1000: no training subject (the default run uses 0..31).
    phantom = make_phantom(0, 1000, SHAPE)
    nib.save(nib.Nifti1Image((phantom.channels["t1"] * 1000).astype(np.int16), LPS_AFFINE), str(scan))

    out = workdir / ("predictions" if not args.spacing else f"predictions-{args.spacing:g}mm")
    command = [sys.executable, str(ROOT / "predict.py"), f"ckpt_path={ckpt}", f"input={scan}", f"output_dir={out}",
               f"overlap={args.overlap}", *extra]
    if args.spacing:
        command.append(f"+dataset.transforms.spacing=[{args.spacing},{args.spacing},{args.spacing}]")
    started = time.perf_counter()
    result = subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    print(result.stdout.strip().splitlines()[-1])
    print(f"predict.py: {seconds:.1f} s (process start, model load, preprocessing, sliding windows, writing)")

    source, written = nib.load(str(scan)), nib.load(str(out / "head_reconstruction.nii.gz"))
    print(f"source  {source.shape} {nib.aff2axcodes(source.affine)} spacing {source.header.get_zooms()} "
          f"range [{source.get_fdata().min():.0f}, {source.get_fdata().max():.0f}]")
    print(f"output  {written.shape} {nib.aff2axcodes(written.affine)} spacing {written.header.get_zooms()} "
          f"range [{written.get_fdata().min():.0f}, {written.get_fdata().max():.0f}] dtype {written.get_data_dtype()}")
    print(f"same shape: {written.shape == source.shape}, same affine: {np.allclose(written.affine, source.affine)}")
    with (out / "metrics.csv").open() as handle:
        for row in csv.DictReader(handle):
            print(f"{row['subject']}: PSNR {float(row['psnr']):.2f} dB, SSIM {float(row['ssim']):.3f}")


if __name__ == "__main__":
    main()
