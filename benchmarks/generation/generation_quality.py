"""Generation quality on real anatomy: the set metrics of real, collapsed and generated brains, and the CPU presets of
the latent diffusion model and Fast-DDPM trained on the MNI152 BraTS-layout brains as a user types them.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/generation/generation_quality.py --out DIR [--subjects 60]
        [--spacing 4 4 4] [--runs table ldm ddpm] [--ddpm-epochs N]

The data: `datamodules.sources.brain_lesions.write_brain_lesions` (the MNI152 brain with lesions, BraTS-2021
case folders, issue 28's real anatomy), written once under `DIR/data-<n>s-<spacing>mm`.

- `table`: the generation metrics (`lightning_modules/diffusion/generation_metrics.py`) of sets of T1 volumes in
  model units at the LDM preset's grid (6 mm, 32^3: `conf/experiment_data/ldm_cpu_brats.yaml`), each against the
  test subjects, the training subjects the reference: the validation subjects (independent real draws: the
  floor), the training set's mean volume repeated and one training volume repeated (mode collapse), and training
  volumes given back (a copy).
- `ldm`: `python train.py experiment=ldm_cpu dataset=brats dataset.root=DATA dataset.image_modalities=[t1]
  dataset.label=false` (VQ-GAN, then the LDM; test on the held-out subjects).
- `ddpm`: `python train.py model=ddpm dataset=brats ... image t2, cond t1` at the same grid (Fast-DDPM's CPU
  default, T1 -> T2 translation), test=true; `--ddpm-epochs N` sets its `trainer.max_epochs` (default: the
  trainer's 16).

Each run's test metrics (samples of the test subjects against the real test volumes) come from its summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, split_images, table_header  # noqa: E402

# The brains at the LDM CPU preset's grid (conf/experiment_data/ldm_cpu_brats.yaml), for every run here.
GRID = ["dataset.transforms.spacing=[6.0,6.0,6.0]", "dataset.transforms.spatial_size=[32,32,32]"]
SET_METRICS = ("mmd", "sample_msssim", "real_msssim", "nearest_train_corr", "real_nearest_train_corr",
               "closer_than_real")


def data_folder(out: Path, subjects: int, spacing: list[float], seed: int) -> Path:
    from datamodules.sources.brain_lesions import write_brain_lesions

    root = out / f"data-{subjects}s-{'x'.join(f'{s:g}' for s in spacing)}mm"
    if not (root / "complete").is_file():
        write_brain_lesions(root, subjects, spacing, seed=seed)
        (root / "complete").write_text("written\n")
    return root


def train(out: Path, name: str, overrides: list[str]) -> tuple[dict[str, float], float]:
    """`python train.py <overrides>` in `out/name` (already done: read back); its final metrics and wall time."""
    run_dir = out / name
    summary = run_dir / "summary.json"
    cascade = run_dir / "cascade_summary.json"
    if not (summary.is_file() or cascade.is_file()):
        began = time.perf_counter()
        command = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
        with (out / f"{name}.log").open("w") as log:
            subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                           env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        (run_dir / "wall_s.txt").write_text(f"{time.perf_counter() - began:.0f}\n")
    wall = float((run_dir / "wall_s.txt").read_text()) if (run_dir / "wall_s.txt").is_file() else float("nan")
    if cascade.is_file():
        stages = json.loads(cascade.read_text())
        last = stages[sorted(stages)[-1]]
        metrics = dict(last["metrics"])
        first = json.loads((run_dir / "stage1" / "summary.json").read_text())["metrics"]
        metrics.update({f"stage1/{k}": v for k, v in first.items()})
        return metrics, wall
    return json.loads(summary.read_text())["metrics"], wall


def model_unit_sets(data: Path, split_file: Path):
    """(training, validation, test) T1 volumes in model units at the preset's grid, by the run's own transforms."""
    return split_images(["experiment=ldm_cpu", "dataset=brats", f"dataset.root={data}", "dataset.image_modalities=[t1]",
                         "dataset.label=false", f"dataset.split_file={split_file}", "dataset.cache=none",
                         "dataset.num_workers=0", "paths.output_dir=/tmp", *GRID])


def set_row(name: str, generated, real, reference) -> str:
    from lightning_modules.diffusion.generation_metrics import generation_metrics

    metrics = generation_metrics(16, 32, 5)
    for metric in metrics.values():
        if hasattr(metric, "reference"):
            metric.reference = reference
    metrics["mmd"].update(generated, real)
    metrics["closer_than_real"].update(generated, real)
    metrics["sample_msssim"].update(generated)
    metrics["real_msssim"].update(real)
    metrics["nearest_train_corr"].update(generated)
    metrics["real_nearest_train_corr"].update(real)
    values = {k: float(metrics[k].compute()) for k in SET_METRICS}
    return f"| {name} | {len(generated)} | " + " | ".join(f"{values[k]:.3f}" for k in SET_METRICS) + " |"


def table(data: Path, out: Path) -> list[str]:
    from lightning_modules.diffusion.generation_metrics import pooled

    train_set, val_set, test_set = model_unit_sets(data, out / "ldm_cpu" / "split.json")
    reference = pooled(train_set, 16)
    count = len(test_set)
    mean = train_set.mean(0, keepdim=True)
    rows = [
        ("independent real draws (validation subjects)", val_set),
        ("collapsed: the training mean volume, repeated", mean.expand(count, -1, -1, -1, -1)),
        ("collapsed: one training volume, repeated", train_set[:1].expand(count, -1, -1, -1, -1)),
        ("a copy: training volumes given back", train_set[:count]),
    ]
    return [set_row(name, generated, test_set, reference) for name, generated in rows]


def run_row(name: str, metrics: dict[str, float], wall: float, prefix: str = "test/") -> str:
    values = [metrics.get(f"{prefix}{k}", float("nan")) for k in SET_METRICS]
    return f"| {name} ({wall:.0f} s) | - | " + " | ".join(f"{v:.3f}" for v in values) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/generation-quality"))
    parser.add_argument("--subjects", type=int, default=60)
    parser.add_argument("--spacing", type=float, nargs=3, default=[4.0, 4.0, 4.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", nargs="+", default=["ldm", "ddpm", "table"], choices=["ldm", "ddpm", "table"])
    parser.add_argument("--ddpm-epochs", type=int, help="the Fast-DDPM run's trainer.max_epochs (default 16)")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = data_folder(out, args.subjects, args.spacing, args.seed)
    brats = ["dataset=brats", f"dataset.root={data}", "dataset.label=false", "logger=csv"]
    lines = [table_header(["set (against the test subjects)", "volumes", *SET_METRICS])]
    others = []
    if "ldm" in args.runs:
        metrics, wall = train(out, "ldm_cpu", ["experiment=ldm_cpu", *brats, "dataset.image_modalities=[t1]"])
        lines.append(run_row("LDM samples, experiment=ldm_cpu", metrics, wall))
        others.append(f"ldm_cpu: VQ-GAN test PSNR {metrics.get('stage1/test/psnr', float('nan')):.2f} dB, "
                      f"reconstruction {metrics.get('test/recon_psnr', float('nan')):.2f} dB, "
                      f"reconstruction MMD {metrics.get('test/recon_mmd', float('nan')):.3f}, "
                      f"two draws' MS-SSIM {metrics.get('test/diversity_msssim', float('nan')):.3f}")
    if "ddpm" in args.runs:
        epochs = [] if args.ddpm_epochs is None else [f"trainer.max_epochs={args.ddpm_epochs}"]
        metrics, wall = train(out, "fast_ddpm", ["model=ddpm", *brats, "dataset.image_modalities=[t2]",
                                                 "dataset.cond_modalities=[t1]", "dataset.batch_size=2", "test=true",
                                                 *GRID, *epochs])
        lines.append(run_row("Fast-DDPM T1 -> T2 samples, model=ddpm", metrics, wall))
        others.append(f"fast_ddpm: test PSNR {metrics.get('test/psnr', float('nan')):.2f} dB, "
                      f"SSIM {metrics.get('test/ssim', float('nan')):.3f}")
    if "table" in args.runs:
        lines[2:2] = table(data, out)
    text = "\n".join([*lines, "", *others])
    print(text)
    (out / "results.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
