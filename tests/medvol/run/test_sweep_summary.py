"""A sweep reports: one summary beside its jobs (summary.csv and summary.md: job, overrides, status, objective, best
checkpoint), rewritten as each job ends, a failed job a row with its one-line reason, and the best job and its
checkpoint named when the sweep ends."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from medvol.run.sweep_summary import JOBS_DIR, SUMMARY_CSV, SUMMARY_MARKDOWN, SweepSummary, best_job, sweep_rows


def job_folder(sweep: Path, name: str, overrides: list[str], checkpoint: str | None = "epoch000.ckpt") -> Path:
    """A job folder as a medvol sweep job leaves it: Hydra's overrides.yaml, and summary.json once it trained."""
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if checkpoint:
        (job / "checkpoints").mkdir()
        (job / "checkpoints" / checkpoint).write_bytes(b"")
        (job / "summary.json").write_text(json.dumps({
            "best_checkpoint": str(job / "checkpoints" / checkpoint), "last_checkpoint": str(job / "checkpoints" /
                                                                                           "last.ckpt"),
        }))
    return job


def job_config(sweep: Path, job: Path, num: int, overrides: list[str], mode: str = "max"):
    return OmegaConf.create({
        "optimized_metric": "val/psnr", "optimized_mode": mode,
        "hydra": {"mode": "MULTIRUN", "sweep": {"dir": str(sweep)}, "runtime": {"output_dir": str(job)},
                  "job": {"num": num}, "overrides": {"task": overrides}},
    })


def ended(status: JobStatus, value, overrides: list[str]) -> JobReturn:
    job_return = JobReturn(overrides=overrides, status=status)
    job_return._return_value = value
    return job_return


def three_jobs(sweep: Path, mode: str = "max") -> tuple[SweepSummary, list[JobReturn]]:
    """Jobs 0 and 1 trained (objectives 21.5 and 23.25), job 2 raised; job 3 has started and not ended."""
    callback = SweepSummary()
    returns = []
    job_folder(sweep, "3_model.optimizer.lr=0.001", ["model.optimizer.lr=0.001", "trainer.max_epochs=1"], None)
    for num, lr, value in ((0, "0.01", 21.5), (1, "0.003", 23.25), (2, "-1", ValueError("Invalid learning rate: -1\n"
                                                                                        "second line"))):
        overrides = [f"model.optimizer.lr={lr}", "trainer.max_epochs=1"]
        job = job_folder(sweep, f"{num}_model.optimizer.lr={lr}", overrides,
                         checkpoint=None if num == 2 else f"epoch00{num}.ckpt")
        failed = isinstance(value, Exception)
        returns.append(ended(JobStatus.FAILED if failed else JobStatus.COMPLETED, value, overrides))
        callback.on_job_end(config=job_config(sweep, job, num, overrides, mode), job_return=returns[-1])
    return callback, returns


def test_each_job_end_rewrites_the_summary_and_a_failed_job_is_a_row(tmp_path):
    sweep = tmp_path / "sweep"
    callback = SweepSummary()
    overrides = ["model.optimizer.lr=0.01"]
    job = job_folder(sweep, "0_model.optimizer.lr=0.01", overrides)
    callback.on_job_end(config=job_config(sweep, job, 0, overrides), job_return=ended(JobStatus.COMPLETED, 21.5,
                                                                                      overrides))
    # Beside the jobs, after the first job: one row.
    assert [row["job"] for row in csv.DictReader((sweep / SUMMARY_CSV).open())] == ["0_model.optimizer.lr=0.01"]

    callback, returns = three_jobs(tmp_path / "three")
    sweep = tmp_path / "three"
    rows = list(csv.DictReader((sweep / SUMMARY_CSV).open()))
    assert [(r["job"], r["status"]) for r in rows] == [
        ("0_model.optimizer.lr=0.01", "completed"), ("1_model.optimizer.lr=0.003", "completed"),
        ("2_model.optimizer.lr=-1", "failed"), ("3_model.optimizer.lr=0.001", "running"),
    ]
    assert rows[0]["overrides"] == "model.optimizer.lr=0.01 trainer.max_epochs=1"
    assert float(rows[1]["objective"]) == 23.25 and rows[1]["metric"] == "val/psnr"
    assert rows[1]["best_checkpoint"] == "1_model.optimizer.lr=0.003/checkpoints/epoch001.ckpt"
    # The failure's one line, and nothing else of it.
    assert rows[2]["reason"] == "ValueError: Invalid learning rate: -1" and rows[2]["objective"] == ""
    # The sweeper goes on: it sees a job without a value (Optuna records a failed trial), not an exception.
    assert returns[2].status == JobStatus.COMPLETED and returns[2].return_value is None
    assert returns[1].return_value == 23.25

    table = (sweep / SUMMARY_MARKDOWN).read_text()
    assert "| job | overrides | status | val/psnr (max) | best checkpoint |" in table
    failed = "| 2_model.optimizer.lr=-1 | model.optimizer.lr=-1 | failed: ValueError: Invalid learning rate: -1 |"
    assert failed in table
    # The overrides every job shares are said once, above the table.
    assert "trainer.max_epochs=1" in table.split("| job |")[0]
    assert "best: 1_model.optimizer.lr=0.003" in table


