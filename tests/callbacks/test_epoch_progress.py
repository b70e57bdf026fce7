"""One line per epoch in train.log and on a console that is not a terminal, from rank 0 only; no Rich bar in a pipe."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from callbacks.epoch_progress import duration
from callbacks.terminal_progress_bar import TerminalProgressBar
from medvol.core.console import ConsoleFilter, log_file
from medvol.run.training import run
from tests.conftest import ROOT, TINY, subprocess_env
from tests.ddp_support import explain, train_cli
from tests.medvol.run.test_ddp_correctness import DATA, REGRESSOR, TINY_DATA

# epoch k/N | lr | train loss | the monitored metric (best so far, its epoch) | epoch time | time left
LINE = re.compile(
    r"epoch (?P<epoch>\d+)/(?P<last>\d+) \| lr (?P<lr>\S+) \| train/loss (?P<loss>\S+) \| "
    r"(?P<metric>val/\w+) (?P<value>\S+) \(best (?P<best>\S+) at epoch (?P<best_epoch>\d+)\) \| "
    r"(?P<seconds>[\d.]+) s/epoch \| (?P<left>\S+) left"
)


def epoch_lines(text: str) -> list[re.Match]:
    return [m for m in (LINE.search(line) for line in text.splitlines()) if m]


def test_train_log_holds_one_line_per_epoch_with_the_fields(tiny_cfg, tmp_path):
    cfg = tiny_cfg("trainer.max_epochs=3", "model.discriminator_iter_start=100", "callbacks.volume_slices=null")
    with log_file(tmp_path / "train.log"):
        run(cfg)
    lines = epoch_lines((tmp_path / "train.log").read_text())
    assert [m["epoch"] for m in lines] == ["0", "1", "2"] and {m["last"] for m in lines} == {"2"}
    assert {m["metric"] for m in lines} == {"val/psnr"} and {float(m["lr"]) for m in lines} == {3e-4}
    values = [float(m["value"]) for m in lines]
    for k, m in enumerate(lines):
        best = max(values[: k + 1])
        assert float(m["best"]) == pytest.approx(best, abs=1e-4)
        assert int(m["best_epoch"]) == values.index(best)
    assert all(float(m["loss"]) > 0 and float(m["seconds"]) > 0 for m in lines)
    assert lines[-1]["left"] == "0s"


def test_on_a_terminal_the_line_goes_to_the_log_file_only(tiny_cfg, monkeypatch, caplog):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    cfg = tiny_cfg("model.discriminator_iter_start=100", "callbacks.volume_slices=null")
    with caplog.at_level(logging.INFO, logger="medvol"):
        run(cfg)
    (record,) = [r for r in caplog.records if LINE.search(r.getMessage())]
    assert not ConsoleFilter().filter(record)
    piped = logging.makeLogRecord({k: v for k, v in record.__dict__.items() if k != "file_only"})
    assert ConsoleFilter().filter(piped)


def test_a_subprocess_run_into_a_pipe_prints_the_lines_and_no_rich_bar(tmp_path):
    args = [o for o in TINY if o != "callbacks.progress_bar=null"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, "trainer.max_epochs=2", "callbacks.volume_slices=null",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, explain(done)
    assert [m["epoch"] for m in epoch_lines(done.stdout)] == ["0", "1"]
    assert [m["epoch"] for m in epoch_lines((tmp_path / "run" / "train.log").read_text())] == ["0", "1"]
    output = done.stdout + done.stderr
    # A Rich bar frame: `Epoch 1/1  ━━━━━━━━ 3/3 0:00:00 • 0:00:00`.
    assert not re.search(r"Epoch \d+/\d+ .*━", output), output


@pytest.mark.slow  # two gloo ranks, ~30 s
def test_two_ranks_write_the_lines_once(tmp_path):
    done = train_cli([*TINY_DATA, *DATA, *REGRESSOR, "strategy=ddp", "trainer.devices=2", "dataset.batch_size=1",
                      "trainer.max_epochs=2", f"hydra.run.dir={tmp_path / 'ddp'}"], cwd=tmp_path, tiny=False)
    assert done.returncode == 0, explain(done)
    assert [m["epoch"] for m in epoch_lines(done.stdout + done.stderr)] == ["0", "1"]
    assert [m["epoch"] for m in epoch_lines((tmp_path / "ddp" / "train.log").read_text())] == ["0", "1"]



def test_durations_read_at_a_glance():
    assert [duration(s) for s in (0.4, 45, 725, 11220)] == ["0s", "45s", "12m05s", "3h07m"]


@pytest.mark.parametrize("terminal", [True, False])
def test_the_rich_bar_only_on_a_terminal(monkeypatch, terminal):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal, raising=False)
    bar = TerminalProgressBar()
    bar.setup(SimpleNamespace(is_global_zero=True), None, "fit")  # type: ignore[arg-type]
    assert bar.is_enabled is terminal
