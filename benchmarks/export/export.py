"""export.py's figures: one window through PyTorch, TorchScript and ONNX Runtime; export time and file sizes; the
whole MONAI bundle on scans against predict.py, structure by structure and stage by stage.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/export/export.py [--parts window,bundle] [--window 128]
        [--features 32,64,128,256,320] [--repeats 5] [--threads 2] [--scan 96,96,64] [--scans 1] [--epochs 2]
        [--workdir DIR]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/export/export.py --parts real [--subjects 12] [--scans 4]
        [--epochs 12] [--iterations 50] [--scan-spacing 2] [--run DIR] [--workdir DIR]

`window`:
1. A segmentation network (DynUNet, 4 MR channels in, the BraTS regions out, `--features` per level) as export.py
   exports it (`network`: logits, no mirroring), on one `--window`^3 window on the CPU with `--threads` threads
   in each runtime: PyTorch eager, the TorchScript file, the ONNX file through ONNX Runtime. The median wall time
   of `--repeats` calls after one warm-up call, all in one process, one runtime after the other.
2. The export of that network to each format: the wall time (tracing or exporting, writing, and the check
   against PyTorch at two sizes), the file's size, the largest difference from PyTorch.

`bundle`: a tiny BraTS-region model trained for `--epochs` epochs on BraTS-layout phantoms (`python train.py
experiment=brats_segmentation`, one channel, 32^3 patches), its output biases then set so that WT, TC and ET cover
3%, 1% and 0.4% of the first scan's phantom (`with_small_regions`: a model that predicts every structure), exported
as a bundle; `--scans` unseen phantom scans of `--scan` voxels (1.2 x 0.9 x 2.5 mm, LPS) through `python
predict.py` and through `python -m monai.bundle run` in an interpreter that can import only torch, monai, fire and
what the bundle's metadata.json declares (`declared_site`): their wall times and, per scan and structure, the
agreement of the two masks (`structure_agreement`).

`real`: BraTS-2021 case folders on real anatomy (`datamodules.sources.brain_lesions`: the MNI152 templates in
nilearn's wheel, one lesion per brain, tumour a fraction of a percent of the volume): `--subjects` brains at 4 mm
train a BraTS-regions model as a user types it (`python train.py model=segmentation dataset=brats
dataset.label_regions=[WT,TC,ET]`: the plan at 4 mm, Adam 1e-3 as docs/segmentation.md gives it for short CPU
runs, `--epochs` x `--iterations` steps; `--run` reuses such a run), its post-processing set to keep the largest
component of all foreground and of ET (`postprocessing.json`, as a fold sweep decides it), exported as a bundle;
`--scans` unseen brains at `--scan-spacing` mm, given to `python predict.py` as nnU-Net channel files and to the
bundle as one 4D file each (the same voxels and affines); per scan and structure the agreement of the two masks,
then the two pipelines stage by stage on the first scan (`stage_agreement`).

The agreement of two masks (`structure_agreement`), per structure (a region's or class's label values in the
written files): the voxels of each, the Dice between them, and over the union of the two masks' foreground the
share of voxels where the label values are equal; the label values each file holds.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, composed, median_seconds, table_header  # noqa: E402
from datamodules.sources.phantom import make_phantom  # noqa: E402
from lightning_modules.segmentation.segmentation import Segmenter  # noqa: E402
from medvol.run.bundle import DESCRIPTION_PREFIX, PACKAGES_KEY, SOURCE_KEY  # noqa: E402
from medvol.run.exporting import write_networks  # noqa: E402
from medvol.run.inference_preflight import CPU_WINDOW_BATCH  # noqa: E402

BRATS_REGIONS = {"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]}
LPS_AFFINE = np.array([[-1.2, 0, 0, 30.0], [0, -0.9, 0, 21.0], [0, 0, 2.5, -40.0], [0, 0, 0, 1]])
# The packages a bundle may always import: PyTorch, MONAI and fire (MONAI's command line), with what they require.
BUNDLE_BASE = ("torch", "monai", "fire")
# `python -I -S -c RUN_BUNDLE SITE ARGS...`: `python -m monai.bundle ARGS` with the standard library and SITE alone on
# `sys.path` (no site-packages, no .pth file, not the current folder).
RUN_BUNDLE = """
import runpy, sys
sys.path.append(sys.argv[1])
sys.argv = ["monai.bundle", *sys.argv[2:]]
runpy.run_module("monai.bundle", run_name="__main__", alter_sys=True)
"""
# The share of a scan's non-zero voxels each region covers once `with_small_regions` set the output biases.
SMALL_REGIONS = {"WT": 0.03, "TC": 0.01, "ET": 0.004}
ADAM = ["model.optimizer._target_=torch.optim.Adam", "~model.optimizer.momentum", "~model.optimizer.nesterov",
        "model.optimizer.lr=1e-3"]


def window_figures(args: argparse.Namespace, workdir: Path) -> None:
    import onnxruntime

    torch.set_num_threads(args.threads)
    features = [int(f) for f in args.features.split(",")]
    size = [args.window] * 3
    torch.manual_seed(0)
    module = Segmenter(in_channels=4, net="dynunet", regions=BRATS_REGIONS, features=features, patch_size=size).eval()
    network = module.exported_networks(size)[0]
    print(f"## {args.window}^3 window, DynUNet features {features}, 4 channels -> 3 regions, {args.threads} threads")
    print("| format | export + check (s) | file (MiB) | max |difference| from PyTorch |")
    print("|---|---|---|---|")
    files = {}
    for chosen in ("torchscript", "onnx"):
        folder = workdir / chosen
        folder.mkdir()
        started = time.perf_counter()
        record = write_networks(folder, [network], chosen, 17)["networks"][0]
        seconds = time.perf_counter() - started
        files[chosen] = folder / record["file"]
        difference = max(v["max_abs_difference"] for v in record["check"].values() if isinstance(v, dict))
        print(f"| {chosen} | {seconds:.1f} | {files[chosen].stat().st_size / 2**20:.1f} | {difference:.2e} |")
    window = torch.randn(1, 4, *size, generator=torch.Generator().manual_seed(1))
    scripted = torch.jit.load(str(files["torchscript"]))
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(files["onnx"]), options, providers=["CPUExecutionProvider"])
    feed = {"image": window.numpy()}
    with torch.no_grad():
        runtimes = {
            "PyTorch eager": lambda: network.network(window),
            "TorchScript": lambda: scripted(window),
            "ONNX Runtime (CPU)": lambda: session.run(None, feed),
        }
        print("\n" + table_header(["runtime", f"median of {args.repeats} (s)"]))
        for name, call in runtimes.items():
            print(f"| {name} | {median_seconds(call, args.repeats):.2f} |")


def write_brats(root: Path, subjects: int, shape: tuple[int, int, int], first: int = 4) -> None:
    for i in range(subjects):
        phantom = make_phantom(0, first + i, shape)
        case = f"BraTS2021_{i:05d}"
        seg = np.zeros(shape, dtype=np.uint8)
        seg[phantom.label == 2] = 2
        seg[phantom.label == 1] = 4
        files = {"seg": seg, "flair": (phantom.channels["flair"] * 1000).astype(np.int16)}
        for name, data in files.items():
            path = root / case / f"{case}_{name}.nii.gz"
            path.parent.mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(data, LPS_AFFINE), str(path))


def timed(command: list[str], **kwargs) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, **kwargs)
    return time.perf_counter() - started


def requirements(names: Iterable[str]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions `names` and, recursively, every one they require (their extras left out)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, importlib.metadata.Distribution] = {}
    pending = list(names)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found:
            continue
        found[name] = importlib.metadata.distribution(name)
        for line in found[name].requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return found


def declared_site(packages: Iterable[str], folder: Path) -> Path:
    """A site-packages folder of links holding only torch, monai, fire, `packages` and what they require (every
    file their RECORD lists: modules, compiled libraries, metadata), built from this venv: on `sys.path` alone it
    lets an interpreter import nothing else (not scipy, not scikit-image, not medvol, unless declared)."""
    folder.mkdir(parents=True, exist_ok=True)
    for distribution in requirements([*BUNDLE_BASE, *packages]).values():
        for entry in {file.parts[0] for file in distribution.files or []} - {"..", "__pycache__"}:
            target = Path(str(distribution.locate_file(entry)))
            if target.exists() and not (folder / entry).exists():
                (folder / entry).symlink_to(target)
    return folder


def declared_packages(bundle: Path) -> dict[str, str]:
    return json.loads((bundle / "configs" / "metadata.json").read_text())[PACKAGES_KEY]


def run_bundle(bundle: Path, scans: Path, out: Path, workdir: Path) -> subprocess.CompletedProcess:
    """`python -m monai.bundle run` of `bundle` on `scans` into `out`, in an interpreter that can import only torch,
    monai, fire and the packages the bundle's metadata.json declares (`declared_site`), from `workdir`."""
    site = declared_site(declared_packages(bundle), workdir / f"site-{bundle.name}")
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HOME": str(workdir)}
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", RUN_BUNDLE, str(site), "run", "--config_file",
         str(bundle / "configs" / "inference.json"), "--bundle_root", str(bundle), "--dataset_dir", str(scans),
         "--output_dir", str(out)],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=3600,
    )


