"""How long a typo takes to be answered, against how long `import torch` takes (issue 63, item 6).

    .venv/bin/python benchmarks/trust/typo_answer.py [--repeats 5] [--repo DIR]

Runs, one after the other and `--repeats` times each in turn, `python -c "import torch"` and each command below as a
user runs it (a fresh temporary working directory, OMP_NUM_THREADS=1), and prints a Markdown table of the median wall
time and process CPU time (user + system, of the child), its exit status and whether a run folder was left. CPU
time is the steadier figure on a shared machine. Then `python -X importtime -c "import torch"`'s own figure for torch
(its cumulative microseconds). `--repo` measures another checkout (e.g. a commit before the change) with this
environment's Python.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, child_env  # noqa: E402

COMMANDS = {
    "`import torch`": ["-c", "import torch"],
    "`train.py trainer.max_epoch=3`": ["train.py", "trainer.max_epoch=3"],
    "`train.py model=vqgna`": ["train.py", "model=vqgna"],
    "`train.py --help`": ["train.py", "--help"],
    "`predict.py ckpt_path=x.ckpt outptu_dir=out`": ["predict.py", "ckpt_path=x.ckpt", "outptu_dir=out"],
    "`check_data.py dataset=bratz`": ["check_data.py", "dataset=bratz"],
}


def timed(repo: Path, args: list[str]) -> tuple[float, float, int, bool]:
    """(wall seconds, child CPU seconds, exit status, whether anything was left in the working directory)."""
    command = [sys.executable, *(args if args[0] == "-c" else [str(repo / args[0]), *args[1:]])]
    env = child_env(repo, threads=1)
    with tempfile.TemporaryDirectory() as cwd:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        left = any(Path(cwd).iterdir())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode, left


def torch_import_microseconds() -> int:
    """torch's cumulative import time as `python -X importtime` reports it."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    line = next(line for line in done.stderr.splitlines() if re.search(r"\|\s+torch$", line))
    return int(line.split("|")[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--repo", type=Path, default=ROOT)
    args = parser.parse_args()
    repo = args.repo.resolve()
    runs: dict[str, list[tuple[float, float, int, bool]]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, command in COMMANDS.items():
            runs[name].append(timed(repo, command))
    print(f"repo: {repo}, {args.repeats} runs each, load average {os.getloadavg()[0]:.1f}\n")
    print("| command | wall s (median) | CPU s (median) | exit | folder left |\n|---|---|---|---|---|")
    for name, figures in runs.items():
        wall = statistics.median(f[0] for f in figures)
        cpu = statistics.median(f[1] for f in figures)
        left = "yes" if any(f[3] for f in figures) else "no"
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {figures[-1][2]} | {left} |")
    print(f"\n`python -X importtime -c 'import torch'`: torch {torch_import_microseconds() / 1e6:.2f} s cumulative")


if __name__ == "__main__":
    main()
