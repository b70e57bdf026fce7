"""X-ray-to-CT on CPU: the whole cascade from one command, per-stage quality against a back-projection baseline.

Runs `python train.py experiment=xray2ct_cascade test=true` (synthetic CT phantoms and their
DRR views), then reads each stage's test physics loss, training speed and peak memory, and on the
same test subjects compares three CTs with the true one at each stage's size: the stage's own
(generated from its best.ckpt as the test generates it), the mean of the two views'
back-projections (`medvol.volumes.projection.back_project`), windowed like the CT, and, from
stage 2, the identity baseline: stage k-1's own output (same noise) upsampled trilinearly to stage
k's grid. PSNR/SSIM over the cube and, over the body (true CT > -500 HU), PSNR, SSIM and MAE in
HU, all on one HU scale (`COMMON_WINDOW`), so runs with other CT windows compare.

    python benchmarks/generation/xray2ct_cascade.py [--out DIR] [extra train.py overrides ...]
    python benchmarks/generation/xray2ct_cascade.py --out DIR --report-only --overlaps 0 0.25 0.5 0.75  # overlaps

`--overlaps` then generates the last stage's test CTs through the whole cascade once per overlap of the sampling
windows (every windowed stage's), and prints the windows a step, the CPU time (one thread) and the figures of each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import default_collate
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
import medvol.run.resolvers  # noqa: E402, F401 - the stage configs use medvol's resolvers
from benchmarks.common import ROOT, table_header  # noqa: E402
from lightning_modules.xray2ct.body_metrics import BodyMAE, BodyPSNR, BodySSIM, to_hounsfield  # noqa: E402
from lightning_modules.xray2ct.module import XrayToCT, as_size  # noqa: E402
from lightning_modules.xray2ct.stage_settings import window_of  # noqa: E402
from medvol.core.build import build  # noqa: E402
from medvol.volumes.intensity import scale_to_range  # noqa: E402
from medvol.volumes.projection import back_project, voxel_spacing  # noqa: E402
from medvol.volumes.sliding_window import SlidingWindow  # noqa: E402

# Every figure is taken on one HU scale, whatever window a run mapped onto [-1, 1], so runs with other windows
# compare: the 12-bit CT range (PSNR's peak and SSIM's data range are its width, 4095 HU).
COMMON_WINDOW = (-1024.0, 3071.0)


def common_units(volume: torch.Tensor, window: tuple[float, float]) -> torch.Tensor:
    """A volume in a run's model units -> HU (unclamped) -> [-1, 1] over `COMMON_WINDOW` (unclamped)."""
    hounsfield = to_hounsfield(volume, window)
    return (hounsfield - COMMON_WINDOW[0]) / (COMMON_WINDOW[1] - COMMON_WINDOW[0]) * 2 - 1


