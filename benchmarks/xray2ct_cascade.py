"""X-ray-to-CT on CPU: the whole cascade from one command, per-stage quality against a back-projection baseline.

Runs `python train.py experiment=xray2ct_cascade test=true` (synthetic CT phantoms and their
DRR views), then reads each stage's test PSNR/SSIM and physics loss, training speed and peak
memory, and computes two baselines on the same test subjects at each stage's size: the mean of
the two views' back-projections (`medvol.volumes.projection.back_project`), windowed like the CT,
and, from stage 2, the stage's identity baseline: stage k-1's own output (generated as the test
generates it, same noise) upsampled trilinearly to stage k's grid.

    python benchmarks/xray2ct_cascade.py [--out DIR] [extra train.py overrides ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import default_collate
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import medvol.run.resolvers  # noqa: E402, F401 - the stage configs use medvol's resolvers
from lightning_modules.xray2ct.module import XrayToCT  # noqa: E402
from medvol.core.build import build  # noqa: E402
from medvol.volumes.intensity import scale_to_range  # noqa: E402
from medvol.volumes.projection import back_project, voxel_spacing  # noqa: E402


def baseline(stage_dir: Path) -> dict[str, float]:
    """Back-projection PSNR/SSIM over the stage's test subjects, as the stage's own metrics are computed."""
    cfg = OmegaConf.load(stage_dir / "config.yaml")
    datamodule = build(cfg.dataset)
    datamodule.setup("test")
    dataset = datamodule.datasets["test"]
    psnr, ssim = [], []
    low, high = (float(v) for v in cfg.dataset.ct_window)
    for i in range(len(dataset)):
        item = dataset[i]
        target = item["image"][None]
        spacing = voxel_spacing(torch.as_tensor(item["affine"])[None])
        hounsfield = back_project(item["xray"][None], spacing, list(cfg.dataset.views), target.shape[2:], cfg.dataset.mu_water)
        guess = scale_to_range(hounsfield, low, high, (-1.0, 1.0))[:, None]
        psnr.append(float(peak_signal_noise_ratio(guess, target, data_range=2.0)))
        ssim.append(float(structural_similarity_index_measure(guess, target, data_range=2.0, kernel_size=5)))
    return {"psnr": sum(psnr) / len(psnr), "ssim": sum(ssim) / len(ssim), "subjects": len(psnr)}


def upsampled_previous(stage_dir: Path) -> dict[str, float] | None:
    """PSNR/SSIM of stage k-1's output upsampled to stage k's grid (the identity baseline of stage k >= 2)."""
    cfg = OmegaConf.load(stage_dir / "config.yaml")
    if int(cfg.model.stage) < 2:
        return None
    datamodule = build(cfg.dataset)
    datamodule.setup("test")
    dataset = datamodule.datasets["test"]
    batch = default_collate([dataset[i] for i in range(len(dataset))])
    module = XrayToCT.load_from_checkpoint(stage_dir / "best.ckpt", map_location="cpu", weights_only=False).eval()
    target = batch["image"]
    generated = module.generate(batch["xray"], list(target.shape[2:]), [str(s) for s in batch["subject"]])
    previous = generated[f"stage{int(cfg.model.stage) - 1}"]
    guess = F.interpolate(previous, size=target.shape[2:], mode="trilinear", align_corners=False)
    psnr = [float(peak_signal_noise_ratio(g[None], t[None], data_range=2.0)) for g, t in zip(guess, target, strict=True)]
    ssim = [float(structural_similarity_index_measure(g[None], t[None], data_range=2.0, kernel_size=5))
            for g, t in zip(guess, target, strict=True)]
    return {"psnr": sum(psnr) / len(psnr), "ssim": sum(ssim) / len(ssim)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "outputs" / "benchmarks" / "xray2ct_cascade"))
    parser.add_argument("--report-only", action="store_true", help="only read an earlier run in --out")
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
    print("| stage | size | epochs | train samples/s | peak host memory | test PSNR | test SSIM | test physics loss "
          "| back-projection PSNR | back-projection SSIM | upsampled previous stage PSNR | SSIM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for stage_dir in sorted(out.glob("stage*")):
        summary = json.loads((stage_dir / "summary.json").read_text())
        metrics = summary.get("metrics", summary)
        cfg = OmegaConf.load(stage_dir / "config.yaml")
        base = baseline(stage_dir)
        identity = upsampled_previous(stage_dir)
        previous = f"{identity['psnr']:.3f} | {identity['ssim']:.3f}" if identity else "- | -"

        def get(key: str, metrics: dict = metrics, summary: dict = summary) -> str:
            value = metrics.get(key, summary.get(key))
            return f"{value:.3f}" if isinstance(value, (int, float)) else "n/a"

        speed, memory = summary.get("samples_per_second"), summary.get("peak_host_memory_mb")
        crop = cfg.model.get("crop_size")
        crops = f" ({crop}^3 crops)" if int(cfg.model.stage) > 1 and crop and int(crop) < int(cfg.dataset.size) else ""
        print(
            f"| {stage_dir.name} | {cfg.dataset.size}^3{crops} | {cfg.trainer.max_epochs} | {speed} | {memory} MiB | "
            f"{get('test/psnr')} | {get('test/ssim')} | {get('test/physics_loss')} | {base['psnr']:.3f} | {base['ssim']:.3f} | {previous} |"
        )


if __name__ == "__main__":
    main()
