"""Baselines for `model=survival` on the synthetic phantoms: a Cox model on the lesion fraction (oracle) and random
risks.

    python benchmarks/survival_baselines.py --subjects 512 --size 32 --split /tmp/survival_run/split.json

Prints the C-index of each baseline on the run's validation and test subjects (split.json of a
`model=survival dataset=synthetic` run with the same subjects, size and seed); the Cox model is
fitted on the run's training subjects.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pandas as pd
from lifelines import CoxPHFitter
from lifelines.utils import concordance_index

from datamodules.sources.phantom import make_phantom


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subjects", type=int, default=512)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", required=True, help="split.json of the run")
    args = parser.parse_args()
    split = json.loads(open(args.split).read())
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


if __name__ == "__main__":
    main()
