"""A sweep's summary beside its jobs: `<sweep>/summary.csv` and `<sweep>/summary.md`, one row per job (its folder, its
overrides, its status, its objective, its best checkpoint), and the best job named when the sweep ends.

Every `-m` sweep (a grid, `hparams_search=optuna`, a `dataset.fold` cross-validation; jobs here or as SLURM jobs, on
one rank or several) is summarised by `SweepSummary`, a Hydra callback (conf/hydra/default.yaml):

- as a job ends (`on_job_end`, in the job's own process: this one, or the first task of its SLURM job), its row goes to
  `<sweep>/.jobs/<job number>.json`: completed with the objective the sweeper received (`optimized_metric`, the worst
  value for `optimized_mode` where it is undefined) and its best checkpoint, or failed with its error's one line. Then
  the summary is written again from every job's row, a job that has started and not ended being `running`. A job
  writes only its own row, so jobs ending together on a cluster never overwrite one another's.
- a failed job reaches the sweeper as a job without a value, so the sweep goes on (the basic sweeper runs the other
  jobs and ends normally, Optuna records a failed trial), where Hydra alone ends the sweep or the study with the first
  failure and never reports the others.
- when the sweep ends (`on_multirun_end`), the table is printed and its last line names the best job and its
  checkpoint; a sweep with a failed job then exits with status 1.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from medvol.core.errors import MedvolError
from medvol.core.file_data import cut, read_json, read_yaml
from medvol.core.run_files import replace_in
from medvol.run.world import global_rank

log = logging.getLogger("medvol")

SUMMARY_CSV = "summary.csv"
SUMMARY_MARKDOWN = "summary.md"
JOBS_DIR = ".jobs"
COLUMNS = ("job", "overrides", "status", "reason", "metric", "mode", "objective", "best_checkpoint")
# The console shows the whole table up to this many jobs (summary.md always holds it).
SHOWN_ROWS = 20
REASON_LENGTH = 300


class JobRow(BaseModel):
    """One job of a sweep: `<sweep>/.jobs/<num>.json`. `job` is its folder and `checkpoint` its best checkpoint, both
    relative to the sweep where inside it."""

    # An undefined metric's objective is the worst value, -inf or inf: written as JSON's Infinity, not as null.
    model_config = ConfigDict(extra="forbid", strict=True, ser_json_inf_nan="constants")
    num: Annotated[int, Field(ge=0, le=10**6)] | None
    job: Annotated[str, Field(min_length=1, max_length=1024)]
    overrides: list[Annotated[str, Field(max_length=4096)]] = Field(max_length=1024)
    status: Literal["completed", "failed", "running"]
    reason: Annotated[str, Field(max_length=REASON_LENGTH)] | None = None
    metric: Annotated[str, Field(max_length=256)] | None = None
    mode: Literal["max", "min"] = "max"
    objective: float | None = None
    checkpoint: Annotated[str, Field(max_length=4096)] | None = None

    @field_validator("job")
    @classmethod
    def _inside(cls, job: str) -> str:
        if Path(job).is_absolute() or ".." in Path(job).parts:
            raise ValueError("a job's folder lies inside its sweep")
        return job


def one_line(err: BaseException) -> str:
    """An error as one line: medvol's refusal as it reads, any other with its type in front."""
    text = (str(err).strip().splitlines() or [""])[0]
    if not isinstance(err, MedvolError):
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return cut(text, REASON_LENGTH)


def best_checkpoint(job_dir: Path, sweep_dir: Path) -> str | None:
    """The job's best checkpoint (else its last) as its `summary.json` names it, relative to the sweep where inside."""
    summary_file = job_dir / "summary.json"
    if not summary_file.is_file():
        return None
    summary = read_json(summary_file, "a run summary (summary.json)")
    found = next((summary[k] for k in ("best_checkpoint", "last_checkpoint")
                  if isinstance(summary, dict) and isinstance(summary.get(k), str) and summary[k]), None)
    if found is None:
        return None
    path, sweep = Path(os.path.abspath(found)), os.path.abspath(sweep_dir)
    return os.path.relpath(path, sweep) if path.is_relative_to(sweep) else str(path)


