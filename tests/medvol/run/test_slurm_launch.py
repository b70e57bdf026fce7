"""SLURM for real, on the local one-node cluster (`../shared/tools/local-slurm.sh start`); skipped without one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.ddp_support import RUN_TIMEOUT, explain, sweep_jobs, train_cli


def _cluster_up() -> bool:
    if not os.environ.get("SLURM_CONF") or shutil.which("sinfo") is None:
        return False
    try:
        probe = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0 and any(state in probe.stdout for state in ("idle", "mix", "alloc"))


pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(not _cluster_up(), reason="no SLURM cluster (SLURM_CONF unset or sinfo fails)")]

SMALL = ["dataset.batch_size=1", "dataset.val_fraction=0.25", "callbacks.volume_slices=null"]


def test_srun_tasks_become_ddp_ranks_with_one_run_dir(tmp_path):
    srun = ["srun", "--nodes=1", "--ntasks-per-node=2", f"--chdir={tmp_path}", sys.executable]
    result = train_cli([*SMALL, "strategy=ddp", "trainer.devices=2", f"paths.log_dir={tmp_path / 'logs'}"],
                       cwd=tmp_path, launcher=srun)
    assert result.returncode == 0, explain(result)
    runs = list((tmp_path / "logs" / "vqgan" / "runs").iterdir())
    assert [run.name.startswith("slurm-") for run in runs] == [True], runs
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert result.stdout.count("medvol run summary (fit)") == 1


@pytest.mark.slow
def test_submitit_launcher_runs_a_ddp_sweep_as_slurm_jobs(tmp_path):
    sweep = tmp_path / "multirun"
    result = train_cli(
        ["-m", "hydra/launcher=slurm", *SMALL, "strategy=ddp", "trainer.devices=2",
         "model.optimizer.lr=1e-3,3e-4", f"hydra.sweep.dir={sweep}", "hydra.launcher.timeout_min=10"],
        cwd=tmp_path,
        timeout=2 * RUN_TIMEOUT,
    )
    assert result.returncode == 0, explain(result)
    jobs = sweep_jobs(sweep)
    for job in ("0", "1"):
        summary = json.loads((jobs[job] / "summary.json").read_text())
        assert summary["world_size"] == 2
        assert (jobs[job] / "checkpoints" / "last.ckpt").is_file()
    assert (sweep / "summary.csv").is_file()


@pytest.mark.slow
# Two runs (the job, then its requeue) of two ranks each: 190 s on an idle machine, past the default 300 s beside the
# other slow worker; the test's own waits bound it below this.
@pytest.mark.timeout(900)
def test_sigusr1_saves_requeues_and_the_job_resumes_in_its_run_dir(tmp_path):
    from tests.conftest import TINY

    overrides = " ".join(f"'{item}'" for item in [*TINY, *SMALL, "strategy=ddp", "trainer.devices=2",
                                                  "trainer.max_epochs=6", f"paths.log_dir={tmp_path / 'logs'}"])
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n#SBATCH --requeue\n"
        f"#SBATCH --output={tmp_path}/slurm-%j.out\n"
        f"cd {tmp_path}\n"
        f"export PYTHONPATH={ROOT} OMP_NUM_THREADS=1\n"
        f"srun {sys.executable} {ROOT / 'train.py'} {overrides}\n"
    )
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    run_dir = tmp_path / "logs" / "vqgan" / "runs" / f"slurm-{job}"
    try:
        assert _wait_for(lambda: (run_dir / "checkpoints" / "last.ckpt").is_file(), RUN_TIMEOUT), "no epoch finished"
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
        assert _wait_for(lambda: list(run_dir.glob("hpc_ckpt_*.ckpt")), 60), "no HPC checkpoint saved on SIGUSR1"
        assert _wait_for(lambda: _job_gone(job) and (run_dir / "summary.json").is_file(), 2 * RUN_TIMEOUT)
    finally:
        subprocess.run(["scancel", job], timeout=30)
    output = "".join(path.read_text() for path in tmp_path.glob("slurm-*.out"))
    assert "Restoring states from the checkpoint path at" in output and "hpc_ckpt_" in output, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs"] == 6 and summary["world_size"] == 2
    assert [p.name for p in (tmp_path / "logs" / "vqgan" / "runs").iterdir()] == [run_dir.name]


def _wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(1.0)
    return False


def _job_gone(job: str) -> bool:
    queue = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return not queue.stdout.strip()
