"""Fast-DDPM T1 -> T2 from T1 files alone (`predict.py input=DIR`) against the withheld T2 of unseen phantoms.

    .venv/bin/python benchmarks/generation/predict_condition_only.py [--ckpt CKPT] [--size 16] [--epochs 16]
        [--subjects 8] [--samples 4] [--eta 0.0] [--workdir DIR] [train.py overrides ...]

Without `--ckpt`, trains `python train.py model=ddpm dataset.size=SIZE trainer.max_epochs=EPOCHS` (the
synthetic T1 -> T2 default, 32 phantoms) under `--workdir`. Then writes the T1 of `--subjects` unseen
phantoms (indices 1000 and up: no training subject) as NIfTI files, keeps their T2 aside, and runs
`python predict.py ckpt_path=... input=DIR output_dir=... num_samples=N`. Per subject it scores, in model
units ([-1, 1]: each phantom's own scaling, as the synthetic dataset makes it; data range 2, 3D SSIM
with a 7-voxel window as the run's validation): the first sample, the voxel-wise mean of the N samples,
and the identity baseline (the T1 as the T2 answer); it also prints the mean of the written spread
(`<subject>_sample_std`) and its correlation with the mean's absolute error. `--eta` samples with that
DDIM stochasticity (`+model.eta=`; the model's own, 0, by default).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, table_header  # noqa: E402
from datamodules.sources.phantom import make_phantom, phantom_affine  # noqa: E402
from datamodules.sources.synthetic import MR_PERCENTILE  # noqa: E402


def train(workdir: Path, size: int, epochs: int, extra: list[str]) -> Path:
    run_dir = workdir / "train_run"
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "model=ddpm",
        f"dataset.size={size}",
        f"trainer.max_epochs={epochs}",
        "print_config=false",
        f"hydra.run.dir={run_dir}",
        "callbacks.progress_bar=null",
        *extra,
    ]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    print(f"train.py model=ddpm, {size}^3, {epochs} epochs: {time.perf_counter() - started:.0f} s -> {run_dir}")
    return run_dir / "checkpoints" / "last.ckpt"


def unit(volume: np.ndarray, top: float) -> torch.Tensor:
    """The synthetic dataset's MR scaling: 0 -> -1, `top` -> 1, clipped."""
    return torch.from_numpy(np.clip(volume / top, 0, 1) * 2 - 1).float()[None, None]


def scores(prediction: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    psnr = peak_signal_noise_ratio(prediction, target, data_range=2.0)
    ssim = structural_similarity_index_measure(prediction, target, data_range=2.0, kernel_size=7)
    return float(psnr), float(ssim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=None)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--subjects", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--eta", type=float, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    args, extra = parser.parse_known_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="medvol-condition-only-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt or train(workdir, args.size, args.epochs, extra)

    inputs, out = workdir / "t1", workdir / ("predictions" if args.eta is None else f"predictions-eta{args.eta:g}")
    inputs.mkdir(exist_ok=True)
    shape = (args.size,) * 3
    phantoms = {f"unseen{i:04d}": make_phantom(0, i, shape) for i in range(1000, 1000 + args.subjects)}
    for subject, phantom in phantoms.items():
        nib.save(nib.Nifti1Image(phantom.channels["t1"], phantom_affine(shape, 6.0)), str(inputs / f"{subject}.nii.gz"))
    command = [sys.executable, str(ROOT / "predict.py"), f"ckpt_path={ckpt}", f"input={inputs}", f"output_dir={out}",
               f"num_samples={args.samples}", *([f"+model.eta={args.eta}"] if args.eta is not None else [])]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True)
    print(f"predict.py ({args.subjects} subjects x {args.samples} samples): {time.perf_counter() - started:.1f} s")

    high = torch.load(ckpt, map_location="cpu", weights_only=True)["medvol_data"]["intensity"]["high"][0]
    rows = {"first sample": [], f"mean of {args.samples} samples": [], "identity (T1 as the T2)": []}
    spreads, calibration = [], []
    for subject, phantom in phantoms.items():
        t2, t1 = phantom.channels["t2"], phantom.channels["t1"]
        target = unit(t2, np.percentile(t2, MR_PERCENTILE))
        # The written samples are in the training targets' typical units (0 .. the checkpoint's median top).
        first = unit(nib.load(str(out / f"{subject}_sample_0.nii.gz")).get_fdata(), high)
        mean = unit(nib.load(str(out / f"{subject}_sample_mean.nii.gz")).get_fdata(), high)
        spread = nib.load(str(out / f"{subject}_sample_std.nii.gz")).get_fdata() / high * 2
        rows["first sample"].append(scores(first, target))
        rows[f"mean of {args.samples} samples"].append(scores(mean, target))
        rows["identity (T1 as the T2)"].append(scores(unit(t1, np.percentile(t1, MR_PERCENTILE)), target))
        spreads.append(float(spread.mean()))
        calibration.append(float(np.corrcoef(spread.ravel(), (mean - target).abs().numpy().ravel())[0, 1]))
    print(table_header(["prediction", "PSNR (dB)", "SSIM"]))
    for name, values in rows.items():
        psnr, ssim = np.mean(values, axis=0)
        print(f"| {name} | {psnr:.2f} | {ssim:.3f} |")
    print(f"mean spread (sample std, model units): {np.mean(spreads):.4f}; "
          f"correlation of spread with |mean - target|: {np.mean(calibration):.3f}")


if __name__ == "__main__":
    main()
