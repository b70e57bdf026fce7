"""Data pipeline speed and memory: `dataset.cache` modes, partitioned caching under DDP, and whole runs with `auto` vs
none.

    OMP_NUM_THREADS=1 python benchmarks/data/data_pipeline.py --subjects 64 --size 128
    OMP_NUM_THREADS=1 python benchmarks/data/data_pipeline.py --parts train --train-runs brats synthetic
        --work /tmp/bench

1. Writes a NIfTI set (synthetic CT phantoms, `--distinct` of them generated, the rest copies).
2. For each cache mode, loads the training set through `NiftiDataModule` (percentile scaling,
   RAS, a random flip after the cache) for `--epochs` epochs and reports volumes/s of the
   first epoch (which includes filling the cache) and of the later ones.
3. Starts 1 and then 2 gloo ranks (CPU) with `cache=memory` and reports each rank's peak RSS
   growth while filling its cache, next to the size of one copy of the data.
4. (`--parts train`) Runs `python train.py` with `dataset.cache=auto` and `none`: the BraTS segmentation
   command of issue 23 on `--brats-subjects` BraTS 2021 cases of `--brats-size` voxels (`--brats-distinct`
   phantoms written by `datamodules.sources.example_data` when `--brats` has none, the rest copies), and the
   default synthetic run; reports
   per epoch the data-wait fraction and the epoch time (`telemetry/*` in the CSV log), the cache's choice
   and fill time, samples/s and peak host memory (`summary.json`), and the load average. `--compare-root`
   adds the default run of another checkout (e.g. an export of main: "before"); `--train-overrides`
   go to every run (`hardware=gpu`).
5. (`--parts loader`) The wait for each batch of a memory-cached BraTS set (the train command's
   transforms, `--loader-subjects` cases) between busy 300 ms steps, read by the main process, by one
   worker process, and by MONAI's `ThreadDataLoader` (what medvol uses for such a set).

Prints Markdown tables and writes the figures as JSON (`--out`).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # fair to the 2-core CI machine; set before torch loads

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from monai.data import ThreadDataLoader  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks.common import ROOT, child_env, logged_rows, run_folder, table_header  # noqa: E402
from datamodules.pipeline.cache import SmartCacheLifecycle, compact_cache_fill, find_smart_cache  # noqa: E402
from datamodules.sources.brats import BratsDataModule  # noqa: E402
from datamodules.sources.example_data import write_brats, write_nifti_folder  # noqa: E402
from datamodules.sources.nifti import NiftiDataModule  # noqa: E402

MODES = ("none", "memory", "smart", "disk")
# The command of issue 23 (add dataset.root=DIR), and the default run.
TRAIN_RUNS = {
    "brats": ["model=segmentation", "dataset=brats", "model.regions={WT:[1,2,3],TC:[1,3],ET:[3]}",
              "dataset.transforms.spacing=[4,4,4]"],
    "synthetic": [],
}


def make_dataset(root: Path, subjects: int, size: int, distinct: int) -> Path:
    """`subjects` CT volumes of `size`^3 under root/sub-NNN/ct.nii.gz; only `distinct` are generated."""
    if (root / f"sub-{subjects - 1:03d}" / "ct.nii.gz").is_file():
        return root
    write_nifti_folder(root, min(distinct, subjects), size, modalities=("ct",), label=False)
    for i in range(distinct, subjects):
        target = root / f"sub-{i:03d}" / "ct.nii.gz"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / f"sub-{i % distinct:03d}" / "ct.nii.gz", target)
    return root


def make_brats(root: Path, subjects: int, size: list[int], distinct: int) -> Path:
    """`subjects` BraTS 2021 cases of `size` voxels; only `distinct` are generated (15 s each at BraTS size), the rest
    are copies under their own case names (each is still read and transformed on its own)."""
    last = f"BraTS2021_{subjects - 1:05d}"
    if (root / last / f"{last}_seg.nii.gz").is_file():
        return root
    if not (root / f"BraTS2021_{distinct - 1:05d}" / f"BraTS2021_{distinct - 1:05d}_seg.nii.gz").is_file():
        write_brats(root, min(distinct, subjects), 2021, size)
    for i in range(distinct, subjects):
        source, case = f"BraTS2021_{i % distinct:05d}", f"BraTS2021_{i:05d}"
        (root / case).mkdir(parents=True, exist_ok=True)
        for file in (root / source).iterdir():
            shutil.copyfile(file, root / case / file.name.replace(source, case))
    return root


def datamodule(root: Path, mode: str, cache_dir: Path, smart_rate: float) -> NiftiDataModule:
    return NiftiDataModule(
        root=str(root), image_modalities=["ct"], num_workers=0, batch_size=1, val_fraction=0.0, test_fraction=0.0,
        transforms={"intensity": "percentile", "flip_prob": 0.5}, cache=mode, cache_dir=str(cache_dir),
        cache_rate=smart_rate if mode == "smart" else 1.0, replace_rate=0.25,
    )


def throughput(root: Path, mode: str, epochs: int, cache_dir: Path, smart_rate: float) -> dict[str, float]:
    """Volumes/s of the first epoch (cache filling included) and the mean of the later epochs."""
    start = time.perf_counter()
    dm = datamodule(root, mode, cache_dir, smart_rate)
    dm.setup()
    loader = dm.train_dataloader()
    smart = find_smart_cache(dm.datasets["train"])
    lifecycle = SmartCacheLifecycle(smart) if smart is not None else None
    times, counts = [], []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        if lifecycle is not None:
            lifecycle.on_train_epoch_start(None, None)  # type: ignore[arg-type]
        count = 0
        for batch in loader:
            count += batch["image"].shape[0]
        if lifecycle is not None:
            lifecycle.on_train_epoch_end(None, None)  # type: ignore[arg-type]
        now = time.perf_counter()
        times.append(now - start)
        counts.append(count)
        start = now
    if lifecycle is not None:
        lifecycle.teardown(None, None, "fit")  # type: ignore[arg-type]
    later = sum(counts[1:]) / sum(times[1:])
    return {"first_epoch_s": times[0], "first_volumes_per_s": counts[0] / times[0], "later_volumes_per_s": later,
            "volumes_per_epoch": counts[-1]}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """This process's RSS high-water mark (VmHWM; unlike ru_maxrss it is not inherited from the launcher)."""
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _reset_peak_rss() -> None:
    """Start the high-water mark from the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _rank(rank: int, world: int, root: str, init_file: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # Warm up (lazy imports, loader machinery, allocator pools) on two uncached batches, so the baseline excludes them.
    warm = datamodule(Path(root), "none", Path(root), 1.0)
    warm.setup()
    for _, _batch in zip(range(2), warm.train_dataloader(), strict=False):
        pass
    del warm, _batch
    with compact_cache_fill():  # trims the heap, as the cache does first anyway: a fair baseline
        pass
    dm = datamodule(Path(root), "memory", Path(root), 1.0)
    _reset_peak_rss()
    baseline = _rss_bytes()
    dm.setup()
    for _ in dm.train_dataloader():
        pass
    peak = _peak_rss_bytes()
    report = {"rank": rank, "cached": len(dm.datasets["train"]), "baseline": baseline, "peak": peak,
              "after": _rss_bytes(), "steps": len(dm.train_dataloader())}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        Path(result).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def ddp_memory(root: Path, world: int, work: Path) -> list[dict]:
    result = work / f"rss-{world}.json"
    init = work / f"init-{world}"
    init.unlink(missing_ok=True)
    # Spawned, so each rank starts from a clean interpreter and its RSS is its own.
    mp.start_processes(_rank, args=(world, str(root), str(init), str(result)), nprocs=world, start_method="spawn")
    return json.loads(result.read_text())


def train_run(root: Path, overrides: list[str], epochs: int, work: Path, label: str) -> dict:
    """One `python train.py` of the checkout at `root`: per-epoch telemetry from its CSV log, its summary."""
    folder = work / f"run-{label}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    command = [sys.executable, str(root / "train.py"), *overrides, f"trainer.max_epochs={epochs}", "logger=csv",
               "callbacks.progress_bar=null", "print_config=false", f"paths.log_dir={folder / 'outputs'}"]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=folder, capture_output=True, text=True, env=child_env(root)
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{label}: train.py failed:\n{done.stderr[-3000:]}")
    run_dir = run_folder(folder / "outputs")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = logged_rows(run_dir, "telemetry/data_wait_fraction")
    per_epoch = [{"data_wait": float(r["telemetry/data_wait_fraction"]), "step_ms": float(r["telemetry/step_time_ms"]),
                  "epoch_s": float(r["telemetry/epoch_seconds"]) if r.get("telemetry/epoch_seconds") else None}
                 for r in rows]
    result = {"label": label, "wall_s": wall, "epochs": per_epoch, "cache": summary.get("cache"),
              "samples_per_second": summary["samples_per_second"], "telemetry": summary["telemetry"],
              "peak_host_memory_mb": summary["peak_host_memory_mb"], "load": [load_before, os.getloadavg()[0]]}
    print(json.dumps(result), flush=True)
    return result


def train_runs(args: argparse.Namespace, work: Path) -> list[dict]:
    results = []
    for name in args.train_runs:
        overrides = [*TRAIN_RUNS[name], *args.train_overrides]
        if name == "brats":
            brats = make_brats(args.brats or work / "brats", args.brats_subjects, args.brats_size, args.brats_distinct)
            overrides.append(f"dataset.root={brats}")
        for cache in args.caches:
            results.append(
                train_run(ROOT, [*overrides, f"dataset.cache={cache}"], args.train_epochs, work, f"{name}-{cache}")
            )
        if name == "synthetic" and args.compare_root:
            results.append(train_run(args.compare_root, overrides, args.train_epochs, work, "synthetic-compare"))
    return results


def train_table(runs: list[dict]) -> None:
    print("\n" + table_header([
        "run", "cache chosen", "estimate / budget", "fill (s)", "epoch 1: wait, time", "later epochs: wait, time",
        "samples/s", "peak host memory", "load"
    ]))
    for run in runs:
        cache = run["cache"] or {}
        sizes = f"{cache['estimate_mb']:.0f} / {cache['budget_mb']:.0f} MiB" if "estimate_mb" in cache else "-"
        first, later = run["epochs"][0], run["epochs"][1:]
        later_wait = sum(e["data_wait"] for e in later) / len(later) if later else float("nan")
        later_time = sum(e["epoch_s"] or 0 for e in later) / len(later) if later else float("nan")
        print(f"| {run['label']} | {cache.get('mode', '-')} | {sizes} | {cache.get('fill_seconds', '-')} | "
              f"{100 * first['data_wait']:.1f}%, {first['epoch_s'] or 0:.1f} s | {100 * later_wait:.1f}%, "
              f"{later_time:.1f} s | "
              f"{run['samples_per_second']} | {run['peak_host_memory_mb']:.0f} MiB | "
              f"{run['load'][0]:.1f}-{run['load'][1]:.1f} |")


def busy(milliseconds: float, operand: torch.Tensor) -> None:
    """Keep this process's core busy for `milliseconds`, as a training step does."""
    end = time.perf_counter() + milliseconds / 1000
    while time.perf_counter() < end:
        operand @ operand