def written_structures(bundle: Path) -> dict[str, list[int]]:
    """Structure -> the label values it covers in the written masks, as the bundle's metadata.json records them."""
    labels = json.loads((bundle / "configs" / "metadata.json").read_text())["medvol"]["output_file"]["labels"]
    if all(isinstance(v, list) for v in labels.values()):
        return {name: [int(v) for v in values] for name, values in labels.items()}
    return {name: [int(value)] for value, name in labels.items() if int(value) != 0}


def mask_agreement(expected: np.ndarray, got: np.ndarray, structures: Mapping[str, list[int]]) -> dict[str, Any]:
    """Two label maps of one scan compared per structure (voxels of each, their Dice) and over the union of their
    foreground (the share of its voxels whose label values are equal); the values each holds."""
    per_structure = {}
    for name, values in structures.items():
        ours, theirs = np.isin(expected, values), np.isin(got, values)
        total = int(ours.sum()) + int(theirs.sum())
        per_structure[name] = {"predict": int(ours.sum()), "bundle": int(theirs.sum()),
                               "dice": 2.0 * int((ours & theirs).sum()) / total if total else float("nan")}
    union = (expected != 0) | (got != 0)
    return {"structures": per_structure, "union": int(union.sum()),
            "agree": float((expected[union] == got[union]).mean()) if union.any() else 1.0,
            "values": {"predict": sorted(int(v) for v in np.unique(expected)),
                       "bundle": sorted(int(v) for v in np.unique(got))}}