def ended_job(config: DictConfig, job_return: JobReturn) -> JobRow:
    """The row of a job that has just ended (`config`: the job's config, Hydra's node included)."""
    sweep_dir = Path(str(config.hydra.sweep.dir))
    job_dir = Path(str(config.hydra.runtime.output_dir))
    common = {
        "num": int(config.hydra.job.num), "job": os.path.relpath(os.path.abspath(job_dir), os.path.abspath(sweep_dir)),
        "overrides": [str(o) for o in job_return.overrides or []],
        "metric": None if config.get("optimized_metric") is None else str(config.optimized_metric),
        "mode": "min" if str(config.get("optimized_mode", "max")) == "min" else "max",
    }
    if job_return.status == JobStatus.FAILED:
        try:
            job_return.return_value  # noqa: B018 - Hydra's JobReturn raises a failed job's error when read
        except Exception as err:  # noqa: BLE001 - whatever the job raised is its row's reason
            return JobRow(**common, status="failed", reason=one_line(err))
    value = job_return.return_value
    objective = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return JobRow(**common, status="completed", objective=objective,
                  checkpoint=best_checkpoint(job_dir, sweep_dir) if job_dir.is_dir() else None)


def read_row(path: Path) -> JobRow:
    try:
        return JobRow.model_validate(read_json(path, "a sweep job's row"))
    except ValidationError as err:
        problem = err.errors()[0]
        where = ".".join(str(p) for p in problem["loc"]) or "<root>"
        raise MedvolError(f"{path}: `{where}` {cut(problem['msg'])}; expected a row medvol wrote") from None


def started_job(job_dir: Path, sweep_dir: Path) -> JobRow:
    """A job that has started (Hydra wrote its overrides) and not ended."""
    overrides = read_yaml(job_dir / ".hydra" / "overrides.yaml", "a job's overrides (overrides.yaml)")
    number = re.match(r"\d+", job_dir.name)
    return JobRow(num=int(number.group()) if number else None, job=job_dir.relative_to(sweep_dir).as_posix(),
                  overrides=[str(o) for o in overrides] if isinstance(overrides, list) else [], status="running")


def sweep_rows(sweep_dir: Path) -> list[JobRow]:
    """Every job of the sweep in `sweep_dir` by number: the ended ones from their rows, the others `running`."""
    ended = [read_row(path) for path in sorted((sweep_dir / JOBS_DIR).glob("*.json"))]
    named = {row.job for row in ended}
    started = [hydra.parent.parent for hydra in sorted(sweep_dir.glob("*/.hydra/overrides.yaml"))]
    running = [started_job(job, sweep_dir) for job in started if job.relative_to(sweep_dir).as_posix() not in named]
    return sorted([*ended, *running], key=lambda r: (r.num is None, r.num or 0, r.job))


def best_job(rows: Sequence[JobRow]) -> JobRow | None:
    """The completed job with the best finite objective for its `mode`; None where there is none, or where the jobs
    optimise different metrics (a sweep over model families) and no one value compares them."""
    scored = [r for r in rows if r.status == "completed" and r.objective is not None and math.isfinite(r.objective)]
    if not scored or len({(r.metric, r.mode) for r in scored}) > 1:
        return None
    pick = max if scored[0].mode == "max" else min
    return pick(scored, key=lambda r: r.objective)


def _shared(rows: Sequence[JobRow]) -> list[str]:
    """The overrides every job has (said once above the table), where there are several jobs."""
    if len(rows) < 2:
        return []
    return [o for o in rows[0].overrides if all(o in r.overrides for r in rows[1:])]


def _cell(text: Any) -> str:
    return "" if text is None else str(text).replace("|", "\\|").replace("\n", " ")


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def _objective_name(rows: Sequence[JobRow]) -> str:
    kinds = {(r.metric, r.mode) for r in rows if r.status == "completed"}
    if len(kinds) == 1 and next(iter(kinds))[0]:
        metric, mode = next(iter(kinds))
        return f"{metric} ({mode})"
    return "objective"


