"""Segmentation figures: Dice per region after a CPU-sized run, sliding-window cost, GPU training throughput.

    .venv/bin/python benchmarks/segmentation/segmentation.py dice [hydra overrides ...]
    .venv/bin/python benchmarks/segmentation/segmentation.py sliding-window [--size 128] [--roi 64 48]
        [--overlap 0.25 0.5]
    .venv/bin/python benchmarks/segmentation/segmentation.py gpu [--nets unet swinunetr dynunet] [--steps 20]
        [--batch 2] [--size 128] [--device cuda] [--json FILE]
    .venv/bin/python benchmarks/segmentation/segmentation.py mirroring [--subjects 24] [--epochs 20]
    .venv/bin/python benchmarks/segmentation/segmentation.py profile --run <a trained segmentation run>
        [--repeats 10]
    .venv/bin/python benchmarks/segmentation/segmentation.py step-time --run <run>
        --nnunet-plans <nnUNetPlans.json>
    .venv/bin/python benchmarks/segmentation/segmentation.py same-step --run <run at base 32>
        --nnunet-plans <nnUNetPlans.json>
    .venv/bin/python benchmarks/segmentation/segmentation.py protocol --dataset brats|tissue|thick
        [--arms medvol16,medvol32,nnunet] [--budgets steps,wall] [--seeds 0,1,2] [--steps 1250]
        (issue 50; benchmarks/segmentation/segmentation_protocol.py)
    .venv/bin/python benchmarks/segmentation/segmentation.py real [--datasets brats,thick,ct] [--subjects 48]
        [--epochs 60] [--iterations 8]
        [--arms medvol,medvol-noaug,medvol-nods,medvol-base32,medvol-adam,medvol-seed<N>,nnunet,monai]
        [--nnunet-venv /work/nnunet-venv]

`dice` trains `python train.py model=segmentation` on the synthetic phantoms (lesion and core
regions, FLAIR + T1ce) in a temporary folder and prints the val Dice/HD95 of every epoch.
`sliding-window` times the segmenter's Gaussian-blended sliding window on one random C x size^3
volume on the CPU, one fresh process per setting so the peak resident memory is that
setting's own. `gpu` times training steps of the BraTS experiment's networks on 4 x 128^3
(4-channel) patches under bf16-mixed autocast: samples/s and `torch.cuda.max_memory_allocated`; `dynunet`
is the network the experiment's plan builds (`experiment=brats_segmentation` on 1 mm BraTS volumes: its
given 128^3 patch and 32-320 filters, the plan's strides, kernels and deep supervision); `--device cpu`
with a small `--size` checks the command (fp32, no memory figure).
`real` is the head-to-head of issue 35: per dataset (`brats`: BraTS-2021 cases on the MNI152 brain with
lesions, `datamodules.sources.brain_lesions`, at 4 mm; `thick`: the same at 2 x 2 x 6 mm; `ct`: an
abdomen-like CT in HU with an organ and a lesion in it) it writes the files once, one split, then
(1) medvol as a user types it: `python train.py model=segmentation dataset=...` (the plan with nnU-Net's
augmentation, SGD and `--iterations` batches an epoch, the plan's 250 by default; the validation after training)
and `python predict.py ckpt_path=<best> split=test` (mirroring); `medvol-noaug` the same with
`model.plan.augmentation=false`, `medvol-nods` without deep supervision, `medvol-base32` with nnU-Net's GPU
width (32 base filters, not the CPU plan's 16), `medvol-adam` with Adam 1e-3 instead of nnU-Net's SGD, and any of
these with `-seed<N>` (`medvol-seed3`, `medvol-nods-seed3`) with the training seed N (conf/train.yaml: 42); (2) nnU-Net
v2 through its own CLI from `--nnunet-venv`: `nnUNetv2_plan_and_preprocess` at medvol's target spacing, `nnUNetv2_train`
fold 0 (= the same train/val split) on `-device cpu` with nnU-Net's default trainer cut to medvol's optimizer
steps (epochs x iterations, `nnUNetTrainer_medvolBudget` through `nnUNet_extTrainer`), `nnUNetv2_predict`
with its mirroring; (3) on the BraTS layouts, the plain MONAI script of issue 28 (UNet 16-32-64-128, z-score
over the brain, whole volumes at `--monai-spacing` mm, DiceCE, Adam 1e-3, batch 2, best validation epoch).
Every arm's test masks are scored against the label files (Dice and HD95 per region or class; Dice by nnU-Net's
rule, NaN for a structure absent from both masks, left out of the means); medvol from its final checkpoint
(`last.ckpt`) without post-processing, as nnU-Net's arm (its best-validation checkpoint scored apart); the table
(optimizer steps and batch, training and prediction wall time, peak resident memory of the largest process,
GNU time; for medvol the share of a training step spent waiting for data, `summary.json`'s telemetry) goes to
`<out>/results.md` and the figures to `<out>/results-<dataset>-...json`.
`same-step` runs nnU-Net's own training step (`benchmarks/segmentation/nnunet_plans.py step --plans`, in nnU-Net's venv:
its network, deep-supervision loss, target pooling, clipping and SGD on one fixed batch) and medvol's planned step from
a run's config with nnU-Net's initial weights, and prints the outputs, gradients and losses of both side by side (the
test `tests/lightning_modules/segmentation/test_nnunet_step.py` does the same at a small size).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, child_env, composed, logged_rows, table_header, trained  # noqa: E402
from benchmarks.segmentation.head_to_head import (  # noqa: E402 - after the path set-up for direct runs
    BUDGET_TRAINER,
    MODALITIES,
    STRUCTURES,
    TO_NNUNET,
    TRAINER_NAME,
    case_files,
    comma_list,
    finished,
    mean_scores,
    medvol_arm,
    nnunet_dataset,
    score_folder,
    structure_scores,
    timed,
)

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
    with trained(["hardware=cpu", *DICE_RUN, *overrides]) as (run_dir, wall):
        rows = logged_rows(run_dir, "val/dice")
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
            module.window(volume)(module.net, volume)
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": sorted(times)[len(times) // 2], "peak_mb": peak / 1024, "growth_mb": (peak - before) / 1024}


def sliding_window(args: argparse.Namespace) -> None:
    print(f"one {args.channels} x {args.size}^3 volume, UNet [16, 32, 64, 128], sw_batch_size 4, Gaussian blending, "
          f"{torch_threads()} threads, median of {args.repeats}")
    print(table_header(["roi", "overlap", "windows", "seconds", "peak RSS (MiB)", "RSS growth during inference (MiB)"]))
    for roi in args.roi:
        for overlap in args.overlap:
            result = subprocess.run(
                [sys.executable, __file__, "_sliding-window-once", str(args.size), str(roi), str(overlap),
                 str(args.channels), str(args.repeats)],
                check=True, capture_output=True, text=True, env=child_env(),
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


def train_steps(module, optimizer, image, target, steps: int, autocast=None) -> None:  # noqa: ANN001 - lazy torch
    """`steps` training steps of the segmentation network on one fixed batch, the forward under `autocast()` (default:
    bf16 autocast on a GPU, none on the CPU)."""
    import torch

    if autocast is None:
        autocast = partial(torch.autocast, image.device.type, dtype=torch.bfloat16,
                           enabled=image.device.type == "cuda")
    for _ in range(steps):
        with autocast():
            loss = module.training_loss(module(image), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def planned_segmenter(net: str, size: int):  # noqa: ANN201 - torch is imported lazily
    """The BraTS segmenter of `net` for size^3 patches of 4 channels and 3 regions (`network_settings`)."""
    from lightning_modules.segmentation.segmentation import Segmenter

    return Segmenter(in_channels=4, regions={"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]}, patch_size=[size] * 3,
                     **network_settings(net, size))


def network_settings(net: str, size: int) -> dict[str, Any]:
    """The Segmenter settings of `net` for size^3 patches: UNet and SwinUNETR as the BraTS seed sizes them, DynUNet
    as the plan of `experiment=brats_segmentation` builds it on 1 mm volumes (nnU-Net's pooling and kernel rules,
    `medvol.volumes.network_topology.pool_and_conv_props`)."""
    if net != "dynunet":
        return {"net": net, "features": [32, 64, 128, 256, 320], "feature_size": 48}
    from medvol.volumes.network_topology import pool_and_conv_props

    cfg = composed(["experiment=brats_segmentation", "dataset.root=/unused"], job_name="segmentation_bench")
    found = pool_and_conv_props([1.0, 1.0, 1.0], [size] * 3)
    strides = [[int(s) for s in step] for step in found.strides]
    kernels = [[int(k) for k in kernel] for kernel in found.kernels]
    levels = min(len(cfg.model.plan.features), len(strides))
    return {"net": "dynunet", "features": list(cfg.model.plan.features)[:levels], "strides": strides[:levels],
            "kernels": kernels[:levels], "deep_supervision": levels >= 3}


def gpu(args: argparse.Namespace) -> None:
    import torch

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu: no CUDA device visible")
    name = torch.cuda.get_device_name() if cuda else "cpu (fp32)"
    print(f"{name}; batch {args.batch} of 4 channels x {args.size}^3, {'bf16-mixed autocast, ' if cuda else ''}"
          f"AdamW, {args.steps} timed steps")
    print("| net | parameters (M) | samples/s | step (ms) | peak memory (GiB) |\n|---|---|---|---|---|")
    rows = []
    for net in args.nets:
        torch.manual_seed(0)
        settings = network_settings(net, args.size)
        module = planned_segmenter(net, args.size).to(device)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        image = torch.randn(args.batch, 4, *[args.size] * 3, device=device)
        target = (torch.rand(args.batch, 3, *[args.size] * 3, device=device) > 0.9).to(torch.uint8)
        if cuda:
            # As hardware=gpu trains (trainer.benchmark): cuDNN picks its fastest kernels for the fixed patch.
            torch.backends.cudnn.benchmark = True
            torch.cuda.reset_peak_memory_stats()
        train_steps(module, optimizer, image, target, 3 if cuda else 1)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_steps(module, optimizer, image, target, args.steps)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
        rows.append({
            "net": net, "settings": settings, "parameters_m": sum(p.numel() for p in module.parameters()) / 1e6,
            "samples_per_s": args.batch / seconds, "step_ms": seconds * 1000,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        })
        peak = f"{rows[-1]['peak_gib']:.1f}" if cuda else "-"
        print(f"| {net} | {rows[-1]['parameters_m']:.1f} | {rows[-1]['samples_per_s']:.2f} | "
              f"{rows[-1]['step_ms']:.0f} | {peak} |", flush=True)
        del module, optimizer
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"device": name, "batch": args.batch, "size": args.size, "steps": args.steps, "rows": rows}, indent=1
        ))


# ---- real: medvol against nnU-Net v2 and a plain MONAI script on the same files (issues 28 and 35) -----------------

# Per dataset: how its files are written, the structures scored (name -> label values in the files), how
# medvol reads it, and nnU-Net's labels (its BraTS convention: 1 oedema, 2 necrosis, 3 enhancing, as regions).
DATASETS: dict[str, dict[str, Any]] = {
    "brats": {"kind": "brats", "spacing": (4.0, 4.0, 4.0)},
    "thick": {"kind": "brats", "spacing": (2.0, 2.0, 6.0)},
    "ct": {"kind": "ct", "spacing": (3.0, 3.0, 5.0)},
}


def write_ct_organ_lesions(root: Path, subjects: int, spacing: tuple[float, ...], seed: int = 0) -> Path:
    """`root/<case>/ct.nii.gz` (int16 HU, RAS) and `seg.nii.gz` (1 organ, 2 lesion): an abdomen-like body (fat
    around muscle and soft tissue), an organ (a smooth lobe, ~60 HU) and a hypodense lesion inside it (10-35 HU,
    6-22 mm), per subject their own sizes, positions and noise."""
    import nibabel as nib
    import numpy as np
    from scipy import ndimage

    extent = np.asarray([320.0, 260.0, 200.0])
    shape = tuple(int(round(e / s)) for e, s in zip(extent, spacing, strict=True))
    affine = np.diag([*spacing, 1.0])
    grid = np.meshgrid(*[(np.arange(n) + 0.5) * s - e / 2 for n, s, e in zip(shape, spacing, extent, strict=True)],
                       indexing="ij")
    for index in range(subjects):
        rng = np.random.default_rng([seed, index])
        x, y, z = grid
        body = (x / rng.uniform(140, 155)) ** 2 + (y / rng.uniform(100, 120)) ** 2 < 1
        inner = (x / 125) ** 2 + (y / 90) ** 2 < 1
        centre = np.asarray([rng.uniform(-70, -30), rng.uniform(-20, 20), rng.uniform(-30, 30)])
        semi = np.asarray([rng.uniform(55, 75), rng.uniform(45, 60), rng.uniform(45, 70)])
        wobble = ndimage.gaussian_filter(rng.standard_normal(shape), 3) * 0.15
        organ = (((x - centre[0]) / semi[0]) ** 2 + ((y - centre[1]) / semi[1]) ** 2
                 + ((z - centre[2]) / semi[2]) ** 2 + wobble) < 1
        radius = rng.uniform(6, 22)
        spot = centre + rng.uniform(-0.4, 0.4, 3) * semi
        lesion = organ & (((x - spot[0]) ** 2 + (y - spot[1]) ** 2 + (z - spot[2]) ** 2) < radius**2)
        hu = np.full(shape, -1000.0)
        hu[body] = -100.0
        hu[body & inner] = 40.0
        hu[organ & body] = rng.uniform(55, 70)
        hu[lesion & body] = rng.uniform(10, 35)
        hu = ndimage.gaussian_filter(hu, 0.6) + rng.normal(0, rng.uniform(8, 15), shape)
        label = np.zeros(shape, dtype=np.uint8)
        label[organ & body] = 1
        label[lesion & body] = 2
        case = root / f"case{index:04d}"
        case.mkdir(parents=True, exist_ok=True)
        nib.save(nib.Nifti1Image(hu.astype(np.int16), affine), str(case / "ct.nii.gz"))
        nib.save(nib.Nifti1Image(label, affine), str(case / "seg.nii.gz"))
    return root


# medvol's arms: the planned default and the departures measured against it (overrides of the default).
MEDVOL_ARMS = {
    "medvol": [],
    "medvol-noaug": ["model.plan.augmentation=false"],
    "medvol-nods": ["model.plan.deep_supervision=false"],
    "medvol-base32": ["model.plan.base_features=32"],
    "medvol-adam": [
        "model.optimizer._target_=torch.optim.Adam", "~model.optimizer.momentum", "~model.optimizer.nesterov",
        "model.optimizer.lr=1e-3",
    ],
}


def medvol_arms(names: Sequence[str]) -> dict[str, list[str]]:
    """The medvol arms among `names` with their overrides: MEDVOL_ARMS's, and any of them followed by `-seed<N>`
    (`medvol-seed3`, `medvol-nods-seed3`) with the training seed N (conf/train.yaml's 42 otherwise): how much of one
    run's result is the seed."""
    arms = {}
    for name in names:
        seeded = re.fullmatch(r"(medvol.*)-seed(\d+)", name)
        base, seed = (seeded.group(1), [f"seed={seeded.group(2)}"]) if seeded else (name, [])
        if base in MEDVOL_ARMS:
            arms[name] = [*MEDVOL_ARMS[base], *seed]
    return arms


def nnunet_arm(
    kind: str, root: Path, split: dict[str, list[str]], out: Path, venv: Path, budget: dict[str, Any], dataset_id: int,
) -> dict[str, Any]:
    """nnU-Net v2 through its own CLI on the same files and split: plan and preprocess at medvol's target spacing,
    train fold 0 (= medvol's train/val split) for the same optimizer steps on the CPU, predict the test subjects
    with its mirroring; the masks scored."""
    raw, preprocessed, results = out / "nnUNet_raw", out / "nnUNet_preprocessed", out / "nnUNet_results"
    trainers = out / "trainers"
    trainers.mkdir(parents=True, exist_ok=True)
    (trainers / f"{TRAINER_NAME}.py").write_text(BUDGET_TRAINER)
    name = nnunet_dataset(kind, root, raw, dataset_id, split)
    env = {
        "nnUNet_raw": str(raw), "nnUNet_preprocessed": str(preprocessed), "nnUNet_results": str(results),
        "nnUNet_extTrainer": str(trainers), "nnUNet_n_proc_DA": "2", "nnUNet_compile": "f",
        "MEDVOL_NNUNET_EPOCHS": str(budget["epochs"]), "MEDVOL_NNUNET_ITERATIONS": str(budget["iterations"]),
        "MEDVOL_NNUNET_VAL_ITERATIONS": str(budget["val_iterations"]),
    }
    bin_dir = venv / "bin"
    # nnU-Net's axes are the reverse of NIfTI's (SimpleITK order).
    spacing = [str(s) for s in reversed(budget["spacing"])]
    plan_wall, plan_peak = timed(
        [str(bin_dir / "nnUNetv2_plan_and_preprocess"), "-d", str(dataset_id), "-c", "3d_fullres", "-np", "2",
         "-overwrite_target_spacing", *spacing, "--verify_dataset_integrity"],
        out / "plan.log", env,
    )
    # Fold 0 is medvol's split: the same training and validation subjects.
    (preprocessed / name / "splits_final.json").write_text(json.dumps([{"train": split["train"], "val": split["val"]}]))
    train_wall, train_peak = timed(
        [str(bin_dir / "nnUNetv2_train"), str(dataset_id), "3d_fullres", "0", "-tr", TRAINER_NAME, "-device", "cpu"],
        out / "train.log", env,
    )
    predicted = out / "test-predictions"
    predict_wall, predict_peak = timed(
        [str(bin_dir / "nnUNetv2_predict"), "-i", str(raw / name / "imagesTs"), "-o", str(predicted), "-d",
         str(dataset_id), "-c", "3d_fullres", "-f", "0", "-tr", TRAINER_NAME, "-device", "cpu", "-npp", "1",
         "-nps", "1", "--disable_progress_bar"],
        out / "predict.log", env,
    )
    plans = json.loads((preprocessed / name / "nnUNetPlans.json").read_text())["configurations"]["3d_fullres"]
    back = {theirs: ours for ours, theirs in TO_NNUNET[kind].items()}
    return {
        "scores": score_folder(kind, root, predicted, split["test"], "{subject}.nii.gz", back),
        "steps": budget["epochs"] * budget["iterations"], "batch": plans["batch_size"], "patch": plans["patch_size"],
        "spacing": plans["spacing"], "train_s": train_wall, "predict_s": predict_wall, "plan_s": plan_wall,
        "peak_mib": max(plan_peak, train_peak, predict_peak),
    }


def plain_monai_arm(root: Path, split: dict[str, list[str]], epochs: int, spacing: float) -> dict[str, Any]:
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
    best, best_dice, steps = copy.deepcopy(net.state_dict()), -1.0, 0
    for _ in range(epochs):
        net.train()
        for batch in train:
            optimizer.zero_grad()
            loss(net(batch["image"]), batch["label"]).backward()
            optimizer.step()
            steps += 1
        net.eval()
        with torch.no_grad():
            dice = [float(((torch.sigmoid(net(i["image"][None])) > 0.5) * i["label"][None]).sum() * 2
                          / ((torch.sigmoid(net(i["image"][None])) > 0.5).sum() + i["label"].sum() + 1e-6))
                    for i in evaluation["val"]]
        if np.mean(dice) > best_dice:
            best, best_dice = copy.deepcopy(net.state_dict()), float(np.mean(dice))
    train_wall = time.perf_counter() - start
    net.load_state_dict(best)
    net.eval()
    rows = []
    start = time.perf_counter()
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
            rows.append(structure_scores(
                on_source[0].numpy(), np.asarray(truth.dataobj), STRUCTURES["brats"],
                [float(z) for z in truth.header.get_zooms()[:3]],
            ))
    return {"scores": mean_scores(rows), "steps": steps, "batch": 2, "patch": "whole volume",
            "spacing": [spacing] * 3, "train_s": train_wall, "predict_s": time.perf_counter() - start}


def monai_arm_in_a_process(root: Path, split_file: Path, epochs: int, spacing: float, out: Path) -> dict[str, Any]:
    """The plain MONAI arm in a process of its own, so its peak memory is its own."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "monai.log"
    timed_result = timed(
        [sys.executable, __file__, "_monai-arm", str(root), str(split_file), str(epochs), str(spacing)], log
    )
    result = next(json.loads(line) for line in reversed(log.read_text().splitlines()) if line.startswith('{"scores"'))
    return {**result, "peak_mib": timed_result[1]}


def mirroring(args: argparse.Namespace) -> None:
    """Test Dice/HD95 and prediction time of one trained medvol run with and without test-time mirroring:
    `python predict.py ckpt_path=<best> split=test tta=true|false`, scored against the label files."""
    from datamodules.pipeline.split import make_split, save_split
    from datamodules.sources.brain_lesions import write_brain_lesions

    out = Path(args.out).resolve()
    spacing = tuple(args.spacing or DATASETS["brats"]["spacing"])
    tag = f"brats-{args.subjects}s-{'x'.join(f'{s:g}' for s in spacing)}mm"
    root = out / f"data-{tag}"
    if not root.is_dir():
        write_brain_lesions(root, args.subjects, spacing, seed=args.seed)
    ids = sorted(p.name for p in root.iterdir() if p.is_dir())
    split = make_split(ids, 0.15, 0.15, args.seed)
    split_file = out / f"split-{tag}.json"
    save_split(split_file, split, args.seed)
    run_dir = out / f"medvol-{tag}-{args.epochs}ep"
    if args.checkpoint:
        best = str(Path(args.checkpoint).resolve())
    else:
        if not (run_dir / "summary.json").is_file():
            medvol_arm("brats", root, split_file, run_dir, args.epochs, split["test"])
        best = json.loads((run_dir / "summary.json").read_text())["best_checkpoint"]
    lines = [f"{tag}, {args.epochs} epochs, {len(split['test'])} test subjects, best checkpoint {Path(best).name}",
             table_header(["mirroring", "Dice WT", "Dice TC", "Dice ET", "HD95 WT", "HD95 TC", "HD95 ET",
                           "predict (s)"])]
    for tta in ("false", "true"):
        folder = out / f"tta-{tta}-{tag}"
        wall, _ = timed(
            [sys.executable, str(ROOT / "predict.py"), f"ckpt_path={best}", "split=test", f"output_dir={folder}",
             "device=cpu", f"tta={tta}"], out / f"tta-{tta}.log", cwd=out,
        )
        scores = score_folder("brats", root, folder, split["test"], "{subject}_seg.nii.gz")
        names = list(STRUCTURES["brats"])
        lines.append(f"| {tta} | " + " | ".join(f"{scores[f'dice_{n}']:.3f}" for n in names) + " | "
                     + " | ".join(f"{scores[f'hd95_{n}']:.1f}" for n in names) + f" | {wall:.1f} |")
    print("\n".join(lines))
    with (out / "results.md").open("a") as handle:
        handle.write("\n".join(lines) + "\n\n")


def profile(args: argparse.Namespace) -> None:
    """Where a planned training step and a predict call spend their time, on a trained run's own plan and data.

    The step is timed part by part (loading a batch, the label check, cutting the patches, the forward with
    and without the deep-supervision heads, the loss, the backward, the optimizer step), median of
    `--repeats` after two warm-up steps; the predict call part by part for one test subject (preprocessing,
    the sliding window without and with mirroring, the probabilities onto the source grid, the label map
    and post-processing, the metrics, the NIfTI, the picture). One thread (`OMP_NUM_THREADS=1`)."""
    import statistics

    import torch
    from omegaconf import open_dict

    from lightning_modules.segmentation.patch_sampling import cut_patches, patch_origins
    from medvol.core.build import build, build_model
    from medvol.run.predict_inputs import batches, dataset_subjects
    from medvol.run.trained_run import open_trained_run
    from medvol.volumes.prediction_writer import PredictionWriter
    from medvol.volumes.source_grid import logits_to_source_grid

    torch.set_num_threads(1)
    run_dir = Path(args.run).resolve()
    best = json.loads((run_dir / "summary.json").read_text())["best_checkpoint"]
    run = open_trained_run(best).config
    with open_dict(run):
        run.dataset.cache, run.dataset.num_workers = "none", 0
    module = build_model(run.model)
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    datamodule = build(run.dataset)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    parts: dict[str, list[float]] = {}

    def clock(name: str, start: float) -> float:
        now = time.perf_counter()
        parts.setdefault(name, []).append(now - start)
        return now

    module.train()
    batches_iter = iter(loader)
    for step in range(args.repeats + 2):
        if step == 2:
            parts.clear()
        start = time.perf_counter()
        try:
            batch = next(batches_iter)
        except StopIteration:
            batches_iter = iter(loader)
            batch = next(batches_iter)
        start = clock("load a batch", start)
        image, label = batch["image"], batch["label"]
        module.scheme.check_label(label)
        start = clock("label check", start)
        shape = list(image.shape[2:])
        origins = patch_origins(image.shape[0], None, shape, module.patch_size, module.hparams.pos_ratio)
        image, label = cut_patches(image, origins, module.patch_size), cut_patches(label, origins, module.patch_size)
        start = clock("cut patches", start)
        output = module(image)
        start = clock("forward (with deep-supervision heads)" if output.dim() == 6 else "forward", start)
        loss = module.training_loss(output, module.scheme.target(label))
        start = clock("loss", start)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        start = clock("backward", start)
        optimizer.step()
        clock("optimizer step", start)
    total = sum(statistics.median(v) for v in parts.values())
    print(f"training step, plan patch {module.patch_size} x batch {image.shape[0]}, features {module.features}, "
          f"deep supervision {module.supervision_weights is not None}; median of {args.repeats} steps, 1 thread")
    print("| part | ms | share |\n|---|---|---|")
    for name, values in parts.items():
        print(f"| {name} | {1000 * statistics.median(values):.1f} | {statistics.median(values) / total:.0%} |")
    print(f"| **step** | **{1000 * total:.1f}** | |")

    module.eval()
    inputs = dataset_subjects(run, None, "test", False, {})
    batch = next(batches(inputs.dataset))
    window = module.window(batch["image"])
    rows = []
    with torch.no_grad():
        start = time.perf_counter()
        batch = next(batches(inputs.dataset))
        rows.append(("preprocess one subject (load, reorient, resample, normalise)", time.perf_counter() - start))
        for tta in (False, True):
            start = time.perf_counter()
            logits = module.logits(batch["image"], window, tta)
            rows.append((f"sliding window, mirroring {'on (8 copies)' if tta else 'off'}", time.perf_counter() - start))
        grid = (batch["source_affine"][0], batch["source_shape"][0])
        start = time.perf_counter()
        source = module.scheme.activation(logits_to_source_grid(
            logits[0], grid, batch["affine"][0], module.scheme.background_logits())[None])
        rows.append(("logits onto the source grid (nnU-Net's resampling), then the softmax or sigmoid",
                     time.perf_counter() - start))
        start = time.perf_counter()
        label_map = module.label_maps(source)
        rows.append(("threshold/argmax and post-processing", time.perf_counter() - start))
        start = time.perf_counter()
        outputs = module.outputs_of(batch, logits)
        rows.append(("all of the above from logits, with Dice/HD95 against the label file",
                     time.perf_counter() - start))
        out = Path(args.out).resolve() / "profile-predict"
        writer = PredictionWriter(out)
        start = time.perf_counter()
        writer.write({**outputs, "segments": {}}, batch)
        rows.append(("write the mask (NIfTI)", time.perf_counter() - start))
        start = time.perf_counter()
        writer.write(outputs, batch)
        rows.append(("write the mask, its volumes and its picture", time.perf_counter() - start))
    print(f"\npredict, one test subject {tuple(batch['source_shape'][0].tolist())} (model grid "
          f"{tuple(batch['image'].shape[2:])}), 1 thread; label map {tuple(label_map.shape[2:])}")
    print("| part | s |\n|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} |")


def nnunet_step(plans_file: str, channels: int, regions: int, patch: list[int], batch: int, repeats: int) -> dict:
    """In nnU-Net's venv: seconds of one training step of nnU-Net's own network (from its plans, deep supervision)
    and loss (Dice + BCE per region, targets pooled to each head, its weights) with its SGD, on random data of
    `batch` x `patch` (median of `repeats` after one warm-up)."""
    import torch

    from benchmarks.segmentation.nnunet_plans import nnunet_network_and_loss

    torch.set_num_threads(1)
    configuration = json.loads(Path(plans_file).read_text())["configurations"]["3d_fullres"]
    architecture = configuration["architecture"]
    net, loss, scales = nnunet_network_and_loss(architecture, channels, configuration["batch_dice"], regions)
    optimizer = torch.optim.SGD(net.parameters(), 1e-2, momentum=0.99, nesterov=True, weight_decay=3e-5)
    image = torch.randn(batch, channels, *patch)
    full = (torch.rand(batch, regions, *patch) > 0.9).float()
    targets = [torch.nn.functional.interpolate(full, scale_factor=tuple(s), mode="nearest") if any(x != 1 for x in s)
               else full for s in scales]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        value = loss(net(image), targets)
        value.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    parameters = sum(p.numel() for p in net.parameters()) / 1e6
    return {"seconds": sorted(times[1:])[len(times[1:]) // 2], "parameters_m": parameters,
            "features": architecture["arch_kwargs"]["features_per_stage"]}


def medvol_step(run_dir: Path, deep_supervision: bool, repeats: int) -> dict:
    """Seconds of one planned medvol training step (forward, loss, backward, optimizer) on random data of the plan's
    batch x patch, with or without the deep-supervision heads (median of `repeats` after one warm-up)."""
    import torch
    from omegaconf import open_dict

    from medvol.core.build import build_model
    from medvol.run.trained_run import open_trained_run

    torch.set_num_threads(1)
    best = json.loads((run_dir / "summary.json").read_text())["best_checkpoint"]
    run = open_trained_run(best).config
    with open_dict(run):
        run.model.deep_supervision = deep_supervision
    module = build_model(run.model).train()
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    plan = json.loads((run_dir / "plan.json").read_text())
    batch, patch = int(plan["batch_size"]), list(module.patch_size)
    image = torch.randn(batch, module.hparams.in_channels, *patch)
    target = (torch.rand(batch, module.scheme.out_channels, *patch) > 0.9).to(torch.uint8)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        module.training_loss(module(image), target).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    parameters = sum(p.numel() for p in module.net.parameters()) / 1e6
    return {"seconds": sorted(times[1:])[len(times[1:]) // 2], "parameters_m": parameters,
            "features": module.features, "batch": batch, "patch": patch}


def same_step(args: argparse.Namespace) -> None:
    """nnU-Net's training step against medvol's on the same weights and batch, at a real plan's size: nnU-Net's
    side in its venv (`benchmarks/segmentation/nnunet_plans.py step --plans`: its network, loss, target pooling,
    clipping and SGD); here medvol's planned Segmenter from a run's config (DynUNet without residual blocks, deep
    supervision, `training_loss`) with nnU-Net's initial weights, its optimizer and the run's gradient clip. Prints the
    output norm per head, the gradients' largest relative difference, and the losses step by step."""
    import torch
    from omegaconf import open_dict

    from benchmarks.segmentation.nnunet_plans import dynunet_parameter, load_nnunet_weights, nested_regions
    from medvol.core.build import build_model
    from medvol.run.trained_run import open_trained_run

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        record_file = Path(folder) / "nnunet.pt"
        subprocess.run([str(Path(args.nnunet_venv) / "bin" / "python"),
                        str(ROOT / "benchmarks" / "segmentation" / "nnunet_plans.py"),
                        "step", "--plans", args.nnunet_plans, "--steps", str(args.steps), "--out", str(record_file)],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        theirs = torch.load(record_file, weights_only=True)
    best = json.loads((Path(args.run).resolve() / "summary.json").read_text())["best_checkpoint"]
    run = open_trained_run(best).config
    with open_dict(run):
        run.model.deep_supervision = True
    module = build_model(run.model).train()
    load_nnunet_weights(module.net, theirs)
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    setting = theirs["setting"]
    image, regions = theirs["image"].float(), torch.from_numpy(nested_regions(setting["batch"], setting["patch"]))
    losses = []
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        output = module(image)
        value = module.training_loss(output, regions)
        value.backward()
        if step == 0:
            norms = [float(h.detach().double().norm()) for h in [output[:, 0], *module.net.heads]]
            ours = {n: p.grad.double().norm() for n, p in module.net.named_parameters()}
            worst = max(
                (abs(float(ours[dynunet_parameter(n, theirs["stages"])]) - g) / max(g, 1e-12), n)
                for n, g in theirs["grad_norms"].items() if dynunet_parameter(n, theirs["stages"]) is not None
            )
        torch.nn.utils.clip_grad_norm_(module.net.parameters(), float(run.trainer.gradient_clip_val))
        optimizer.step()
        losses.append(float(value.detach()))
    print(f"one fixed batch {tuple(image.shape)} of 3 regions, nnU-Net's initial weights in both "
          f"({theirs['made_by']}), {args.steps} SGD steps")
    print("| compared | nnU-Net | medvol |\n|---|---|---|")
    for level, (a, b) in enumerate(zip(theirs["output_norms"], norms, strict=True)):
        print(f"| output norm at 1/{2**level} | {a:.6f} | {b:.6f} |")
    print(f"| largest relative difference of a gradient's norm ({worst[1]}) | | {worst[0]:.1e} |")
    for step, (a, b) in enumerate(zip(theirs["losses"], losses, strict=True)):
        print(f"| loss, step {step} (medvol's minus 1: MONAI's Dice loss is 1 - Dice, nnU-Net's -Dice) | {a:.6f} "
              f"| {b - 1:.6f} |")


def step_times(args: argparse.Namespace) -> None:
    """One training step on the same batch x patch: medvol's planned DynUNet with and without deep supervision and
    nnU-Net's planned network with its loss, each in a process of its own, interleaved `--rounds` times (the
    machine is shared: each round's three figures were measured side by side in time)."""
    run_dir = Path(args.run).resolve()
    plan = json.loads((run_dir / "plan.json").read_text())
    regions = len(STRUCTURES["brats"])
    rows: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for name, command in (
            ("medvol, deep supervision on", [sys.executable, __file__, "_medvol-step", str(run_dir), "1",
                                             str(args.repeats)]),
            ("medvol, deep supervision off", [sys.executable, __file__, "_medvol-step", str(run_dir), "0",
                                              str(args.repeats)]),
            ("nnU-Net (its plan's network and loss)", [
                str(Path(args.nnunet_venv) / "bin" / "python"), __file__, "_nnunet-step", args.nnunet_plans, "4",
                str(regions), *[str(p) for p in plan["patch_size"]], str(plan["batch_size"]), str(args.repeats)]),
        ):
            result = subprocess.run(command, capture_output=True, text=True, check=True,
                                    env=child_env(threads=1))
            rows.setdefault(name, []).append(json.loads(result.stdout.strip().splitlines()[-1]))
    print(f"one training step, batch {plan['batch_size']} x patch {plan['patch_size']} (4 channels, 3 regions), "
          f"1 thread, median of {args.repeats} steps per process, {args.rounds} interleaved rounds")
    print("| network | features | parameters (M) | step (s), per round |\n|---|---|---|---|")
    for name, results in rows.items():
        print(f"| {name} | {results[0]['features']} | {results[0]['parameters_m']:.2f} | "
              + ", ".join(f"{r['seconds']:.2f}" for r in results) + " |")


def real(args: argparse.Namespace) -> None:
    """Every arm on the same generated files and split of each dataset; one table per dataset."""
    import torch

    from datamodules.pipeline.split import make_split, save_split
    from datamodules.sources.brain_lesions import write_brain_lesions

    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    for number, dataset in enumerate(args.datasets):
        setting = DATASETS[dataset]
        kind = setting["kind"]
        spacing = tuple(args.spacing) if args.spacing and dataset == "brats" else setting["spacing"]
        tag = f"{dataset}-{args.subjects}s-{'x'.join(f'{s:g}' for s in spacing)}mm"
        root = out / f"data-{tag}"
        if not root.is_dir():
            if kind == "brats":
                write_brain_lesions(root, args.subjects, spacing, seed=args.seed)
            else:
                write_ct_organ_lesions(root, args.subjects, spacing, seed=args.seed)
        ids = sorted(p.name for p in root.iterdir() if p.is_dir())
        split = make_split(ids, 0.15, 0.15, args.seed)
        split_file = out / f"split-{tag}.json"
        save_split(split_file, split, args.seed)
        results: dict[str, dict[str, Any]] = {}
        iterations = [f"model.plan.iterations_per_epoch={args.iterations}"] if args.iterations else []
        for arm, extra in medvol_arms(args.arms).items():
            arm_dir = out / f"{arm}-{tag}-{args.epochs}ep"
            results[arm] = finished(arm_dir, partial(
                medvol_arm, kind, root, split_file, arm_dir, args.epochs, split["test"], [*iterations, *extra]
            ))
        if "nnunet" in args.arms:
            if "medvol" not in results:
                raise SystemExit("the nnunet arm takes its budget (optimizer steps, spacing) from the medvol arm")
            budget = {
                "epochs": args.epochs, "iterations": results["medvol"]["steps_per_epoch"],
                "val_iterations": max(1, len(split["val"])), "spacing": results["medvol"]["spacing"] or list(spacing),
            }
            arm_dir = out / f"nnunet-{tag}-{args.epochs}ep"
            results["nnunet"] = finished(
                arm_dir, partial(nnunet_arm, kind, root, split, arm_dir, Path(args.nnunet_venv), budget, 500 + number)
            )
        if "monai" in args.arms and kind == "brats":
            arm_dir = out / f"monai-{tag}-{args.epochs}ep"
            results["monai"] = finished(
                arm_dir, partial(monai_arm_in_a_process, root, split_file, args.epochs, args.monai_spacing, arm_dir)
            )
        table = results_table(tag, kind, results)
        print(table)
        with (out / "results.md").open("a") as handle:
            handle.write(table + "\n\n")
        (out / f"results-{tag}-{args.epochs}ep.json").write_text(json.dumps(results, indent=2))


def results_table(tag: str, kind: str, results: dict[str, dict[str, Any]]) -> str:
    names = list(STRUCTURES[kind])
    header = (
        f"{tag}\n\n| arm | optimizer steps (batch) | "
        + " | ".join(f"Dice {n}" for n in names) + " | " + " | ".join(f"HD95 {n} (mm)" for n in names)
        + " | train (s) | predict (s) | peak memory (MiB) | data wait |\n|" + "---|" * (2 * len(names) + 6)
    )
    lines = [header]
    for arm, r in results.items():
        s = r["scores"]
        lines.append(
            f"| {arm} | {r['steps']} ({r['batch']}) | " + " | ".join(f"{s[f'dice_{n}']:.3f}" for n in names) + " | "
            + " | ".join(f"{s[f'hd95_{n}']:.1f}" if math.isfinite(s[f"hd95_{n}"]) else "-" for n in names)
            + f" | {r['train_s']:.0f} | {r['predict_s']:.0f} | {r.get('peak_mib', float('nan')):.0f}"
            + (f" | {r['data_wait']:.1%} |" if r.get("data_wait") is not None else " | - |")
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_nnunet-step":
        plans, channels, regions, *patch, batch, repeats = sys.argv[2:]
        print(json.dumps(nnunet_step(plans, int(channels), int(regions), [int(p) for p in patch], int(batch),
                                     int(repeats))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_medvol-step":
        print(json.dumps(medvol_step(Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_monai-arm":
        import torch

        from datamodules.pipeline.split import load_split

        torch.set_num_threads(1)
        root, split_file, epochs, spacing = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
        split = load_split(split_file, sorted(p.name for p in root.iterdir() if p.is_dir()))
        print(json.dumps(plain_monai_arm(root, split, epochs, spacing)))
        print("done")
        return
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
    device.add_argument("--nets", nargs="+", default=["unet", "swinunetr"], choices=["unet", "swinunetr", "dynunet"])
    device.add_argument("--batch", type=int, default=2)
    device.add_argument("--steps", type=int, default=20)
    device.add_argument("--size", type=int, default=128, help="patch edge in voxels")
    device.add_argument("--device", default="cuda", help="cpu: a check of the command at a small --size")
    device.add_argument("--json", help="also write the rows to this file")
    side = sub.add_parser("real")
    side.add_argument("--subjects", type=int, default=48)
    side.add_argument("--datasets", type=comma_list, default=["brats"], help="brats, thick, ct (comma-separated)")
    side.add_argument("--spacing", type=float, nargs=3, default=None, help="the brats dataset's spacing (4 4 4)")
    side.add_argument("--monai-spacing", type=float, default=4.0)
    side.add_argument("--epochs", type=int, default=60)
    side.add_argument("--iterations", type=int, default=None, help="medvol's batches an epoch (null: the plan's 250)")
    side.add_argument("--arms", type=comma_list, default=["medvol", "nnunet", "monai"],
                      help="medvol,medvol-noaug,medvol-nods,medvol-base32,medvol-adam (each also <arm>-seed<N>),"
                           "nnunet,monai")
    side.add_argument("--nnunet-venv", default="/work/nnunet-venv", help="the venv holding nnunetv2 (its CLI)")
    side.add_argument("--seed", type=int, default=0)
    side.add_argument("--out", default="outputs/benchmarks/segmentation-real")
    mirror = sub.add_parser("mirroring")
    mirror.add_argument("--subjects", type=int, default=24)
    mirror.add_argument("--spacing", type=float, nargs=3, default=None)
    mirror.add_argument("--epochs", type=int, default=20)
    mirror.add_argument("--seed", type=int, default=0)
    mirror.add_argument("--checkpoint", default=None, help="a checkpoint of a run on the same data: no training")
    mirror.add_argument("--out", default="outputs/benchmarks/segmentation-mirroring")
    where = sub.add_parser("profile")
    where.add_argument("--run", required=True, help="a trained medvol segmentation run (its summary.json)")
    where.add_argument("--repeats", type=int, default=10)
    where.add_argument("--out", default="outputs/benchmarks/segmentation-profile")
    steps = sub.add_parser("step-time")
    steps.add_argument("--run", required=True, help="a trained medvol segmentation run (its plan.json)")
    steps.add_argument("--nnunet-plans", required=True, help="nnUNetPlans.json of the same data (the real arm's)")
    steps.add_argument("--nnunet-venv", default="/work/nnunet-venv")
    steps.add_argument("--repeats", type=int, default=3)
    steps.add_argument("--rounds", type=int, default=2)
    same = sub.add_parser("same-step")
    same.add_argument("--run", required=True, help="a trained medvol segmentation run at nnU-Net's width (base 32)")
    same.add_argument("--nnunet-plans", required=True, help="nnUNetPlans.json of the same data (the real arm's)")
    same.add_argument("--nnunet-venv", default="/work/nnunet-venv")
    same.add_argument("--steps", type=int, default=5)
    from benchmarks.segmentation.segmentation_protocol import add_arguments, check, run_protocol

    add_arguments(sub.add_parser("protocol"))
    args, overrides = parser.parse_known_args()
    if args.task == "protocol":
        check(args)
        run_protocol(args)
    elif args.task == "same-step":
        same_step(args)
    elif args.task == "step-time":
        step_times(args)
    elif args.task == "profile":
        profile(args)
    elif args.task == "mirroring":
        Path(args.out).mkdir(parents=True, exist_ok=True)
        mirroring(args)
    elif args.task == "real":
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