def structure_agreement(reference: Path, other: Path, structures: Mapping[str, list[int]]) -> dict[str, Any]:
    """Per `<scan>_seg.nii.gz` of `other` (the bundle's) predict.py's mask of the same scan in `reference` (the same
    name, or nnU-Net's `<scan>.nii.gz` where predict read nnU-Net channel files), on the same grid, compared by
    `mask_agreement`."""
    found = {}
    for path in sorted(other.glob("*_seg.nii.gz")):
        scan = path.name.removesuffix("_seg.nii.gz")
        mine = next((reference / n for n in (path.name, f"{scan}.nii.gz") if (reference / n).is_file()), None)
        if mine is None:
            raise SystemExit(f"{scan}: predict.py wrote no mask of it in {reference}")
        ours, theirs = nib.load(str(mine)), nib.load(str(path))
        if theirs.shape != ours.shape or not np.allclose(theirs.affine, ours.affine, atol=1e-5):
            raise SystemExit(f"{path.name}: the bundle's grid {theirs.shape} differs from predict.py's {ours.shape}")
        found[scan] = mask_agreement(np.asarray(ours.dataobj), np.asarray(theirs.dataobj), structures)
    return found


def agreement_table(found: Mapping[str, Any]) -> str:
    names = list(next(iter(found.values()))["structures"])
    lines = [table_header(["scan", *(f"{n}: voxels predict / bundle, Dice" for n in names), "union of foreground",
                           "labels agree on", "label values"])]
    for scan, row in found.items():
        cells = [f"{s['predict']} / {s['bundle']}, {s['dice']:.4f}" for s in row["structures"].values()]
        values = row["values"]
        same = values["predict"] == values["bundle"]
        lines.append(f"| {scan} | {' | '.join(cells)} | {row['union']} | {100 * row['agree']:.3f}% | "
                     f"{values['predict']}{'' if same else ' vs ' + str(values['bundle'])} |")
    return "\n".join(lines)


