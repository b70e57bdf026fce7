"""Segmentation figures: Dice per region after a CPU-sized run, sliding-window cost, GPU training throughput.

    .venv/bin/python benchmarks/segmentation.py dice [hydra overrides ...]
    .venv/bin/python benchmarks/segmentation.py sliding-window [--size 128] [--roi 64 48] [--overlap 0.25 0.5]
    .venv/bin/python benchmarks/segmentation.py gpu [--nets unet swinunetr] [--steps 20]
    .venv/bin/python benchmarks/segmentation.py real [--subjects 48] [--spacing 2 2 2] [--epochs 60]
        [--iterations 8] [--arms medvol medvol-noaug medvol-adam monai]

`dice` trains `python train.py model=segmentation` on the synthetic phantoms (lesion and core
regions, FLAIR + T1ce) in a temporary folder and prints the val Dice/HD95 of every epoch.
`sliding-window` times `Segmenter.sliding_window` (Gaussian blending) on one random C x size^3
volume on the CPU, one fresh process per setting so the peak resident memory is that
setting's own. `gpu` times training steps of the BraTS experiment's networks on 4 x 128^3
(4-channel) patches under bf16-mixed autocast: samples/s and `torch.cuda.max_memory_allocated`.
`real` writes BraTS-2021 cases on the MNI152 brain with lesions (`datamodules.sources.brain_lesions`) at
`--spacing`, then trains on the same files, split and epochs (1) `python train.py model=segmentation
dataset=brats` as a user types it (the plan from the data, nnU-Net's augmentation on; `--iterations` batches
an epoch, nnU-Net's 250 by default), optionally the same with `model.plan.augmentation=false`
(`medvol-noaug`) or with Adam 1e-3 instead of nnU-Net's SGD (`medvol-adam`), and (2) the plain MONAI script of
issue 28
(UNet 16-32-64-128, z-score over the brain, whole volumes at `--monai-spacing` mm, DiceCE, Adam 1e-3,
batch 2, best validation epoch); both arms' test masks are scored on the source grid (Dice and HD95 per
WT/TC/ET region) and appended to `<out>/results.md`, with each arm's wall time and (medvol) the share of a
training step spent waiting for data (`summary.json`'s telemetry).
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
from typing import Any

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
        print(
            f"| {r['epoch']} | {float(r['val/dice']):.3f} | "
            + " | ".join(f"{float(r[n]):.3f}" if r[n] else "-" for n in names)
            + " |"
        )


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
    print(
        "| roi | overlap | windows | seconds | peak RSS (MiB) | RSS growth during inference (MiB) |\n"
        "|---|---|---|---|---|---|"
    )
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
    print(
        f"{torch.cuda.get_device_name()}; batch {args.batch} of 4 channels x 128^3, bf16-mixed autocast, AdamW, "
        f"{args.steps} timed steps"
    )
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


# ---- real: medvol's planned default against a plain MONAI script on real anatomy (issue 28) ----------------------

REGIONS = {"WT": (1, 2, 4), "TC": (1, 4), "ET": (4,)}
MODALITIES = ("t1", "t1ce", "t2", "flair")


def case_files(root: Path, subject: str) -> dict[str, str]:
    return {name: str(root / subject / f"{subject}_{name}.nii.gz") for name in (*MODALITIES, "seg")}


def region_scores(seg: Any, truth: Any, spacing: list[float]) -> dict[str, float]:
    """Dice and HD95 (mm) per BraTS region of a 2021 label map against the truth, as MONAI computes them."""
    import numpy as np
    import torch
    from monai.metrics import compute_dice, compute_hausdorff_distance

    masks = torch.from_numpy(np.stack([np.isin(seg, v) for v in REGIONS.values()])[None].astype(np.uint8))
    target = torch.from_numpy(np.stack([np.isin(truth, v) for v in REGIONS.values()])[None].astype(np.uint8))
    dice = compute_dice(masks, target, include_background=True, ignore_empty=False)[0]
    hd95 = compute_hausdorff_distance(masks, target, include_background=True, percentile=95, spacing=spacing)[0]
    scores = {f"dice_{n}": float(d) for n, d in zip(REGIONS, dice, strict=True)}
    scores.update({f"hd95_{n}": float(h) for n, h in zip(REGIONS, hd95, strict=True)})
    return scores


def mean_scores(rows: list[dict[str, float]]) -> dict[str, float]:
    import math

    return {
        k: sum(r[k] for r in rows if math.isfinite(r[k])) / max(1, sum(math.isfinite(r[k]) for r in rows))
        for k in rows[0]
    }


def medvol_arm(
    root: Path, split_file: Path, out: Path, epochs: int, test: list[str], extra: list[str]
) -> tuple[dict[str, float], float, str, float | None]:
    """`python train.py model=segmentation dataset=brats ...` as a user types it (the plan by default); test masks
    scored; the training loop's data wait from the run's telemetry."""
    import nibabel as nib
    import numpy as np

    command = [
        sys.executable, str(ROOT / "train.py"), "model=segmentation", "dataset=brats", f"dataset.root={root}",
        "dataset.label_regions=[WT,TC,ET]", f"trainer.max_epochs={epochs}", "test=true", "hardware=cpu",
        f"dataset.split_file={split_file}", "callbacks.progress_bar=null", "logger=csv", f"hydra.run.dir={out}",
        *extra,
    ]
    record = out / "wall.json"
    if record.is_file() and (out / "predictions").is_dir():
        # A finished arm (its wall time recorded) is scored again, not retrained.
        wall = float(json.loads(record.read_text())["seconds"])
    else:
        start = time.perf_counter()
        result = subprocess.run(
            command, cwd=out.parent, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        wall = time.perf_counter() - start
        out.mkdir(parents=True, exist_ok=True)
        (out / "train.stdout").write_text(result.stdout + result.stderr)
        if result.returncode:
            raise SystemExit(f"medvol arm failed ({result.returncode}): {result.stderr[-2000:]}")
        record.write_text(json.dumps({"seconds": wall, "command": command}))
    rows = []
    for subject in test:
        files = case_files(root, subject)
        truth = nib.load(files["seg"])
        seg = np.asarray(nib.load(str(out / "predictions" / f"{subject}_seg.nii.gz")).dataobj)
        rows.append(region_scores(seg, np.asarray(truth.dataobj), [float(z) for z in truth.header.get_zooms()[:3]]))
    plan = (out / "plan.json").read_text() if (out / "plan.json").is_file() else "{}"
    telemetry = json.loads((out / "summary.json").read_text()).get("telemetry", {})
    return mean_scores(rows), wall, plan, telemetry.get("data_wait_fraction")


def plain_monai_arm(
    root: Path, split: dict[str, list[str]], epochs: int, spacing: float
) -> tuple[dict[str, float], float]:
    """The plain MONAI script of issue 28: UNet 16-32-64-128 (residual units), z-score per channel over the brain,
    whole volumes at `spacing` mm, DiceCE, Adam 1e-3, batch 2; the best validation epoch's weights are tested."""
    import copy

    import nibabel as nib
    import numpy as np
    import torch
    from monai.data import DataLoader, Dataset
    from monai.inferers import sliding_window_inference
    from monai.losses import DiceCELoss
    from monai.networks.nets import UNet
    from monai.transforms import (
        Compose,
        ConvertToMultiChannelBasedOnBratsClassesd,
        DivisiblePadd,
        EnsureChannelFirstd,
        LoadImaged,
        NormalizeIntensityd,
        Orientationd,
        Spacingd,
    )

    from medvol.volumes.source_grid import to_source_grid

    torch.manual_seed(0)
    keys = ["image", "label"]
    chain = Compose([
        LoadImaged(keys), EnsureChannelFirstd(keys), Orientationd(keys, axcodes="RAS"),
        Spacingd(keys, pixdim=[spacing] * 3, mode=["bilinear", "nearest"]),
        ConvertToMultiChannelBasedOnBratsClassesd("label"),
        NormalizeIntensityd("image", nonzero=True, channel_wise=True), DivisiblePadd(keys, k=16),
    ])

    def items(subjects: list[str]) -> list[dict]:
        return [
            {"image": [case_files(root, s)[m] for m in MODALITIES], "label": case_files(root, s)["seg"], "subject": s}
            for s in subjects
        ]

    start = time.perf_counter()
    train = DataLoader(Dataset(items(split["train"]), chain), batch_size=2, shuffle=True, drop_last=True)
    evaluation = {name: [chain(i) for i in items(split[name])] for name in ("val", "test")}
    net = UNet(3, 4, 3, channels=(16, 32, 64, 128), strides=(2, 2, 2), num_res_units=2)
    loss = DiceCELoss(sigmoid=True)
    optimizer = torch.optim.Adam(net.parameters(), 1e-3)
    best, best_dice = copy.deepcopy(net.state_dict()), -1.0
    for _ in range(epochs):
        net.train()
        for batch in train:
            optimizer.zero_grad()
            loss(net(batch["image"]), batch["label"]).backward()
            optimizer.step()
        net.eval()
        with torch.no_grad():
            dice = [float(((torch.sigmoid(net(i["image"][None])) > 0.5) * i["label"][None]).sum() * 2
                          / ((torch.sigmoid(net(i["image"][None])) > 0.5).sum() + i["label"].sum() + 1e-6))
                    for i in evaluation["val"]]
        if np.mean(dice) > best_dice:
            best, best_dice = copy.deepcopy(net.state_dict()), float(np.mean(dice))
    net.load_state_dict(best)
    net.eval()
    rows = []
    with torch.no_grad():
        for item in evaluation["test"]:
            masks = (
                torch.sigmoid(sliding_window_inference(item["image"][None], item["image"].shape[1:], 1, net)) > 0.5
            )[0]
            tc, wt, et = masks.numpy()
            seg = np.where(wt, 2, 0)
            seg[tc] = 1
            seg[et] = 4
            files = case_files(root, item["subject"])
            truth = nib.load(files["seg"])
            on_source = to_source_grid(torch.from_numpy(seg[None].astype(np.int64)), files["seg"], item["image"].affine)
            rows.append(
                region_scores(
                    on_source[0].numpy(), np.asarray(truth.dataobj), [float(z) for z in truth.header.get_zooms()[:3]]
                )
            )
    return mean_scores(rows), time.perf_counter() - start


