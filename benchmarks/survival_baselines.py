"""Baselines for `model=survival` on the synthetic phantoms: a Cox model on the lesion fraction (oracle) and random risks.

    python benchmarks/survival_baselines.py --subjects 128 --size 32 --split /tmp/syn_run1/split.json

Prints the validation C-index of each baseline on the run's validation subjects (split.json of a
`model=survival dataset=synthetic` run with the same subjects, size and seed).
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
    parser.add_argument("--subjects", type=int, default=128)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", required=True, help="split.json of the run")
    args = parser.parse_args()
    split = json.loads(open(args.split).read())
    rows = {}
    for i in range(args.subjects):
        phantom = make_phantom(args.seed, i, (args.size,) * 3)
        rows[f"phantom-{args.seed}-{i:04d}"] = (phantom.lesion_fraction, phantom.time, phantom.event)
    frame = {name: pd.DataFrame([rows[s] for s in split[name]], columns=["lesion", "time", "event"]) for name in ("train", "val")}
    cox = CoxPHFitter().fit(frame["train"], duration_col="time", event_col="event")
    val = frame["val"]
    oracle = concordance_index(val["time"], -cox.predict_partial_hazard(val), val["event"])
    rng = np.random.default_rng(0)
    random = np.mean([concordance_index(val["time"], rng.normal(size=len(val)), val["event"]) for _ in range(200)])
    print(f"validation subjects {len(val)}, events {int(val['event'].sum())}")
    print(f"oracle Cox on lesion fraction: val C-index {oracle:.3f}")
    print(f"random risk (mean of 200 draws): val C-index {random:.3f}")


if __name__ == "__main__":
    main()