def figures(guess: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """PSNR/SSIM over the cube, and over the body (true CT > -500 HU) PSNR, SSIM and MAE in HU, per subject averaged
    for the cube, over the body voxels of every subject for the body."""
    body = {"mae": BodyMAE(COMMON_WINDOW), "body_psnr": BodyPSNR(COMMON_WINDOW), "body_ssim": BodySSIM(COMMON_WINDOW)}
    psnr, ssim = [], []
    for g, t in zip(guess, target, strict=True):
        psnr.append(float(peak_signal_noise_ratio(g[None], t[None], data_range=2.0)))
        ssim.append(float(structural_similarity_index_measure(g[None], t[None], data_range=2.0, kernel_size=5)))
        for metric in body.values():
            metric.update(g[None], t[None])
    return {
        "psnr": sum(psnr) / len(psnr),
        "ssim": sum(ssim) / len(ssim),
        **{k: float(m.compute()) for k, m in body.items()},
    }


def test_batch(stage_dir: Path) -> tuple[dict, dict]:
    """The stage's run config and its whole test split as one batch."""
    cfg = OmegaConf.load(stage_dir / "config.yaml")
    datamodule = build(cfg.dataset)
    datamodule.setup("test")
    dataset = datamodule.datasets["test"]
    return cfg, default_collate([dataset[i] for i in range(len(dataset))])


def stage_figures(stage_dir: Path) -> dict[str, Any]:
    """The stage's generated CT, the back-projection baseline and (stage >= 2) the identity baseline (stage k-1's own
    output, generated as the test generates it, upsampled trilinearly), each against the test CTs."""
    cfg, batch = test_batch(stage_dir)
    window = tuple(float(v) for v in cfg.model.window)
    target = common_units(batch["image"], window)
    module = XrayToCT.load_from_checkpoint(stage_dir / "best.ckpt", map_location="cpu", weights_only=True).eval()
    generated = module.generate(batch["xray"], list(target.shape[2:]), [str(s) for s in batch["subject"]])
    spacing = voxel_spacing(batch["affine"])
    hounsfield = back_project(batch["xray"], spacing, list(cfg.dataset.views), target.shape[2:], cfg.dataset.mu_water)
    back = common_units(scale_to_range(hounsfield, *window, (-1.0, 1.0))[:, None], window)
    identity = None
    if int(cfg.model.stage) > 1:
        previous = generated[f"stage{int(cfg.model.stage) - 1}"]
        upsampled = F.interpolate(previous, size=target.shape[2:], mode="trilinear", align_corners=False)
        identity = figures(common_units(upsampled, window), target)
    # The physics loss of the true CT on the stage's grid: the floor a generated CT is measured against.
    floor = float(module.physics(batch["image"], batch["xray"], batch["affine"]))
    return {"model": figures(common_units(generated["ct"], window), target), "back": figures(back, target),
            "identity": identity, "floor": floor}


def overlap_sweep(stage_dir: Path, overlaps: list[float], repeats: int) -> None:
    """The last stage's test CTs generated through the whole cascade with sampling windows overlapping each of
    `overlaps`: windows a step at each windowed stage, CPU seconds (one thread; the least of `repeats` runs) and the
    figures against the true CTs."""
    torch.set_num_threads(1)
    cfg, batch = test_batch(stage_dir)
    window = tuple(float(v) for v in cfg.model.window)
    target = common_units(batch["image"], window)
    module = XrayToCT.load_from_checkpoint(stage_dir / "best.ckpt", map_location="cpu", weights_only=True).eval()
    sizes = [as_size(s["size"]) for s in module.previous_settings] + [list(target.shape[2:])]
    windows = [window_of(s) for s in module.previous_settings] + [window_of(dict(module.hparams))]
    subjects = [str(s) for s in batch["subject"]]
    print(f"\n{len(subjects)} test subjects through stages {' -> '.join('x'.join(map(str, s)) for s in sizes)}, "
          f"windows {' / '.join('x'.join(map(str, w)) for w in windows)}, {len(module.sampling_timesteps)} steps a "
          "stage, one thread; figures on one HU scale as above\n")
    print(table_header([
        "overlap", "windows a step (each stage)", "CPU seconds", "PSNR", "SSIM", "body PSNR", "body SSIM",
        "body MAE (HU)"
    ]))
    for overlap in overlaps:
        module.sampling_window_overlap = overlap
        counts = [SlidingWindow.of(w, overlap=overlap).windows([1, 1, *s]) for s, w in zip(sizes, windows,
                                                                                             strict=True)]
        seconds = []
        for _ in range(repeats):
            # CPU time of the one thread: the work, whatever else the machine runs meanwhile.
            start = time.process_time()
            with torch.no_grad():
                generated = module.generate(batch["xray"], list(target.shape[2:]), subjects)["ct"]
            seconds.append(time.process_time() - start)
        found = figures(common_units(generated, window), target)
        print(f"| {overlap} | {' / '.join(map(str, counts))} | {min(seconds):.1f} | {found['psnr']:.3f} | "
              f"{found['ssim']:.4f} | {found['body_psnr']:.3f} | {found['body_ssim']:.4f} | {found['mae']:.1f} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "outputs" / "benchmarks" / "xray2ct_cascade"))
    parser.add_argument("--report-only", action="store_true", help="only read an earlier run in --out")
    parser.add_argument("--overlaps", type=float, nargs="+", help="then the last stage's test CTs at these window "
                        "overlaps: windows, time and figures (the X-ray-to-CT preset's overlap)")
    parser.add_argument("--repeats", type=int, default=2, help="--overlaps: timed runs each (the least counts)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    command = [sys.executable, str(ROOT / "train.py"), "experiment=xray2ct_cascade", "test=true",
               "callbacks.progress_bar=null", f"hydra.run.dir={out}", *args.overrides]
    if not args.report_only:
        start = time.perf_counter()
        subprocess.run(command, check=True, cwd=ROOT)
        print(f"command: {' '.join(['python train.py', *command[2:]])}")
        print(f"wall time, all stages with validation and test: {time.perf_counter() - start:.0f} s\n")
    print("Figures on one HU scale (PSNR peak and SSIM range 4095 HU); body: true CT > -500 HU; MAE in HU over the "
          "body. Each cell: the stage's CT / back-projection / upsampled previous stage (identity).\n")
    print(table_header([
        "stage", "size", "epochs", "train samples/s", "peak host memory", "test physics loss (true CT's)", "PSNR",
        "SSIM", "body PSNR", "body SSIM", "body MAE (HU)"
    ]))
    for stage_dir in sorted(out.glob("stage*")):
        summary = json.loads((stage_dir / "summary.json").read_text())
        metrics = summary.get("metrics", summary)
        cfg = OmegaConf.load(stage_dir / "config.yaml")
        found = stage_figures(stage_dir)

        def cells(key: str, digits: int, found: dict = found) -> str:
            return " / ".join("-" if found[k] is None else f"{found[k][key]:.{digits}f}"
                              for k in ("model", "back", "identity"))

        physics = metrics.get("test/physics_loss")
        speed, memory = summary.get("samples_per_second"), summary.get("peak_host_memory_mb")
        crop = cfg.model.get("crop_size")
        crops = f" ({crop}^3 crops)" if int(cfg.model.stage) > 1 and crop and int(crop) < int(cfg.dataset.size) else ""
        print(
            f"| {stage_dir.name} | {cfg.dataset.size}^3{crops} | {cfg.trainer.max_epochs} | {speed} | {memory} MiB | "
            f"{physics:.3f} ({found['floor']:.3f}) | {cells('psnr', 2)} | {cells('ssim', 3)} | {cells('body_psnr', 2)} "
            f"| {cells('body_ssim', 3)} "
            f"| {cells('mae', 0)} |"
        )
    if args.overlaps:
        overlap_sweep(sorted(out.glob("stage*"))[-1], args.overlaps, args.repeats)

if __name__ == "__main__":
    main()
