"""Segmentation figures: Dice per region after a CPU-sized run, sliding-window cost, GPU training throughput.

    .venv/bin/python benchmarks/segmentation.py dice [hydra overrides ...]
    .venv/bin/python benchmarks/segmentation.py sliding-window [--size 128] [--roi 64 48] [--overlap 0.25 0.5]
    .venv/bin/python benchmarks/segmentation.py gpu [--nets unet swinunetr] [--steps 20]

`dice` trains `python train.py model=segmentation` on the synthetic phantoms (lesion and core
regions, FLAIR + T1ce) in a temporary folder and prints the val Dice/HD95 of every epoch.
`sliding-window` times `Segmenter.sliding_window` (Gaussian blending) on one random C x size^3
volume on the CPU, one fresh process per setting so the peak resident memory is that
setting's own. `gpu` times training steps of the BraTS experiment's networks on 4 x 128^3
(4-channel) patches under bf16-mixed autocast: samples/s and `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DICE_RUN = [
    "model=segmentation",
    "dataset.image_modalities=[flair,t1ce]",
    "dataset.num_subjects=32",
    "dataset.size=32",
    "model.features=[8,16,32]",
    "model.patch_size=[16,16,16]",
    "model.regions={lesion:[1,2],core:[1]}",
    "model.optimizer.lr=3e-3",
    "trainer.max_epochs=20",
]


def dice(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, str(ROOT / "train.py"), "logger=[tensorboard,csv]", "callbacks.progress_bar=null",
             "hardware=cpu", *DICE_RUN, *overrides],
            cwd=tmp, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        wall = time.perf_counter() - start
        (run_dir,) = (Path(tmp) / "outputs" / "train" / "runs").iterdir()
        rows = [r for r in csv.DictReader((run_dir / "csv" / "metrics.csv").open()) if r.get("val/dice")]
    print(f"overrides: {[*DICE_RUN, *overrides]}; wall time {wall:.0f} s on {os.cpu_count()} cores")
    names = [k for k in rows[0] if k.startswith("val/dice_") or k.startswith("val/hd95_")]
    print("| epoch | val/dice | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 2))
    for r in rows:
        print(f"| {r['epoch']} | {float(r['val/dice']):.3f} | " + " | ".join(f"{float(r[n]):.3f}" if r[n] else "-" for n in names) + " |")


def sliding_window_once(size: int, roi: int, overlap: float, channels: int, repeats: int) -> dict:
    """One setting, in this process: median seconds and the peak RSS growth over the process before inference."""
    import torch

    from lightning_modules.segmentation.segmentation import Segmenter

    torch.manual_seed(0)
    module = Segmenter(
        in_channels=channels, regions={"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]}, features=[16, 32, 64, 128],
        patch_size=[roi] * 3, overlap=overlap, sw_batch_size=4,
    ).eval()
    volume = torch.randn(1, channels, size, size, size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            module.sliding_window(volume)
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": sorted(times)[len(times) // 2], "peak_mb": peak / 1024, "growth_mb": (peak - before) / 1024}


def sliding_window(args: argparse.Namespace) -> None:
    print(f"one {args.channels} x {args.size}^3 volume, UNet [16, 32, 64, 128], sw_batch_size 4, Gaussian blending, "
          f"{torch_threads()} threads, median of {args.repeats}")
    print("| roi | overlap | windows | seconds | peak RSS (MiB) | RSS growth during inference (MiB) |\n|---|---|---|---|---|---|")
    for roi in args.roi:
        for overlap in args.overlap:
            result = subprocess.run(
                [sys.executable, __file__, "_sliding-window-once", str(args.size), str(roi), str(overlap),
                 str(args.channels), str(args.repeats)],
                check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            figures = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"| {roi}^3 | {overlap} | {windows(args.size, roi, overlap) ** 3} | {figures['seconds']:.2f} | "
                  f"{figures['peak_mb']:.0f} | {figures['growth_mb']:.0f} |")


def windows(size: int, roi: int, overlap: float) -> int:
    """Windows per axis as MONAI places them: steps of roi * (1 - overlap), the last flush with the edge."""
    step = max(int(roi * (1 - overlap)), 1)
    return -(-(size - roi) // step) + 1 if size > roi else 1


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def train_steps(module, optimizer, image, target, steps: int) -> None:  # noqa: ANN001 - torch is imported lazily
    """`steps` bf16-autocast training steps of the segmentation network on one fixed batch."""
    import torch

    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = module.loss(module(image), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def gpu(args: argparse.Namespace) -> None:
    import torch

    from lightning_modules.segmentation.segmentation import Segmenter

    if not torch.cuda.is_available():
        raise SystemExit("gpu: no CUDA device visible")
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; batch {args.batch} of 4 channels x 128^3, bf16-mixed autocast, AdamW, {args.steps} timed steps")
    print("| net | parameters (M) | samples/s | step (ms) | peak memory (GiB) |\n|---|---|---|---|---|")
    for net in args.nets:
        torch.manual_seed(0)
        module = Segmenter(
            in_channels=4, net=net, regions={"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]},
            features=[32, 64, 128, 256, 320], feature_size=48, patch_size=[128, 128, 128],
        ).to(device)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        image = torch.randn(args.batch, 4, 128, 128, 128, device=device)
        target = (torch.rand(args.batch, 3, 128, 128, 128, device=device) > 0.9).to(torch.uint8)
        torch.cuda.reset_peak_memory_stats()
        train_steps(module, optimizer, image, target, 3)
        torch.cuda.synchronize()
        start = time.perf_counter()
        train_steps(module, optimizer, image, target, args.steps)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
        parameters = sum(p.numel() for p in module.parameters()) / 1e6
        print(f"| {net} | {parameters:.1f} | {args.batch / seconds:.2f} | {seconds * 1000:.0f} | "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} |")
        del module, optimizer
        torch.cuda.empty_cache()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_sliding-window-once":
        size, roi, overlap, channels, repeats = sys.argv[2:7]
        print(json.dumps(sliding_window_once(int(size), int(roi), float(overlap), int(channels), int(repeats))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="task", required=True)
    sub.add_parser("dice")
    window = sub.add_parser("sliding-window")
    window.add_argument("--size", type=int, default=128)
    window.add_argument("--roi", type=int, nargs="+", default=[64, 48])
    window.add_argument("--overlap", type=float, nargs="+", default=[0.25, 0.5])
    window.add_argument("--channels", type=int, default=4)
    window.add_argument("--repeats", type=int, default=3)
    device = sub.add_parser("gpu")
    device.add_argument("--nets", nargs="+", default=["unet", "swinunetr"])
    device.add_argument("--batch", type=int, default=2)
    device.add_argument("--steps", type=int, default=20)
    args, overrides = parser.parse_known_args()
    if args.task == "dice":
        dice(overrides)
    elif args.task == "sliding-window":
        sliding_window(args)
    else:
        gpu(args)


if __name__ == "__main__":
    main()