def bundle_figures(args: argparse.Namespace, workdir: Path) -> None:
    shape = tuple(int(s) for s in args.scan.split(","))
    write_brats(workdir / "brats", 6, (48, 48, 32))
    run_dir = workdir / "run"
    timed([sys.executable, str(ROOT / "train.py"), "experiment=brats_segmentation", f"dataset.root={workdir / 'brats'}",
           "dataset.image_modalities=[flair]", "model.plan.patch_size=[32,32,32]", "model.plan.features=[8,16,32]",
           "dataset.num_workers=0", "dataset.batch_size=2", f"trainer.max_epochs={args.epochs}", "hardware=cpu",
           "logger=none", "callbacks.progress_bar=null", "callbacks.volume_slices=null", "print_config=false",
           f"hydra.run.dir={run_dir}"], cwd=ROOT)
    scans = workdir / "scans"
    scans.mkdir()
    for i in range(args.scans):
        data = (make_phantom(0, 1000 + i, shape).channels["flair"] * 1000).astype(np.int16)
        nib.save(nib.Nifti1Image(data, LPS_AFFINE), str(scans / f"scan{i}.nii.gz"))
    ckpt = with_small_regions(run_dir / "checkpoints" / "last.ckpt", [scans / "scan0.nii.gz"], SMALL_REGIONS)
    export_seconds = timed([sys.executable, str(ROOT / "export.py"), f"ckpt_path={ckpt}", "format=bundle",
                            f"output_dir={workdir / 'bundle'}"], cwd=ROOT)
    predict_seconds = timed([sys.executable, str(ROOT / "predict.py"), f"ckpt_path={ckpt}", f"input={scans}",
                             f"output_dir={workdir / 'predict'}", "device=cpu"], cwd=ROOT)
    started = time.perf_counter()
    ran = run_bundle(workdir / "bundle", scans, workdir / "bundle-out", workdir)
    bundle_seconds = time.perf_counter() - started
    if ran.returncode:
        raise SystemExit(f"the bundle failed:\n{ran.stderr[-3000:]}")
    size = sum(f.stat().st_size for f in (workdir / "bundle").rglob("*") if f.is_file()) / 2**20
    print(f"\n## Bundle vs predict.py: {args.scans} scan(s) of {shape} voxels, model trained {args.epochs} epoch(s)")
    print(table_header(["step", "wall (s)"]))
    print(f"| export.py format=bundle ({size:.2f} MiB) | {export_seconds:.1f} |")
    print(f"| python predict.py | {predict_seconds:.1f} |")
    print(f"| python -m monai.bundle run (declared packages only: {declared_packages(workdir / 'bundle')}) "
          f"| {bundle_seconds:.1f} |")
    print()
    print(agreement_table(structure_agreement(workdir / "predict", workdir / "bundle-out",
                                              written_structures(workdir / "bundle"))))