def loader_waits(brats: Path, subjects: int, epochs: int, step_ms: float = 300.0) -> dict[str, dict]:
    """Mean wait for a batch of a memory-cached BraTS set between busy steps, per way of loading it."""
    datamodule = BratsDataModule(
        root=str(brats), max_subjects=subjects, cache="memory", num_workers=0, val_fraction=0.1, test_fraction=0.1,
        transforms={"spacing": [4, 4, 4], "spatial_size": [128, 128, 128]},
    )
    datamodule.setup()
    dataset = datamodule.datasets["train"]
    operand = torch.randn(512, 512)
    results = {}
    for label, loader_class, workers in (("main process", DataLoader, 0), ("1 worker process", DataLoader, 1),
                                         ("thread (ThreadDataLoader)", ThreadDataLoader, 0)):
        loader = loader_class(dataset, batch_size=1, sampler=datamodule.train_dataloader().sampler, num_workers=workers)
        waits = []
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            start = time.perf_counter()
            for _batch in loader:
                waits.append(time.perf_counter() - start)
                busy(step_ms, operand)
                start = time.perf_counter()
        counted = waits[1:]  # the very first batch starts the loader
        results[label] = {"mean_wait_ms": 1000 * sum(counted) / len(counted), "steps": len(counted),
                          "step_ms": step_ms, "load": os.getloadavg()[0]}
        print(label, results[label], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subjects", type=int, default=64)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--distinct", type=int, default=8, help="phantoms generated; the rest are copies")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--smart-cache-rate", type=float, default=0.5)
    parser.add_argument("--work", type=Path, default=None, help="folder for the data and caches (default: a temp dir)")
    parser.add_argument("--parts", nargs="+", choices=["throughput", "memory", "train", "loader"],
                        default=["throughput", "memory"])
    parser.add_argument("--loader-subjects", type=int, default=10)
    parser.add_argument("--train-runs", nargs="+", choices=list(TRAIN_RUNS), default=list(TRAIN_RUNS))
    parser.add_argument("--train-epochs", type=int, default=3)
    parser.add_argument("--caches", nargs="+", choices=["auto", "none", "memory", "disk"], default=["auto", "none"])
    parser.add_argument("--train-overrides", nargs="*", default=[], help="added to every run, e.g. hardware=gpu")
    parser.add_argument("--brats", type=Path, default=None, help="BraTS 2021 folder (default: written under --work)")
    parser.add_argument("--brats-subjects", type=int, default=48)
    parser.add_argument("--brats-size", type=int, nargs=3, default=[240, 240, 155])
    parser.add_argument("--brats-distinct", type=int, default=16, help="BraTS cases generated; the rest are copies")
    parser.add_argument("--compare-root", type=Path, default=None, help="another checkout whose default run to add")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="medvol-data-bench-"))
    if {"throughput", "memory"} & set(args.parts):
        root = make_dataset(work / "data", args.subjects, args.size, args.distinct)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    results: dict = {"subjects": args.subjects, "size": args.size, "epochs": args.epochs,
                     "omp_num_threads": os.environ["OMP_NUM_THREADS"], "modes": {}}
    if "train" in args.parts:
        results["train"] = train_runs(args, work)
    if "loader" in args.parts:
        brats = make_brats(args.brats or work / "brats", args.brats_subjects, args.brats_size, args.brats_distinct)
        results["loader"] = loader_waits(brats, args.loader_subjects, args.epochs)
    for mode in MODES if "throughput" in args.parts else ():
        cache_dir = work / "disk-cache"
        shutil.rmtree(cache_dir, ignore_errors=True)
        results["modes"][mode] = throughput(root, mode, args.epochs, cache_dir, args.smart_cache_rate)
        print(mode, results["modes"][mode], flush=True)
    if {"throughput", "memory"} & set(args.parts):
        results["one_copy_mib"] = args.subjects * args.size**3 * 4 / 2**20
    for world in (1, 2) if "memory" in args.parts else ():
        ranks = ddp_memory(root, world, work)
        results[f"ranks_{world}"] = ranks
        growth = [(r["peak"] - r["baseline"]) / 2**20 for r in ranks]
        print(f"{world} rank(s): cached {[r['cached'] for r in ranks]}, steps {[r['steps'] for r in ranks]}, "
              f"peak RSS growth per rank {[f'{g:.0f}' for g in growth]} MiB, total {sum(growth):.0f} MiB", flush=True)
    report(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


def report(results: dict) -> None:
    """The Markdown tables of docs/benchmarks/data.md."""
    if results["modes"]:
        throughput_table(results["modes"])
    if results.get("train"):
        train_table(results["train"])
    if results.get("loader"):
        print("\n" + table_header(["memory-cached BraTS batch (48 MiB) read by", "mean wait between 300 ms steps",
                                   "steps", "load"]))
        for label, row in results["loader"].items():
            print(f"| {label} | {row['mean_wait_ms']:.0f} ms | {row['steps']} | {row['load']:.1f} |")
    if "one_copy_mib" not in results:
        return
    print(f"\none copy of the data: {results['one_copy_mib']:.0f} MiB")
    for world in (1, 2):
        ranks = results.get(f"ranks_{world}")
        if ranks:
            peak = sum(r["peak"] - r["baseline"] for r in ranks) / 2**20
            steady = sum(r["after"] - r["baseline"] for r in ranks) / 2**20
            print(
                f"{world} rank(s): subjects cached per rank {[r['cached'] for r in ranks]}, steps "
                f"{[r['steps'] for r in ranks]}; "
                f"RSS growth peak {peak:.0f} MiB = {peak / results['one_copy_mib']:.2f}x one copy, "
                f"after the epoch {steady:.0f} MiB = {steady / results['one_copy_mib']:.2f}x"
            )


def throughput_table(modes: dict) -> None:
    base = modes["none"]["later_volumes_per_s"]
    print("\n" + table_header(["cache", "first epoch (s)", "first epoch vol/s", "later epochs vol/s", "later vs none"]))
    for mode, row in modes.items():
        print(
            f"| {mode} | {row['first_epoch_s']:.1f} | {row['first_volumes_per_s']:.1f} | "
            f"{row['later_volumes_per_s']:.1f} | {row['later_volumes_per_s'] / base:.1f}x |"
        )


if __name__ == "__main__":
    main()