def real(args: argparse.Namespace) -> None:
    """Both arms on the same generated files, split and epochs; one table row per arm."""
    import torch

    from datamodules.pipeline.split import make_split, save_split
    from datamodules.sources.brain_lesions import write_brain_lesions

    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    tag = f"{args.subjects}s-{'x'.join(f'{s:g}' for s in args.spacing)}mm"
    root = out / f"data-{tag}"
    if not root.is_dir():
        write_brain_lesions(root, args.subjects, args.spacing, seed=args.seed)
    ids = sorted(p.name for p in root.iterdir() if p.is_dir())
    split = make_split(ids, 0.15, 0.15, args.seed)
    split_file = out / f"split-{tag}.json"
    save_split(split_file, split, args.seed)
    lines = []
    iterations = [f"model.plan.iterations_per_epoch={args.iterations}"] if args.iterations else []
    arms = {
        "medvol": ("medvol planned default", []),
        "medvol-noaug": ("medvol planned, augmentation off", ["model.plan.augmentation=false"]),
        "medvol-adam": ("medvol planned, Adam 1e-3", [
            "model.optimizer._target_=torch.optim.Adam", "~model.optimizer.momentum", "~model.optimizer.nesterov",
            "model.optimizer.lr=1e-3"]),
    }
    for arm, (name, extra) in arms.items():
        if arm in args.arms:
            folder = out / f"{arm}-{tag}-{args.epochs}ep"
            scores, wall, plan, wait = medvol_arm(root, split_file, folder, args.epochs, split["test"],
                                                  [*iterations, *extra])
            lines.append(row(f"{name} ({tag})", scores, wall, wait))
            print(f"plan for {tag}: {plan}")
    if "monai" in args.arms:
        scores, wall = plain_monai_arm(root, split, args.epochs, args.monai_spacing)
        lines.append(row(f"plain MONAI script ({tag}, {args.monai_spacing:g} mm)", scores, wall, None))
    header = (
        "| arm | epochs | Dice WT | Dice TC | Dice ET | HD95 WT | HD95 TC | HD95 ET | wall | data wait |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    table = "\n".join([header, *[line.replace("EPOCHS", str(args.epochs)) for line in lines]])
    print(table)
    with (out / "results.md").open("a") as handle:
        handle.write(table + "\n\n")


def row(name: str, scores: dict[str, float], wall: float, wait: float | None) -> str:
    cells = [f"{scores[f'dice_{n}']:.3f}" for n in REGIONS] + [f"{scores[f'hd95_{n}']:.1f}" for n in REGIONS]
    waited = f"{wait:.1%}" if wait is not None else "-"
    return f"| {name} | EPOCHS | " + " | ".join(cells) + f" | {wall:.0f} s | {waited} |"


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
    side = sub.add_parser("real")
    side.add_argument("--subjects", type=int, default=48)
    side.add_argument("--spacing", type=float, nargs=3, default=[2.0, 2.0, 2.0])
    side.add_argument("--monai-spacing", type=float, default=4.0)
    side.add_argument("--epochs", type=int, default=60)
    side.add_argument("--iterations", type=int, default=None, help="medvol's batches an epoch (null: the plan's 250)")
    side.add_argument("--arms", nargs="+", default=["medvol", "monai"],
                      choices=["medvol", "medvol-noaug", "medvol-adam", "monai"])
    side.add_argument("--seed", type=int, default=0)
    side.add_argument("--out", default="outputs/benchmarks/segmentation-real")
    args, overrides = parser.parse_known_args()
    if args.task == "real":
        Path(args.out).mkdir(parents=True, exist_ok=True)
        real(args)
    elif args.task == "dice":
        dice(overrides)
    elif args.task == "sliding-window":
        sliding_window(args)
    else:
        gpu(args)


if __name__ == "__main__":
    main()