def with_small_regions(ckpt: Path, files: list[Path], shares: dict[str, float]) -> Path:
    """A copy of `ckpt` beside it whose output biases make each region cover about `shares` of the non-zero voxels
    (a brain, a phantom) of the scan `files` (its channel files) on the model grid, mirroring included (each bias
    found by bisection) for a model of regions (a sigmoid channel each): a model that predicts every structure, small
    ones included."""
    from monai.transforms import Compose

    from datamodules.pipeline.transforms import TransformSettings, deterministic_transforms
    from medvol.run.bundle import inference_settings
    from medvol.run.trained_run import open_trained_run

    trained = open_trained_run(str(ckpt))
    run_config, module = trained.config, trained.module(torch.device("cpu"))
    settings = TransformSettings.from_config(inference_settings(module, run_config))
    image = Compose(deterministic_transforms(settings, ["image"], None))({"image": [str(f) for f in files]})["image"]
    brain = (image != 0).any(0)
    bias = module.net.output_block.conv.conv.bias
    target = torch.tensor([shares[name] for name in module.scheme.names])
    # The regions are separate sigmoid channels: every channel's bias halves its interval at each pass.
    low, high = torch.full_like(target, -30.0), torch.full_like(target, 30.0)
    for _ in range(16):
        with torch.no_grad():
            bias.copy_((low + high) / 2)
            probabilities = module.probabilities(image[None], tta=module.tta)[0]
        above = (probabilities[:, brain] > 0.5).float().mean(1) > target
        low, high = torch.where(above, low, (low + high) / 2), torch.where(above, (low + high) / 2, high)
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    checkpoint["state_dict"]["net.output_block.conv.conv.bias"] = bias.detach().clone()
    path = ckpt.with_name(f"small-regions-{ckpt.name}")
    torch.save(checkpoint, path)
    return path


def real_scans(source: Path, channels: Path, four_d: Path, modalities: list[str]) -> None:
    """Each BraTS case folder of `source` as nnU-Net channel files (`<case>_0000` ... in `modalities`' order) in
    `channels` and as one 4D file (channels on the last axis) in `four_d`: the same voxels and affine."""
    channels.mkdir(parents=True)
    four_d.mkdir(parents=True)
    for case in sorted(p.name for p in source.iterdir() if p.is_dir()):
        volumes = []
        for k, modality in enumerate(modalities):
            image = nib.load(str(source / case / f"{case}_{modality}.nii.gz"))
            nib.save(image, str(channels / f"{case}_{k:04d}.nii.gz"))
            volumes.append(np.asarray(image.dataobj))
        nib.save(nib.Nifti1Image(np.stack(volumes, -1), image.affine), str(four_d / f"{case}.nii.gz"))


def trained_real_run(args: argparse.Namespace, workdir: Path) -> Path:
    """A BraTS-regions model trained on real-anatomy brains at 4 mm (or `--run`), its post-processing set to keep the
    largest component of all foreground and of ET; its best checkpoint."""
    from datamodules.sources.brain_lesions import write_brain_lesions

    run_dir = args.run
    if run_dir is None:
        root = write_brain_lesions(workdir / "train-4mm", args.subjects, (4.0, 4.0, 4.0), seed=0)
        run_dir = workdir / "run"
        seconds = timed(
            [sys.executable, str(ROOT / "train.py"), "model=segmentation", "dataset=brats",
             "dataset.label_regions=[WT,TC,ET]", f"dataset.root={root}", f"trainer.max_epochs={args.epochs}",
             f"model.plan.iterations_per_epoch={args.iterations}", "hardware=cpu", "logger=csv",
             "callbacks.progress_bar=null", "callbacks.volume_slices=null", "print_config=false",
             f"hydra.run.dir={run_dir}", *ADAM], cwd=ROOT)
        print(f"trained {args.epochs} x {args.iterations} steps in {seconds:.0f} s -> {run_dir}")
    # Recorded as chosen on cross-validation folds, so that predict.py and export.py apply it by default (a single
    # split's choice is written, not applied).
    (run_dir / "postprocessing.json").write_text(json.dumps({"steps": [
        {"name": "all foreground", "values": [1, 2, 3]}, {"name": "ET", "values": [3]}], "folds": 5}))
    return Path(json.loads((run_dir / "summary.json").read_text())["best_checkpoint"])


