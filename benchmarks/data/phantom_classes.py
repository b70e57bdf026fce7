"""Where the synthetic phantoms' class threshold comes from: the generator's median lesion fraction.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data/phantom_classes.py [--count 2000] [--sizes 16 32]

For phantoms 0..count-1 of series 0, prints per grid size the median lesion fraction, the share
without lesions and the share above `LESION_CLASS_THRESHOLD` (the class is measured on the
`CLASS_GRID` rendering); then the classes of the default 32-subject split for `model=classifier`.
"""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np

from datamodules.pipeline.split import make_split
from datamodules.sources.phantom import LESION_CLASS_THRESHOLD, lesion_class, make_phantom


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32])
    args = parser.parse_args()
    print("| grid | phantoms | median lesion fraction | no lesion | above the threshold |\n|---|---|---|---|---|")
    for size in args.sizes:
        fractions = np.array([make_phantom(0, i, size).lesion_fraction for i in range(args.count)])
        print(f"| {size}^3 | {args.count} | {np.median(fractions):.4f} | {np.mean(fractions == 0):.3f} | "
              f"{np.mean(fractions > LESION_CLASS_THRESHOLD):.3f} |", flush=True)
    subjects = [f"phantom-0-{i:04d}" for i in range(32)]
    classes = [lesion_class(0, i) for i in range(32)]
    split = make_split(subjects, 0.125, 0.125, seed=0, strata=classes)
    by_subject = dict(zip(subjects, classes, strict=True))
    for name in ("train", "val", "test"):
        counts = Counter(by_subject[s] for s in split[name])
        print(f"default split, {name}: class 0: {counts[0]}, class 1: {counts[1]}")


if __name__ == "__main__":
    main()
