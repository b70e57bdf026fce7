"""A refused command leaves no trace: what Hydra made for it before medvol's checks ran is taken back.

Hydra creates the run directory, `.hydra/` and `train.log` before `run(cfg)` starts. When
medvol then refuses the command (a `MedvolError`), a fresh run's directory is removed, and a
resumed run gets back exactly what it held: its `.hydra/resume-<stamp>` record of the refused
invocation is removed, a run record (`run.json`) it did not hold before is removed, and its `train.log` is cut
back to its length before the command.
A command that has already saved a checkpoint is kept, with the error at the end of its `train.log`.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from medvol.core.run_files import open_in
from medvol.run.run_record import RECORD_FILE


@dataclass(frozen=True)
class RunDirectoryBefore:
    """The state of a run directory as the command found it.

    Args:
        output_dir: the run directory Hydra chose.
        hydra_subdir: where Hydra recorded this invocation, relative to `output_dir` (or None).
        log_file: the run's log file.
        resumed: whether `output_dir` belongs to an earlier run this command resumes.
        log_size: bytes in `log_file` when the command started.
        started: when the command started (checkpoints written since then make the run count).
        had_record: whether `output_dir` held a run record (`run.json`) when the command started.
    """

    output_dir: Path
    hydra_subdir: str | None
    log_file: Path
    resumed: bool
    log_size: int
    started: float
    had_record: bool = False

    @classmethod
    def record(cls, output_dir: str, hydra_subdir: str | None, log_file: str, resumed: bool) -> RunDirectoryBefore:
        log = Path(log_file)
        size = log.stat().st_size if log.is_file() else 0
        had_record = (Path(output_dir) / RECORD_FILE).is_file()
        return cls(Path(output_dir), hydra_subdir, log, resumed, size, time.time(), had_record)

    def fresh(self) -> bool:
        """Whether Hydra made the directory for this command: no resume, nothing logged there before, no checkpoint."""
        return not self.resumed and self.log_size == 0 and not any(self.output_dir.rglob("*.ckpt"))

    def saved_checkpoints(self) -> bool:
        """Whether this command has written a checkpoint (then the run counts: nothing is taken back)."""
        return any(p.stat().st_mtime >= self.started for p in self.output_dir.rglob("*.ckpt"))

    def take_back(self) -> bool:
        """Remove what this command added; False (and nothing removed) once it has saved a checkpoint."""
        if not self.output_dir.is_dir():
            return True
        if self.saved_checkpoints():
            return False
        if self.fresh():
            shutil.rmtree(self.output_dir, ignore_errors=True)
            return True
        # An earlier run's directory (a resume, a SLURM requeue into slurm-<job>): give back only what was added.
        if self.hydra_subdir and Path(self.hydra_subdir).name.startswith("resume-"):
            shutil.rmtree(self.output_dir / self.hydra_subdir, ignore_errors=True)
        if not self.had_record:
            (self.output_dir / RECORD_FILE).unlink(missing_ok=True)
        if self.log_file.is_file() and not self.log_file.is_symlink():
            with open_in(self.output_dir, self.log_file, "r+b") as file:
                file.truncate(self.log_size)
        return True
