"""How often a 2-rank DDP run exits cleanly: N runs of the path of
`tests/medvol/run/test_ddp_correctness.py::test_automatic_optimization_with_accumulation_and_sync_batchnorm`.

    .venv/bin/python benchmarks/training/ddp_exit_loop.py [--runs 20]

Each run is `python train.py ... strategy=ddp trainer.devices=2 test=true` in a subprocess,
exactly as the test starts it (medvol starts rank 1 itself, gloo on the CPU, fit then test).
A run is clean when `train.py` exits 0, which needs every rank to have exited 0; a rank that
aborts at interpreter exit (SIGABRT, exit -6) makes rank 0 fail the job. Not a CI test: it
takes about a minute a run on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run

from tests.ddp_support import train_cli  # noqa: E402
from tests.medvol.run.test_ddp_correctness import DATA, DDP, REGRESSOR, TINY_DATA  # noqa: E402 - after the path set-up


def failure_reason(stdout: str, stderr: str, code: int) -> str:
    """The most telling line of a failed run's output."""
    for line in reversed((stdout + stderr).splitlines()):
        if "terminate called" in line or "exited with code" in line or "medvol: error" in line:
            return line.strip()
    return f"exit {code}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    clean = 0
    for index in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="medvol-exit-loop-") as folder:
            start = time.monotonic()
            result = train_cli([*TINY_DATA, *DATA, *REGRESSOR, *DDP, f"hydra.run.dir={Path(folder) / 'ddp'}"],
                               cwd=Path(folder), tiny=False)
            seconds = time.monotonic() - start
        aborted = "terminate called" in result.stderr
        if result.returncode == 0 and not aborted:
            clean += 1
            outcome = "clean"
        else:
            outcome = "FAILED: " + failure_reason(result.stdout, result.stderr, result.returncode)
        print(f"run {index:2d}/{args.runs}: {outcome} ({seconds:.0f} s)", flush=True)
    print(f"clean exits: {clean}/{args.runs}", flush=True)
    return 0 if clean == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
