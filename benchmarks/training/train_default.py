"""Times the default `make train` run (VQ-GAN on synthetic phantoms) and reports its quality figures.

    .venv/bin/python benchmarks/training/train_default.py [--repeats N] [hydra overrides ...]

Runs `python train.py` in a fresh temporary directory (plus `logger=[tensorboard,csv]` to read
per-epoch metrics) and prints a Markdown table: wall time of the whole command, val PSNR/SSIM
per epoch, training samples/s and peak host memory from the run's summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import logged_rows, trained  # noqa: E402


def one_run(overrides: list[str]) -> dict:
    with trained(overrides) as (run_dir, wall):
        summary = json.loads((run_dir / "summary.json").read_text())
        rows = logged_rows(run_dir, "val/psnr")
        return {
            "wall": wall,
            "psnr": [float(r["val/psnr"]) for r in rows],
            "ssim": [float(r["val/ssim"]) for r in rows],
            "samples_per_second": summary["samples_per_second"],
            "peak_host_memory_mb": summary["peak_host_memory_mb"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    args, overrides = parser.parse_known_args()
    runs = [one_run(overrides) for _ in range(args.repeats)]
    median = statistics.median
    print(f"runs: {len(runs)}, overrides: {overrides or 'none'}, cores: {os.cpu_count()}")
    print("| figure | value |\n|---|---|")
    print(f"| wall time of `python train.py` (median) | {median(r['wall'] for r in runs):.0f} s |")
    print(f"| training throughput (median) | {median(r['samples_per_second'] for r in runs):.2f} samples/s |")
    print(f"| peak host memory | {max(r['peak_host_memory_mb'] for r in runs):.0f} MiB |")
    first = runs[0]
    print(f"| val PSNR, epoch 1 -> {len(first['psnr'])} | {first['psnr'][0]:.2f} -> {first['psnr'][-1]:.2f} dB |")
    print(f"| val SSIM, epoch 1 -> {len(first['ssim'])} | {first['ssim'][0]:.3f} -> {first['ssim'][-1]:.3f} |")
    print("\nval PSNR per epoch (first run): " + ", ".join(f"{p:.2f}" for p in first["psnr"]))


if __name__ == "__main__":
    main()
