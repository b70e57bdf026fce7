"""export.py's figures: one window through PyTorch, TorchScript and ONNX Runtime; export time and file sizes; the
whole MONAI bundle on scans against predict.py.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/export.py [--window 128] [--features 32,64,128,256,320]
        [--repeats 5] [--threads 2] [--scan 96,96,64] [--scans 1] [--epochs 2] [--workdir DIR] [--skip-bundle]

1. A segmentation network (DynUNet, 4 MR channels in, the BraTS regions out, `--features` per level) as export.py
   exports it (`network`: logits, no mirroring), on one `--window`^3 window on the CPU with `--threads` threads
   in each runtime: PyTorch eager, the TorchScript file, the ONNX file through ONNX Runtime. The median wall time
   of `--repeats` calls after one warm-up call, all in one process, one runtime after the other.
2. The export of that network to each format: the wall time (tracing or exporting, writing, and the check
   against PyTorch at two sizes), the file's size, the largest difference from PyTorch.
3. A tiny BraTS-region model trained for `--epochs` epochs on BraTS-layout phantoms (`python train.py
   experiment=brats_segmentation`, one channel, 32^3 patches), exported as a bundle; `--scans` unseen phantom
   scans of `--scan` voxels (1.2 x 0.9 x 2.5 mm, LPS) through `python predict.py` and through
   `python -m monai.bundle run` (an interpreter that cannot import medvol): their wall times and the share of
   mask voxels that agree.
"""

from __future__ import annotations

import argparse
import os
import shutil
import site
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datamodules.sources.phantom import make_phantom  # noqa: E402
from lightning_modules.segmentation.segmentation import Segmenter  # noqa: E402
from medvol.run.exporting import write_networks  # noqa: E402

BRATS_REGIONS = {"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]}
LPS_AFFINE = np.array([[-1.2, 0, 0, 30.0], [0, -0.9, 0, 21.0], [0, 0, 2.5, -40.0], [0, 0, 0, 1]])
# Runs `python -m monai.bundle` where nothing of the repository can be imported (the venv's .pth files unread).
ISOLATED = """
import importlib.util, runpy, sys
sys.path.append(sys.argv[1])
assert not any(importlib.util.find_spec(m) for m in ("medvol", "lightning_modules", "datamodules"))
sys.argv = ["monai.bundle", *sys.argv[2:]]
runpy.run_module("monai.bundle", run_name="__main__", alter_sys=True)
"""


def median_seconds(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


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
        print(f"\n| runtime | median of {args.repeats} (s) |")
        print("|---|---|")
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


def bundle_figures(args: argparse.Namespace, workdir: Path) -> None:
    shape = tuple(int(s) for s in args.scan.split(","))
    write_brats(workdir / "brats", 6, (48, 48, 32))
    run_dir = workdir / "run"
    timed([sys.executable, str(ROOT / "train.py"), "experiment=brats_segmentation", f"dataset.root={workdir / 'brats'}",
           "dataset.image_modalities=[flair]", "model.plan.patch_size=[32,32,32]", "model.plan.features=[8,16,32]",
           "dataset.num_workers=0", "dataset.batch_size=2", f"trainer.max_epochs={args.epochs}", "hardware=cpu",
           "logger=none", "callbacks.progress_bar=null", "callbacks.volume_slices=null", "print_config=false",
           f"hydra.run.dir={run_dir}"], cwd=ROOT)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    scans = workdir / "scans"
    scans.mkdir()
    for i in range(args.scans):
        data = (make_phantom(0, 1000 + i, shape).channels["flair"] * 1000).astype(np.int16)
        nib.save(nib.Nifti1Image(data, LPS_AFFINE), str(scans / f"scan{i}.nii.gz"))
    export_seconds = timed([sys.executable, str(ROOT / "export.py"), f"ckpt_path={ckpt}", "format=bundle",
                            f"output_dir={workdir / 'bundle'}"], cwd=ROOT)
    predict_seconds = timed([sys.executable, str(ROOT / "predict.py"), f"ckpt_path={ckpt}", f"input={scans}",
                             f"output_dir={workdir / 'predict'}", "device=cpu"], cwd=ROOT)
    packages = next(p for p in site.getsitepackages() if (Path(p) / "monai").is_dir())
    outside = workdir / "elsewhere"
    outside.mkdir()
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HOME": str(outside)}
    bundle_seconds = timed([sys.executable, "-S", "-c", ISOLATED, packages, "run", "--config_file",
                            str(workdir / "bundle" / "configs" / "inference.json"), "--bundle_root",
                            str(workdir / "bundle"), "--dataset_dir", str(scans), "--output_dir",
                            str(workdir / "bundle-out")], cwd=outside, env=env, stderr=subprocess.DEVNULL)
    agree = []
    for path in sorted((workdir / "predict").glob("*_seg.nii.gz")):
        ours = np.asarray(nib.load(str(path)).dataobj)
        theirs = np.asarray(nib.load(str(workdir / "bundle-out" / path.name)).dataobj)
        agree.append(float((ours == theirs).mean()))
    size = sum(f.stat().st_size for f in (workdir / "bundle").rglob("*") if f.is_file()) / 2**20
    print(f"\n## Bundle vs predict.py: {args.scans} scan(s) of {shape} voxels, model trained {args.epochs} epoch(s)")
    print("| step | wall (s) |")
    print("|---|---|")
    print(f"| export.py format=bundle ({size:.2f} MiB) | {export_seconds:.1f} |")
    print(f"| python predict.py | {predict_seconds:.1f} |")
    print(f"| python -m monai.bundle run (medvol not importable) | {bundle_seconds:.1f} |")
    print(f"\nmask voxels equal, per scan: {', '.join(f'{a:.5f}' for a in agree)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--features", default="32,64,128,256,320")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scan", default="96,96,64")
    parser.add_argument("--scans", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--skip-bundle", action="store_true")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="medvol-export-"))
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    window_figures(args, workdir)
    if not args.skip_bundle:
        bundle_figures(args, workdir)


if __name__ == "__main__":
    main()
