"""predict.py over thousands of scans as a batch job: the share of one process, the subjects already done, one line
per subject, and the subjects that failed.

A subject is done when its record `.predicted/<subject>.json` in the output folder names the checkpoints it was
predicted with (path, size and modification time) and files that all exist. The record is written after the last of
the subject's files, each of which is written under a partial name and renamed into place
(`medvol.volumes.prediction_writer`): a job killed at any point leaves the subject it was on without a record, and
predicted again on the next run (nnU-Net's `--continue_prediction`, which trusts any existing output file). The
record also holds the subject's table rows, so the tables of a job run in several parts or several times hold every
subject done.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from medvol.core.errors import MedvolError
from medvol.core.file_data import read_json
from medvol.core.run_files import replace_in
from medvol.core.subject_names import SubjectFiles
from medvol.run.trained_model import mean_metrics

log = logging.getLogger("medvol")

RECORDS = ".predicted"
# Beside the outputs, as train.py writes train.log in its run: what the console showed (predict.py logs to
# stdout) plus the library warnings the console drops.
LOG_FILE = "predict.log"
# predict.py's exit status when the job ran to its end but some subjects failed (2: refused before any output).
SUBJECTS_FAILED = 3


class SubjectsFailed(MedvolError):
    """Some subjects failed; every other one was written. predict.py exits with `exit_code`."""

    exit_code = SUBJECTS_FAILED


def job_part(num_parts: Any, part_id: Any) -> tuple[int, int]:
    """(number of parts, this process's part): the command's `num_parts`/`part_id` (a SLURM array), else under
    torchrun (`TORCHELASTIC_RUN_ID` set) its `WORLD_SIZE`/`RANK`, else (1, 0)."""
    if num_parts is None and part_id is None:
        # torchrun's own variable: a Trainer in this process (a test, a notebook) leaves WORLD_SIZE and RANK behind.
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            return 1, 0
        world = os.environ.get("WORLD_SIZE", "1")
        rank = os.environ.get("RANK", "0")
        if world.isdigit() and rank.isdigit() and int(world) > 1:
            return int(world), int(rank)
        return 1, 0
    if not isinstance(num_parts, int) or isinstance(num_parts, bool) or num_parts < 1:
        raise MedvolError(f"`num_parts` is {num_parts!r}; expected a whole number >= 1, with `part_id`")
    if not isinstance(part_id, int) or isinstance(part_id, bool) or not 0 <= part_id < num_parts:
        raise MedvolError(f"`part_id` is {part_id!r}; expected a whole number from 0 to num_parts-1 ({num_parts - 1})")
    return num_parts, part_id


def part_positions(subjects: Sequence[str], num_parts: int, part_id: int) -> list[int]:
    """The positions in `subjects` of part `part_id`'s share: every `num_parts`-th subject in order of id, starting at
    the `part_id`-th; the parts are disjoint, cover every subject and depend on the ids alone, not on their listing."""
    by_id = sorted(range(len(subjects)), key=lambda i: str(subjects[i]))
    return sorted(by_id[part_id::num_parts])


def checkpoint_identity(paths: Sequence[str]) -> list[list[Any]]:
    """Each checkpoint as (absolute path, size, modification time): a run trained again at the same path differs."""
    identity = []
    for path in paths:
        status = Path(path).expanduser().stat()
        identity.append([str(Path(path).expanduser().resolve()), status.st_size, status.st_mtime_ns])
    return identity


@dataclass
class DoneRecords:
    """The records of the subjects of `output_dir` predicted with `checkpoints` (`checkpoint_identity`)."""

    output_dir: Path
    checkpoints: list[list[Any]]
    stems: SubjectFiles = field(default_factory=SubjectFiles)

    def _path(self, subject: str) -> Path:
        return self.output_dir / RECORDS / f"{self.stems.stem(subject)}.json"

    def read(self, subject: str) -> dict[str, Any] | None:
        """`subject`'s record where it is done with these checkpoints and every file it names exists, else None."""
        path = self._path(subject)
        if not path.is_file() or path.is_symlink():
            return None
        try:
            record = read_json(path, "a predicted subject's record")
        except MedvolError:
            return None
        if not isinstance(record, dict) or record.get("checkpoints") != self.checkpoints:
            return None
        # No file at all is done too: an outcome model's subject is rows of predictions.csv.
        files = record.get("files")
        if not isinstance(files, list):
            return None
        for name in files:
            target = self.output_dir / str(name)
            if ".." in Path(str(name)).parts or target.is_symlink() or not target.exists():
                return None
        return record

    def write(
        self, subject: str, files: Sequence[Path], rows: Sequence[dict[str, Any]],
        predictions: Sequence[dict[str, Any]], structures: Sequence[str],
    ) -> None:
        """Mark `subject` done: the files written for it (below `output_dir`) and its table rows."""
        record = {
            "subject": subject, "checkpoints": self.checkpoints,
            "files": [Path(os.path.relpath(p, self.output_dir)).as_posix() for p in files],
            "metrics": list(rows), "predictions": list(predictions), "structures": list(structures),
        }
        replace_in(self.output_dir, self._path(subject), lambda handle: handle.write(json.dumps(record) + "\n"))


def duration(seconds: float) -> str:
    """`seconds` as `42 s`, `3 min 5 s` or `2 h 10 min`."""
    whole = int(round(seconds))
    if whole < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


class SubjectLog:
    """One log line per subject: its place in this job, its time and the time the rest will take at the mean pace."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.count = 0
        self.started = time.perf_counter()
        self.last = self.started

    def line(self, subject: str, problem: str | None = None) -> str:
        self.count += 1
        now = time.perf_counter()
        took, self.last = now - self.last, now
        left = (now - self.started) / self.count * (self.total - self.count)
        state = f"failed: {problem}" if problem else duration(took)
        return f"[{self.count}/{self.total}] {subject}: {state}; about {duration(left)} left"


def peak_memory(device: torch.device) -> str:
    """The most memory the prediction held: on a GPU its allocated peak, else the process's peak resident set."""
    if device.type == "cuda":
        return f"peak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
    return f"peak host memory: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"


def summary_line(
    rows: list[dict[str, Any]], count: int, output_dir: Path, failed: Mapping[str, str] | None = None,
    total: int | None = None,
) -> str:
    """`predicted N subjects -> DIR` (`N of M` where some of the `total` failed), the mean of every per-subject metric,
    and a line per failed subject with its reason."""
    means = [f"{name} {value:.4g}" for name, value in mean_metrics(rows).items()]
    metrics = f"; mean {', '.join(means)}" if means else ""
    failed = failed or {}
    total = count if total is None else total
    counted = f"{count} of {total}" if failed else str(count)
    lines = [f"predicted {counted} subject{'s' if total != 1 else ''} -> {output_dir}{metrics}"]
    if failed:
        lines[0] += f"; {len(failed)} failed:"
        lines += [f"  failed: {subject}: {reason}" for subject, reason in failed.items()]
    return "\n".join(lines)
