"""What the benchmark scripts share: the repository root, a child process's environment, a `train.py` run in a
temporary folder and its CSV log, the composed config and a split's images, a Markdown table's header and a median
time.

A script runs as `python benchmarks/<group>/<name>.py`: its first lines put the repository root on `sys.path` (the
one thing it cannot import from here), then it imports what it needs from this module.
"""

from __future__ import annotations

import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# A launcher's variables: a child `python train.py` started with them would take itself for one rank of this job.
LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MEDVOL_RUN_STAMP")


def child_env(repo: Path = ROOT, threads: int | None = None) -> dict[str, str]:
    """This process's environment for a child `python train.py ...` of the checkout `repo`: its packages first on
    PYTHONPATH, `OMP_NUM_THREADS=threads` where given (a timing that one thread makes comparable), no launcher's
    variables."""
    env = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = str(repo)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


@contextmanager
def trained(overrides: Sequence[str]) -> Iterator[tuple[Path, float]]:
    """`python train.py <overrides>` as a user runs it, in a fresh temporary folder, with the CSV logger beside
    TensorBoard and no progress bar: (its run folder, the command's wall seconds), deleted when the `with` ends."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, str(ROOT / "train.py"), "logger=[tensorboard,csv]", "callbacks.progress_bar=null",
             *overrides],
            cwd=folder, check=True, capture_output=True, env=child_env(),
        )
        wall = time.perf_counter() - start
        yield run_folder(Path(folder) / "outputs"), wall


def run_folder(outputs: Path) -> Path:
    """The one run folder a `train.py` run left under `outputs`: outputs/<family>/runs/<run> (a checkout from before
    the families' folders: outputs/train/runs/<run>)."""
    (run_dir,) = outputs.glob("*/runs/*")
    return run_dir


def logged_rows(run_dir: Path, metric: str) -> list[dict[str, str]]:
    """The rows of a run's CSV log (`<run_dir>/csv/metrics.csv`) that hold `metric`: its validation epochs."""
    with (run_dir / "csv" / "metrics.csv").open() as log:
        return [row for row in csv.DictReader(log) if row.get(metric)]


def composed(overrides: Sequence[str], config_name: str = "train", job_name: str = "benchmark", root: Path = ROOT,
             **compose_kwargs: Any) -> Any:
    """`conf/<config_name>.yaml` of the checkout `root` composed with `overrides`, as train.py composes it (its
    resolvers registered), outside a Hydra run: no run folder, nothing written."""
    from hydra import compose, initialize_config_dir

    import medvol.run.resolvers  # noqa: F401 - registers the resolvers the configs use

    with initialize_config_dir(version_base="1.3", config_dir=str(root / "conf"), job_name=job_name):
        return compose(config_name=config_name, overrides=list(overrides), **compose_kwargs)


def split_images(overrides: Sequence[str]) -> list[Any]:
    """(training, validation, test): each split's images in model units, stacked, as the datamodule of the config
    composed with `overrides` (job `train`) makes them: the run's own transforms."""
    import torch

    from medvol.core.build import build

    datamodule = build(composed(overrides, job_name="train").dataset)
    datamodule.setup("fit")
    datamodule.setup("test")
    return [torch.stack([datamodule.datasets[s][i]["image"] for i in range(len(datamodule.datasets[s]))]).float()
            for s in ("train", "val", "test")]


def table_header(columns: Iterable[str]) -> str:
    """A Markdown table's first two lines: the column names, then the separator of as many columns."""
    columns = list(columns)
    return "| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|"


def median_seconds(call: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """The median wall time of `repeats` calls of `call`, after `warmup` untimed ones (imports, caches, allocations)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