def test_the_sweep_ends_naming_its_best_job_and_checkpoint(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    callback, _ = three_jobs(sweep)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        callback.on_multirun_end(config=OmegaConf.create({"optimized_metric": "val/psnr", "optimized_mode": "max",
                                                          "hydra": {"sweep": {"dir": str(sweep)}}}))
    # A job failed: the sweep says so by its exit status, after its report.
    assert stopped.value.code == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("best job: 1_model.optimizer.lr=0.003 (val/psnr 23.25), checkpoint ")
    assert lines[-1].endswith(str(sweep / "1_model.optimizer.lr=0.003" / "checkpoints" / "epoch001.ckpt"))
    assert any("| 2_model.optimizer.lr=-1 |" in line and "failed: ValueError: Invalid learning rate: -1" in line
               for line in lines)
    assert any(str(sweep / SUMMARY_MARKDOWN) in line for line in lines)


def test_the_best_job_follows_the_optimized_mode_and_an_undefined_metric_is_the_worst(tmp_path):
    callback, _ = three_jobs(tmp_path / "min", mode="min")
    rows = sweep_rows(tmp_path / "min")
    assert best_job(rows).job == "0_model.optimizer.lr=0.01"
    sweep = tmp_path / "undefined"
    overrides = ["seed=1"]
    job = job_folder(sweep, "0_seed=1", overrides)
    SweepSummary().on_job_end(config=job_config(sweep, job, 0, overrides), job_return=ended(JobStatus.COMPLETED,
                                                                                            -math.inf, overrides))
    (row,) = sweep_rows(sweep)
    assert row.objective == -math.inf and best_job([row]) is None


def test_a_job_record_is_read_as_data(tmp_path):
    sweep = tmp_path / "sweep"
    callback, _ = three_jobs(sweep)
    record = sweep / JOBS_DIR / "1.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "checkpoint": "${oc.env:HOME}"}))
    from medvol.core.errors import MedvolError

    with pytest.raises(MedvolError, match="1.json"):
        sweep_rows(sweep)


def test_nothing_is_written_outside_a_sweep(tmp_path):
    """A plain run (hydra.mode RUN) is no sweep job: no summary anywhere."""
    job = job_folder(tmp_path, "run", ["seed=1"])
    config = job_config(tmp_path / "multiruns", job, 0, ["seed=1"])
    config.hydra.mode = "RUN"
    SweepSummary().on_job_end(config=config, job_return=ended(JobStatus.COMPLETED, 1.0, ["seed=1"]))
    assert not list(tmp_path.rglob(SUMMARY_CSV)) and not (tmp_path / "multiruns").exists()


@pytest.mark.slow
def test_a_three_job_sweep_ends_naming_its_best_job_with_the_summary_beside_the_jobs(tmp_path):
    from tests.ddp_support import explain, train_cli

    result = train_cli(["-m", "model.optimizer.lr=1e-3,3e-4,-1"], cwd=tmp_path, timeout=600)
    # One job failed: the sweep still ran every job and reports them, then exits 1.
    assert result.returncode == 1, explain(result)
    (sweep,) = (tmp_path / "outputs" / "vqgan" / "multiruns").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    # Job 2's folder stays with its train.log where the failure came late, and is taken back where medvol refused it.
    assert [name.split("_", 1)[0] for name in jobs][:2] == ["0", "1"], jobs
    # Each job's folder is named by its overrides (here the tests' tiny settings fill the name's 96 characters).
    assert all(name.split("_", 1)[1].startswith("callbacks.model_summary=null,") for name in jobs), jobs
    rows = list(csv.DictReader((sweep / SUMMARY_CSV).open()))
    assert [r["status"] for r in rows] == ["completed", "completed", "failed"], rows
    assert rows[2]["overrides"].split()[-1] == "model.optimizer.lr=-1" and rows[2]["reason"]
    assert "\n" not in rows[2]["reason"]
    for row in rows[:2]:
        assert math.isfinite(float(row["objective"])) and (sweep / row["best_checkpoint"]).is_file()
    best = max(rows[:2], key=lambda r: float(r["objective"]))
    assert (sweep / SUMMARY_MARKDOWN).is_file()
    named = [line for line in result.stdout.strip().splitlines()[-3:] if "best job:" in line]
    assert named and best["job"] in named[-1] and str(sweep / best["best_checkpoint"]) in named[-1], explain(result)
