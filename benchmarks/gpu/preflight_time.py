"""The preflight's added time per family on this CPU: `preflight.predict` of each family's command, timed.

    OMP_NUM_THREADS=1 python benchmarks/gpu/preflight_time.py                 # the seed's sizes
    OMP_NUM_THREADS=1 python benchmarks/gpu/preflight_time.py --small         # toy sizes (seconds)

Each row composes the command's config and times one prediction (the module built from the config, made fake, two
training steps and a FLOP-counted third on fake tensors): what a GPU run pays before its data is read.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import composed  # noqa: E402

SEED = {
    "Fast-DDPM": ["experiment=fast_ddpm_brats", "dataset.root=/unused"],
    "VQ-GAN": ["experiment=ctpa_vqgan", "dataset.root=/unused", "hardware=cpu"],
    "segmentation": ["experiment=brats_segmentation", "dataset.root=/unused", "dataset.batch_size=2",
                     "model.patch_size=[128,128,128]"],
}
SMALL = {
    "Fast-DDPM": ["model=ddpm", "dataset.size=24"],
    "VQ-GAN": ["model=vqgan", "dataset.size=32", "dataset.batch_size=1"],
    "segmentation": ["model=segmentation", "dataset.size=16", "model.patch_size=[16,16,16]"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="toy sizes instead of the seed's")
    args = parser.parse_args()
    from medvol.run.preflight import predict

    print("| family | command | predicted peak (GiB) | TFLOP a step | preflight time (s) |\n|---|---|---|---|---|")
    for family, overrides in (SMALL if args.small else SEED).items():
        cfg = composed([*overrides, "paths.output_dir=/tmp/preflight_time"], job_name="preflight_time")
        began = time.perf_counter()
        prediction = predict(cfg, "bf16-mixed")
        seconds = time.perf_counter() - began
        print(f"| {family} | `{' '.join(overrides)}` | {prediction.peak / 2**30:.2f} | "
              f"{prediction.flops / 1e12:.2f} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
