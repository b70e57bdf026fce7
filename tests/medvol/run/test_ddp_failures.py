"""A rank that raises takes every rank down with a non-zero exit, instead of leaving the others hanging."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.ddp_support import explain, train_cli

# Far above the failure path (the watchdog's grace is 10 s) and far below a gloo timeout (30 min).
FAILURE_TIMEOUT = 60


def pids(directory: Path) -> list[int]:
    return [json.loads(path.read_text())["pid"] for path in sorted(directory.glob("rank*.json"))]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; it only waits for its parent, which is gone too.
    status = Path(f"/proc/{pid}/status")
    return status.is_file() and "zombie" not in status.read_text()


# Two ranks started and torn down (~25 s each): the slow suite, which CI runs after the fast one.
@pytest.mark.slow
@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_raising_rank_stops_all_ranks(tmp_path, failing_rank):
    ranks = tmp_path / "ranks"
    result = train_cli(
        [
            "strategy=ddp",
            "trainer.devices=2",
            "dataset.batch_size=1",
            "dataset.val_fraction=0.25",
            "+callbacks.fail._target_=tests.ddp_support.RaiseOnRank",
            f"+callbacks.fail.rank={failing_rank}",
            "+callbacks.ranks._target_=tests.ddp_support.RankRecorder",
            f"+callbacks.ranks.directory={ranks}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        timeout=FAILURE_TIMEOUT,
    )
    assert result.returncode != 0, explain(result)
    assert f"injected failure on rank {failing_rank}" in result.stderr, explain(result)
    started = pids(ranks)
    assert len(started) == 2, explain(result)
    assert not [pid for pid in started if alive(pid)], "a rank outlived the run"


@pytest.mark.slow
def test_a_validation_split_with_fewer_subjects_than_ranks_stops_with_one_line(tmp_path):
    # 8 subjects with val_fraction 0.1: one validation subject for two ranks.
    result = train_cli(
        ["strategy=ddp", "trainer.devices=2", "dataset.batch_size=1", "dataset.val_fraction=0.1",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        timeout=2 * FAILURE_TIMEOUT,
    )
    assert result.returncode == 2, explain(result)
    # Each rank finds it; rank 1 may print the line too before rank 0 stops it, but never inside rank 0's.
    errors = [line for line in result.stderr.splitlines() if "medvol: error:" in line]
    assert errors and set(errors) == {
        "medvol: error: the val split has 1 subjects, fewer than the 2 devices; "
        "raise `dataset.val_fraction` or add subjects"
    }, explain(result)
    assert "Traceback" not in result.stderr