def real_figures(args: argparse.Namespace, workdir: Path) -> None:
    from datamodules.sources.brain_lesions import write_brain_lesions

    ckpt = trained_real_run(args, workdir)
    spacing = (args.scan_spacing,) * 3
    source = write_brain_lesions(workdir / "scans-brats", args.scans, spacing, seed=7)
    modalities = ["t1", "t1ce", "t2", "flair"]
    real_scans(source, workdir / "channels", workdir / "scans", modalities)
    export_seconds = timed([sys.executable, str(ROOT / "export.py"), f"ckpt_path={ckpt}", "format=bundle",
                            f"output_dir={workdir / 'bundle'}"], cwd=ROOT)
    predict_seconds = timed([sys.executable, str(ROOT / "predict.py"), f"ckpt_path={ckpt}",
                             f"input={workdir / 'channels'}", f"output_dir={workdir / 'predict'}", "device=cpu"],
                            cwd=ROOT)
    started = time.perf_counter()
    ran = run_bundle(workdir / "bundle", workdir / "scans", workdir / "bundle-out", workdir)
    bundle_seconds = time.perf_counter() - started
    if ran.returncode:
        raise SystemExit(f"the bundle failed:\n{ran.stderr[-3000:]}")
    truth = {}
    for case in sorted(p.name for p in source.iterdir() if p.is_dir()):
        label = np.asarray(nib.load(str(source / case / f"{case}_seg.nii.gz")).dataobj)
        truth[case] = {name: int(np.isin(label, values).sum()) for name, values in
                       {"WT": [1, 2, 4], "TC": [1, 4], "ET": [4]}.items()}
        truth[case]["share"] = float((label > 0).mean())
    print(f"\n## Bundle vs predict.py on real anatomy: {args.scans} unseen brains at {args.scan_spacing:g} mm "
          f"(4 channels), a model planned at 4 mm ({ckpt})")
    print(table_header(["step", "wall (s)"]))
    print(f"| export.py format=bundle | {export_seconds:.1f} |")
    print(f"| python predict.py (channel files) | {predict_seconds:.1f} |")
    print(f"| python -m monai.bundle run (4D files; declared packages only: "
          f"{declared_packages(workdir / 'bundle')}) | {bundle_seconds:.1f} |")
    print("\n| scan | tumour voxels in the label file: WT, TC, ET (share of the volume) |\n|---|---|")
    for case, counts in truth.items():
        print(f"| {case} | {counts['WT']}, {counts['TC']}, {counts['ET']} ({100 * counts['share']:.2f}%) |")
    found = structure_agreement(workdir / "predict", workdir / "bundle-out", written_structures(workdir / "bundle"))
    print()
    print(agreement_table(found))
    union = sum(r["union"] for r in found.values())
    agree = sum(r["agree"] * r["union"] for r in found.values()) / max(union, 1)
    print(f"\nover all scans: labels agree on {100 * agree:.3f}% of the {union} voxels of the union of the foreground")
    (workdir / "agreement.json").write_text(json.dumps(found, indent=2))
    first = sorted(source.iterdir())[0].name
    rows = stage_agreement(ckpt, workdir / "bundle", workdir / "channels", workdir / "scans" / f"{first}.nii.gz")
    print(f"\n## Stage by stage on {first}\n| stage | predict.py vs the bundle |\n|---|---|")
    for stage, result in rows:
        print(f"| {stage} | {result} |")