def best_line(rows: Sequence[JobRow], sweep_dir: Path | None = None) -> str:
    """`best: <job> (<metric> <value>), checkpoint <path>` (the path under `sweep_dir` where given)."""
    best = best_job(rows)
    if best is None:
        return "best: none (no completed job has a defined objective of one metric)"
    checkpoint = best.checkpoint
    if checkpoint and sweep_dir is not None and not Path(checkpoint).is_absolute():
        checkpoint = str(sweep_dir / checkpoint)
    return f"best: {best.job} ({best.metric} {_number(best.objective)}), checkpoint {checkpoint or 'none saved'}"


def markdown(rows: Sequence[JobRow], sweep_dir: Path) -> str:
    shared = _shared(rows)
    counts = ", ".join(f"{sum(r.status == s for r in rows)} {s}" for s in ("completed", "failed", "running")
                       if any(r.status == s for r in rows))
    lines = [f"# Sweep {sweep_dir.name}", "", f"{len(rows)} jobs: {counts}."]
    if shared:
        lines.append(f"Every job: `{' '.join(shared)}`.")
    lines += ["", f"| job | overrides | status | {_objective_name(rows)} | best checkpoint |", "|---|---|---|---|---|"]
    for row in rows:
        status = f"failed: {row.reason}" if row.status == "failed" else row.status
        own = " ".join(o for o in row.overrides if o not in shared)
        lines.append(f"| {_cell(row.job)} | {_cell(own)} | {_cell(status)} | {_number(row.objective)} | "
                     f"{_cell(row.checkpoint)} |")
    return "\n".join([*lines, "", best_line(rows), ""])


def table(rows: Sequence[JobRow]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({
            "job": row.job, "overrides": " ".join(row.overrides), "status": row.status, "reason": row.reason or "",
            "metric": row.metric or "", "mode": row.mode,
            "objective": "" if row.objective is None else repr(row.objective),
            "best_checkpoint": row.checkpoint or "",
        })
    return buffer.getvalue()


def write_summary(sweep_dir: Path) -> list[JobRow]:
    """`summary.csv` and `summary.md` of the sweep in `sweep_dir`, each replaced in one step; its rows."""
    rows = sweep_rows(sweep_dir)
    replace_in(sweep_dir, sweep_dir / SUMMARY_CSV, lambda handle: handle.write(table(rows)))
    replace_in(sweep_dir, sweep_dir / SUMMARY_MARKDOWN, lambda handle: handle.write(markdown(rows, sweep_dir)))
    return rows


def _in_sweep(config: DictConfig) -> bool:
    mode = OmegaConf.select(config, "hydra.mode")
    return getattr(mode, "name", mode) == "MULTIRUN"


class SweepSummary(Callback):
    """Hydra callback: a sweep's summary rewritten as each job ends, and its best job named when the sweep ends."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not _in_sweep(config):
            return
        row = ended_job(config, job_return)
        if row.status == "failed":
            # The sweep goes on: the sweeper sees a job without a value, not the error (the row keeps its line).
            job_return.status = JobStatus.COMPLETED
            job_return.return_value = None
        if global_rank() != 0:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        replace_in(sweep_dir, sweep_dir / JOBS_DIR / f"{row.num}.json",
                   lambda handle: handle.write(row.model_dump_json(indent=2) + "\n"))
        write_summary(sweep_dir)
        if row.status == "failed":
            log.error("sweep job %s failed: %s (%s)", row.job, row.reason, sweep_dir / SUMMARY_MARKDOWN)
        else:
            log.info("sweep job %s: %s %s (%s)", row.job, row.metric, _number(row.objective),
                     sweep_dir / SUMMARY_MARKDOWN)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        rows = write_summary(sweep_dir)
        # Printed, not logged: the log handlers still write to the last job's train.log.
        report = markdown(rows, sweep_dir).rstrip("\n").splitlines()
        shown = report[:-1] if len(rows) <= SHOWN_ROWS else report[:3]
        print("\n".join([*shown, f"summary: {sweep_dir / SUMMARY_MARKDOWN} ({SUMMARY_CSV} beside it)",
                         f"{best_line(rows, sweep_dir).replace('best:', 'best job:', 1)}"]), flush=True)
        if any(r.status == "failed" for r in rows):
            sys.exit(1)
