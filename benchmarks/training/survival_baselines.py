"""Survival figures: baselines on the synthetic phantoms, and medvol against a plain script on real anatomy.

    .venv/bin/python benchmarks/training/survival_baselines.py synthetic --subjects 512 --size 32 --split RUN/split.json
    .venv/bin/python benchmarks/training/survival_baselines.py real [--subjects 96] [--spacing 8 8 8] [--epochs 12]
        [--seeds 0 1 2] [--arms medvol plain oracle] [--train-script PATH] [medvol overrides ...]

`synthetic` prints the C-index of a Cox model on the lesion fraction (the oracle, fitted on the run's
training subjects) and of random risks on the validation and test subjects of a `model=survival
dataset=synthetic` run's split.json (same subjects, size and seed).

`real` writes a MACE-style table on real anatomy (`datamodules.sources.brain_outcomes`: the MNI152 brain
with a white-matter lesion whose radius sets an exponential hazard, ~35% censored, age and sex as noise
covariates) at `--spacing`, then per seed cuts one train/val/test split (`--val`, `--test`) and trains on it:

- `medvol`: `python train.py model=survival dataset=csv dataset.csv_path=... dataset.covariate_columns=[age,sex]
  trainer.max_epochs=E test=true` as a user types it (the plan from the data; `--train-script` runs another
  checkout's train.py, e.g. the defaults before a change), on the seed's split file: its tested (best-validation)
  checkpoint, and its last epoch's (`medvol, last epoch`, predict.py on the test split);
- `plain`: the plain MONAI + torchsurv script of issue 41: MONAI resnet10 (one channel, one output), z-score
  over the brain, whole volumes, Cox partial likelihood (torchsurv, Efron), Adam 1e-3, batch 8, no
  covariates, the last epoch's weights;
- `oracle`: a Cox model (lifelines) on the true lesion radius, fitted on the training subjects: the ceiling.

Every arm's test risks are scored by one function (`survival_metrics`): Harrell's and Uno's C, the
cumulative/dynamic AUC at `--horizons`, and the integrated Brier score with Breslow's baseline fitted on
the arm's own validation risks (what medvol keeps in its checkpoints). The table (each seed, then mean and
standard deviation over the seeds) is printed and appended to `<out>/results.md`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, table_header  # noqa: E402

COVARIATES = ["age", "sex"]
METRICS = ("cindex", "uno_cindex", "auc_early", "auc_late", "ibs")


def synthetic(args: argparse.Namespace) -> None:
    import numpy as np
    import pandas as pd
    from lifelines import CoxPHFitter
    from lifelines.utils import concordance_index

    from datamodules.sources.phantom import make_phantom

    split = json.loads(Path(args.split).read_text())
    rows = {}
    for i in range(args.subjects):
        phantom = make_phantom(args.seed, i, (args.size,) * 3)
        rows[f"phantom-{args.seed}-{i:04d}"] = (phantom.lesion_fraction, phantom.time, phantom.event)
    frame = {
        name: pd.DataFrame([rows[s] for s in subjects], columns=["lesion", "time", "event"])
        for name, subjects in split.items()
        if name in ("train", "val", "test") and subjects
    }
    cox = CoxPHFitter().fit(frame["train"], duration_col="time", event_col="event")
    rng = np.random.default_rng(0)
    for name in ("val", "test"):
        if name not in frame:
            continue
        held_out = frame[name]
        oracle = concordance_index(held_out["time"], -cox.predict_partial_hazard(held_out), held_out["event"])
        random = np.mean(
            [concordance_index(held_out["time"], rng.normal(size=len(held_out)), held_out["event"]) for _ in range(200)]
        )
        print(f"{name}: subjects {len(held_out)}, events {int(held_out['event'].sum())}")
        print(f"  oracle Cox on lesion fraction: C-index {oracle:.3f}")
        print(f"  random risk (mean of 200 draws): C-index {random:.3f}")


# ---- real: medvol's default against a plain MONAI + torchsurv script on real anatomy (issue 41) -----------------


def read_table(path: Path) -> dict[str, dict[str, Any]]:
    with path.open(newline="") as handle:
        return {row["subject"]: row for row in csv.DictReader(handle)}


def scores(
    risks: dict[str, float], table: dict[str, dict[str, Any]], test: list[str], val: list[str], horizons: list[float]
) -> dict[str, float]:
    """The test subjects' metrics of `risks` (subject -> log-risk), the Brier score's baseline from the val subjects."""
    import torch

    from lightning_modules.discriminative.survival_metrics import breslow_baseline, horizon_name, survival_metrics

    def tensors(subjects: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.tensor([risks[s] for s in subjects], dtype=torch.float64),
                torch.tensor([float(table[s]["time"]) for s in subjects], dtype=torch.float64),
                torch.tensor([float(table[s]["event"]) for s in subjects], dtype=torch.float64))

    values = survival_metrics(*tensors(test), horizons, breslow_baseline(*tensors(val)))
    out = {"cindex": values["cindex"], "uno_cindex": values["uno_cindex"], "ibs": values.get("ibs", float("nan")),
           "auc_early": values.get(horizon_name(horizons[0]), float("nan")),
           "auc_late": values.get(horizon_name(horizons[1]), float("nan"))}
    return {k: float(v) for k, v in out.items()}


def predicted_risks(args: argparse.Namespace, checkpoint: str, split: str, out: Path) -> dict[str, float]:
    """predict.py's risks of a run's split with `checkpoint`."""
    env = {**os.environ, "PYTHONPATH": str(Path(args.train_script).resolve().parent)}
    subprocess.run(
        [sys.executable, str(Path(args.train_script).resolve().parent / "predict.py"), f"ckpt_path={checkpoint}",
         f"split={split}", f"output_dir={out}", "device=cpu"],
        cwd=out.parent, capture_output=True, text=True, env=env, check=True,
    )
    return {s: float(r["risk"]) for s, r in read_table(out / "predictions.csv").items()}


def medvol_arm(
    args: argparse.Namespace, csv_path: Path, split_file: Path, seed: int, out: Path, overrides: list[str]
) -> tuple[dict[str, float], dict[str, float], dict[str, float], float, str]:
    """The user's command on the seed's split: the test risks of its best checkpoint (`test=true`) with the val
    risks of that checkpoint (predict.py), and the val and test risks of its last epoch's checkpoint."""
    command = [
        sys.executable, str(Path(args.train_script).resolve()), "model=survival", "dataset=csv",
        f"dataset.csv_path={csv_path}", f"dataset.covariate_columns=[{','.join(COVARIATES)}]",
        f"dataset.split_file={split_file}", f"trainer.max_epochs={args.epochs}", "test=true", f"seed={seed}",
        "hardware=cpu", "callbacks.progress_bar=null", "logger=csv", "print_config=false", f"hydra.run.dir={out}",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(args.train_script).resolve().parent)}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=out.parent, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.stdout").write_text(result.stdout + result.stderr)
    if result.returncode:
        raise SystemExit(f"medvol arm failed ({result.returncode}): {result.stderr[-3000:]}")
    test = {s: float(r["risk"]) for s, r in read_table(out / "predictions" / "risks.csv").items()}
    summary = json.loads((out / "summary.json").read_text())
    best = summary.get("best_checkpoint") or str(out / "checkpoints" / "last.ckpt")
    val = predicted_risks(args, best, "val", out / "val-predictions")
    last = str(out / "checkpoints" / "last.ckpt")
    last_risks = {**predicted_risks(args, last, "val", out / "val-last"),
                  **predicted_risks(args, last, "test", out / "test-last")}
    plan = (out / "plan.json").read_text() if (out / "plan.json").is_file() else "{}"
    return {**test, **val}, last_risks, wall, plan