def predict_config(ckpt: Path, channels: Path) -> Any:
    """predict.py's composed config for `ckpt` on the files of `channels`, as the current Hydra job."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    GlobalHydra.instance().clear()
    cfg = composed(["device=cpu", f"ckpt_path={ckpt}", f"input={channels}", f"output_dir={channels.parent / 'unused'}"],
                   config_name="predict", job_name="predict", return_hydra_config=True)
    HydraConfig().set_config(cfg)
    GlobalHydra.instance().clear()
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def difference(ours: Any, theirs: Any) -> str:
    """The grid and the largest |difference| of two (C, D, H, W) volumes with their affines."""
    (a, a_affine), (b, b_affine) = ours, theirs
    if tuple(a.shape) != tuple(b.shape):
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    same_grid = np.allclose(a_affine, b_affine, atol=1e-5)
    gap = float((a.double() - b.double()).abs().max())
    return f"grid {'equal' if same_grid else 'DIFFERS'} {tuple(a.shape[1:])}, max |difference| {gap:.3g}"


def thresholded(ours: torch.Tensor, theirs: torch.Tensor, threshold: float) -> str:
    gap = float((ours.double() - theirs.double()).abs().max())
    union = int(((ours > threshold) | (theirs > threshold)).sum())
    differ = int(((ours > threshold) != (theirs > threshold)).sum())
    return f"max |difference| {gap:.3g}; above {threshold} in one only: {differ} of the {union} above it in either"


def described(parser: Any, name: str) -> list[tuple[str, Any]]:
    """The parsed transforms of the bundle's Compose `name`, each with the predict.py step its `_desc_` names."""
    steps = parser[name]["transforms"]
    parsed = parser.get_parsed_content(name).transforms
    return [(str(s.get("_desc_", "")).removeprefix(DESCRIPTION_PREFIX), t) for s, t in zip(steps, parsed, strict=True)]


