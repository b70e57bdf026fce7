"""Memory and time of one EMA-codebook training step at the CTPA scale, full vs chunked, on the CPU.

    .venv/bin/python benchmarks/gpu/codebook.py [--latents 32768] [--codes 16384] [--dim 8] [--repeats 3]

A 128^3 patch at downsample 4 gives 32^3 = 32768 latent vectors per patch; the CTPA experiment
has 16384 codes of size 8. "full" is the computation before chunking (one latents x codes
distance matrix and a one-hot for the EMA sums; `tests/lightning_modules/vqgan/test_codebook_chunked.full_forward`,
which the test checks the chunked codebook against); "chunked" is `EMACodebook.forward` in
training mode (restarts off on both sides). Each side runs in its own process; memory is the
process's peak RSS during the steps minus its RSS before them; time is the median step, as
wall clock and as the process's CPU time (steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run

from lightning_modules.vqgan.codebook import EMACodebook  # noqa: E402 - after the path set-up for direct runs
from tests.lightning_modules.vqgan.test_codebook_chunked import full_forward  # noqa: E402


def current_rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(side: str, latents: int, codes: int, dim: int, repeats: int) -> dict[str, float]:
    """Peak extra RSS (MiB) and median wall and CPU time (s) of `repeats` training steps of one side."""
    torch.manual_seed(0)
    codebook = EMACodebook(codes, dim, random_restart=False).train()
    z = torch.randn(1, dim, latents, 1, 1)
    codebook(z[:, :, :codes])  # initialise from data outside the measurement
    before = current_rss_mib()
    times, cpu_times = [], []
    with torch.no_grad():
        for _ in range(repeats):
            start, cpu_start = time.perf_counter(), time.process_time()
            full_forward(codebook, z) if side == "full" else codebook(z)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"extra_peak_mib": peak - before, "seconds": statistics.median(times),
            "cpu_seconds": statistics.median(cpu_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latents", type=int, default=32768)
    parser.add_argument("--codes", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--side", choices=["full", "chunked"], help="measure one side only, printed as JSON")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.side, args.latents, args.codes, args.dim, args.repeats)))
        return
    results = {}
    for side in ("full", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, f"--side={side}", f"--latents={args.latents}", f"--codes={args.codes}",
             f"--dim={args.dim}", f"--repeats={args.repeats}"],
            check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        results[side] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"latents {args.latents}, codes {args.codes}, dim {args.dim}, one thread, median of {args.repeats} steps")
    print("| | peak extra memory | time per step (wall) | time per step (CPU) |\n|---|---|---|---|")
    for side, r in results.items():
        print(f"| {side} | {r['extra_peak_mib']:.0f} MiB | {r['seconds']:.2f} s | {r['cpu_seconds']:.2f} s |")


if __name__ == "__main__":
    main()