def plain_arm(
    root: Path, table: dict[str, dict[str, Any]], split: dict[str, list[str]], epochs: int, seed: int
) -> tuple[dict[str, float], float]:
    """The plain MONAI + torchsurv script of issue 41; returns the log-risk of every val and test subject."""
    import torch
    from monai.data import DataLoader, Dataset
    from monai.networks.nets import resnet10
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, NormalizeIntensityd, Orientationd
    from torchsurv.loss.cox import neg_partial_log_likelihood

    torch.manual_seed(seed)
    chain = Compose([LoadImaged("image"), EnsureChannelFirstd("image"), Orientationd("image", axcodes="RAS"),
                     NormalizeIntensityd("image", nonzero=True)])

    def items(subjects: list[str]) -> list[dict[str, Any]]:
        return [{"image": str(root / table[s]["image"]), "time": float(table[s]["time"]),
                 "event": float(table[s]["event"]), "subject": s} for s in subjects]

    start = time.perf_counter()
    # Loaded once, as MONAI's CacheDataset would keep them.
    train = DataLoader(Dataset([chain(item) for item in items(split["train"])]), batch_size=8, shuffle=True)
    net = resnet10(spatial_dims=3, n_input_channels=1, num_classes=1)
    optimizer = torch.optim.Adam(net.parameters(), 1e-3)
    for _ in range(epochs):
        net.train()
        for batch in train:
            if batch["event"].sum() == 0:
                continue  # no event, no partial likelihood
            loss = neg_partial_log_likelihood(net(batch["image"]), batch["event"].bool(), batch["time"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    net.eval()
    risks = {}
    with torch.no_grad():
        for item in [chain(i) for i in items(split["val"] + split["test"])]:
            risks[item["subject"]] = float(net(item["image"][None])[0, 0])
    return risks, time.perf_counter() - start


def oracle_arm(table: dict[str, dict[str, Any]], split: dict[str, list[str]]) -> dict[str, float]:
    """A Cox model on the true lesion radius, fitted on the training subjects (lifelines)."""
    import pandas as pd
    from lifelines import CoxPHFitter

    def frame(subjects: list[str]) -> pd.DataFrame:
        return pd.DataFrame({"radius": [float(table[s]["lesion_radius_mm"]) for s in subjects],
                             "time": [float(table[s]["time"]) for s in subjects],
                             "event": [int(table[s]["event"]) for s in subjects]}, index=subjects)

    cox = CoxPHFitter().fit(frame(split["train"]), duration_col="time", event_col="event")
    held_out = frame(split["val"] + split["test"])
    return {s: float(v) for s, v in cox.predict_log_partial_hazard(held_out).items()}


def real(args: argparse.Namespace, overrides: list[str]) -> None:
    import torch

    from datamodules.pipeline.split import make_split, save_split
    from datamodules.sources.brain_outcomes import TABLE, write_mace_brains

    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    tag = f"{args.subjects}s-{'x'.join(f'{s:g}' for s in args.spacing)}mm-cohort{args.cohort}"
    root = out / f"data-{tag}"
    if not (root / TABLE).is_file():
        write_mace_brains(root, args.subjects, args.spacing, seed=args.cohort)
    table = read_table(root / TABLE)
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in args.arms}
    if "medvol" in args.arms:
        results["medvol, last epoch"] = []
    lines = []
    for seed in args.seeds:
        split = make_split(sorted(table), args.val, args.test, seed)
        split_file = out / f"split-{tag}-seed{seed}.json"
        save_split(split_file, split, seed)
        for arm in args.arms:
            if arm == "medvol":
                run_dir = out / f"medvol-{tag}-{args.epochs}ep-seed{seed}{args.tag}"
                risks, last, wall, plan = medvol_arm(args, root / TABLE, split_file, seed, run_dir, overrides)
                print(f"seed {seed} plan: {plan}", flush=True)
                values = scores(last, table, split["test"], split["val"], args.horizons)
                results["medvol, last epoch"].append(values)
                lines.append(row(f"medvol, last epoch, seed {seed}", values, 0.0))
                print(lines[-1], flush=True)
            elif arm == "plain":
                risks, wall = plain_arm(root, table, split, args.epochs, seed)
            else:
                start = time.perf_counter()
                risks = oracle_arm(table, split)
                wall = time.perf_counter() - start
            values = scores(risks, table, split["test"], split["val"], args.horizons)
            results[arm].append(values)
            lines.append(row(f"{arm} seed {seed}", values, wall))
            print(lines[-1], flush=True)
    for arm, values in results.items():
        lines.append(mean_row(arm, values))
    events = sum(int(r["event"]) for r in table.values())
    header = (
        f"{args.subjects} subjects ({events} events) at {'x'.join(f'{s:g}' for s in args.spacing)} mm, split val "
        f"{args.val} / test {args.test}, {args.epochs} epochs, seeds {args.seeds}; medvol overrides {overrides}\n\n"
        + table_header(["arm", "Harrell C", "Uno C", f"AUC@{args.horizons[0]:g}", f"AUC@{args.horizons[1]:g}", "IBS",
                        "wall"])
    )
    text = "\n".join([header, *lines])
    print(text)
    with (out / "results.md").open("a") as handle:
        handle.write(text + "\n\n")


def row(name: str, values: dict[str, float], wall: float) -> str:
    return f"| {name} | " + " | ".join(f"{values[m]:.3f}" for m in METRICS) + f" | {wall:.0f} s |"


def mean_row(arm: str, runs: list[dict[str, float]]) -> str:
    cells = []
    for metric in METRICS:
        values = [r[metric] for r in runs]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        cells.append(f"{statistics.mean(values):.3f} ± {spread:.3f}")
    return f"| **{arm}**, mean ± sd over {len(runs)} seeds | " + " | ".join(cells) + " | |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="task", required=True)
    phantoms = sub.add_parser("synthetic")
    phantoms.add_argument("--subjects", type=int, default=512)
    phantoms.add_argument("--size", type=int, default=32)
    phantoms.add_argument("--seed", type=int, default=0)
    phantoms.add_argument("--split", required=True, help="split.json of the run")
    anatomy = sub.add_parser("real")
    anatomy.add_argument("--subjects", type=int, default=96)
    anatomy.add_argument("--spacing", type=float, nargs=3, default=[8.0, 8.0, 8.0])
    anatomy.add_argument("--epochs", type=int, default=12)
    anatomy.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    anatomy.add_argument("--cohort", type=int, default=0, help="seed of the generated subjects")
    anatomy.add_argument("--val", type=float, default=0.15)
    anatomy.add_argument("--test", type=float, default=0.33)
    anatomy.add_argument("--horizons", type=float, nargs=2, default=[12.0, 36.0])
    anatomy.add_argument("--arms", nargs="+", default=["oracle", "plain", "medvol"],
                         choices=["oracle", "plain", "medvol"])
    anatomy.add_argument("--train-script", default=str(ROOT / "train.py"))
    anatomy.add_argument("--tag", default="", help="appended to the medvol run folders (another checkout's runs)")
    anatomy.add_argument("--out", default="outputs/benchmarks/survival-real")
    args, overrides = parser.parse_known_args()
    if args.task == "synthetic":
        synthetic(args)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    real(args, overrides)


if __name__ == "__main__":
    main()