def stage_agreement(ckpt: Path, bundle: Path, channels: Path, scan: Path) -> list[tuple[str, str]]:
    """predict.py's pipeline and the bundle's on one subject, stage by stage (predict.py given its nnU-Net channel
    files in `channels`, the bundle the 4D file `scan`): each step of predict.py's dataset against the bundle's step
    doing it (the grid after it and the largest difference); the window logits on the same input (predict.py's eager
    network, mirroring and blending against the bundle's inferer on its TorchScript), compared as probabilities;
    then, each fed with predict.py's previous stage, the probabilities on the scan's grid (the logits resampled, then
    the softmax or sigmoid), the label maps before and after the post-processing, and the label values written."""
    from monai.bundle import ConfigParser
    from monai.data import MetaTensor

    from medvol.core.build import build
    from medvol.run.ensemble import predictor
    from medvol.run.predict_check import predict_request
    from medvol.run.predict_inputs import find_inputs
    from medvol.run.predict_job import label_file_values
    from medvol.run.trained_run import open_trained_runs
    from medvol.volumes.sliding_window import SlidingWindow
    from medvol.volumes.source_grid import logits_to_source_grid

    cfg = predict_config(ckpt, channels)
    runs = open_trained_runs(str(ckpt), model=cfg.get("model"))
    run = runs.first.config
    request = predict_request(cfg, run)
    module = predictor(runs, torch.device("cpu"), request.tta, request.postprocessing)
    subject = scan.name.removesuffix(".gz").removesuffix(".nii")
    with tempfile.TemporaryDirectory() as scratch:
        inputs = find_inputs(request, run, module, Path(scratch))
        item = dict(next(r for r in inputs.records if str(r["subject"]) == subject))
        ours = {}
        for transform in build(inputs.config).deterministic("test"):
            item = transform(item)
            image = item["image"]
            ours[type(transform).__name__] = (torch.as_tensor(np.asarray(image)).clone(),
                                              np.asarray(getattr(image, "affine", item.get("affine"))))
    parser = ConfigParser()
    parser.read_config(str(bundle / "configs" / "inference.json"))
    parser["bundle_root"] = str(bundle)
    data: Any = {"image": str(scan)}
    theirs = {}
    for name, transform in described(parser, "preprocessing"):
        data = transform(data)
        theirs[name] = (torch.as_tensor(np.asarray(data["image"])).clone(), np.asarray(data["image"].affine))
    rows = [(f"preprocessing: {name}", difference(ours[name], theirs[name])) for name in ours if name in theirs]
    image = ours["EnsureTyped"][0][None]
    batch_size = request.sizes.sw_batch_size
    window = SlidingWindow.of(request.roi, overlap=request.overlap, mode=request.mode,
                              batch_size=CPU_WINDOW_BATCH if batch_size == "auto" else int(batch_size))
    scheme, threshold = module.scheme, float(module.scheme.threshold)
    with torch.no_grad():
        logits = module.logits(image, window, module.tta)
        bundled = parser.get_parsed_content("inferer")(image, parser.get_parsed_content("network"))
    rows.append(("window logits (eager, mirrored, blended) vs TorchScript through SlidingWindowInferer, as "
                 "probabilities", thresholded(scheme.activation(logits), scheme.activation(bundled), threshold)))
    batch = inputs.dataset[0] if len(inputs.dataset) == 1 else next(
        inputs.dataset[i] for i, r in enumerate(inputs.records) if str(r["subject"]) == subject)
    source = scheme.activation(logits_to_source_grid(
        logits[0].float(), (batch["source_affine"], batch["source_shape"]), batch["affine"], scheme.background_logits()
    )[None])[0]
    labels = scheme.label_map(scheme.discretise(source[None]))[0]
    kept = module.label_maps(source[None])[0]
    lookup = label_file_values(module)
    written = torch.tensor(lookup)[kept] if lookup is not None else kept
    expected = {"to_source_grid": source, "label_maps": labels, "Postprocessing": kept, "label_values": written}
    fed = {"to_source_grid": logits[0].float(), "label_maps": source, "Postprocessing": labels,
           "label_values": kept}
    # The bundle's steps of each stage: the logits' resampling and the softmax or sigmoid give the probabilities.
    doing = {"to_source_grid": ("logits_to_source_grid", "activation")}
    structures = {name: list(values) for name, values in scheme.segments.items()}
    steps = described(parser, "postprocessing")
    for stage in expected:
        chain = [t for name, t in steps if name in doing.get(stage, (stage,))]
        if not chain:
            continue
        meta = data["image"].meta if stage == "to_source_grid" else data[SOURCE_KEY].meta
        result: Any = {**data, "pred": MetaTensor(fed[stage].clone(), meta=dict(meta))}
        for transform in chain:
            result = transform(result)
        got = torch.as_tensor(np.asarray(result["pred"]))
        if stage == "to_source_grid":
            rows.append(("probabilities on the scan's grid: logits_to_source_grid and the activation vs the bundle's",
                         thresholded(expected[stage], got, threshold)))
            continue
        if stage == "label_values" and lookup is not None:
            structures = {name: [lookup[v] for v in members] for name, members in scheme.segments.items()}
        agreement = mask_agreement(expected[stage][0].numpy(), got[0].numpy(), structures)
        dice = ", ".join(f"{name} {s['dice']:.4f} ({s['predict']} voxels)" for name, s in
                         agreement["structures"].items())
        rows.append((f"{stage}: label maps on the scan's grid", f"Dice {dice}; labels agree on "
                     f"{100 * agreement['agree']:.3f}% of the union ({agreement['union']}); values "
                     f"{agreement['values']['predict']} vs {agreement['values']['bundle']}"))
    return rows



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="window,bundle", help="comma-separated: window, bundle, real")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--features", default="32,64,128,256,320")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scan", default="96,96,64")
    parser.add_argument("--scans", type=int, default=None, help="bundle: 1 phantom scan; real: 4 brains")
    parser.add_argument("--epochs", type=int, default=None, help="bundle: 2; real: 12")
    parser.add_argument("--subjects", type=int, default=12)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--scan-spacing", type=float, default=2.0)
    parser.add_argument("--run", type=Path, default=None, help="real: a trained run to reuse")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    parts = args.parts.split(",")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="medvol-export-"))
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if "window" in parts:
        window_figures(args, workdir)
    if "bundle" in parts:
        bundle_figures(argparse.Namespace(**{**vars(args), "scans": args.scans or 1, "epochs": args.epochs or 2}),
                       workdir)
    if "real" in parts:
        real_figures(argparse.Namespace(**{**vars(args), "scans": args.scans or 4, "epochs": args.epochs or 12}),
                     workdir)


if __name__ == "__main__":
    main()
