"""A refused command leaves no trace: what Hydra made for it before medvol's checks ran is taken back.

Hydra creates the run directory, `.hydra/` and `train.log` before `run(cfg)` starts. When
medvol then refuses the command (a `MedvolError`), a fresh run's directory is removed, and a
resumed run gets back exactly what it held: its `.hydra/resume-<stamp>` record of the refused
invocation is removed and its `train.log` is cut back to its length before the command.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDirectoryBefore:
    """The state of a run directory as the command found it.

    Args:
        output_dir: the run directory Hydra chose.
        hydra_subdir: where Hydra recorded this invocation, relative to `output_dir` (or None).
        log_file: the run's log file.
        resumed: whether `output_dir` belongs to an earlier run this command resumes.
        log_size: bytes in `log_file` when the command started.
    """

    output_dir: Path
    hydra_subdir: str | None
    log_file: Path
    resumed: bool
    log_size: int

    @classmethod
    def record(cls, output_dir: str, hydra_subdir: str | None, log_file: str, resumed: bool) -> RunDirectoryBefore:
        log = Path(log_file)
        return cls(Path(output_dir), hydra_subdir, log, resumed, log.stat().st_size if log.is_file() else 0)

    def take_back(self) -> None:
        """Remove what this command added (never a checkpoint: a run that saved one is kept)."""
        if not self.output_dir.is_dir():
            return
        if not self.resumed:
            if not any(self.output_dir.rglob("*.ckpt")):
                shutil.rmtree(self.output_dir, ignore_errors=True)
            return
        if self.hydra_subdir and Path(self.hydra_subdir).name.startswith("resume-"):
            shutil.rmtree(self.output_dir / self.hydra_subdir, ignore_errors=True)
        if self.log_file.is_file():
            with self.log_file.open("r+b") as file:
                file.truncate(self.log_size)
