"""medvol's own rank launcher for one node: rank 0 is the calling process, ranks 1..N-1 are started here.

Lightning's script launcher re-executes `sys.argv` for every extra rank; under a Hydra
multirun each rank would then re-run the whole sweep into directories of its own. Instead,
rank 0 saves the job's resolved config and starts `python -m medvol.run.rank <config>` for the
other ranks (`medvol.run.rank`). They load that config as it is (no Hydra composition, no sweep) and join rank 0
through the usual `MASTER_ADDR`/`MASTER_PORT`/`LOCAL_RANK` variables, so Lightning treats all
of them as externally created processes.

A rank that fails takes the others down: rank 0 watches its children and ends the job when
one exits with an error; a child ends itself when rank 0 disappears.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("medvol")

_RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "RANK")
# How long rank 0 gives itself to fail on its own (a closed gloo socket raises at once) before it is stopped.
_GRACE_SECONDS = 10.0
# How long finished ranks get to leave after rank 0 returns.
_EXIT_SECONDS = 60.0
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port that is free on this machine now (asked of the OS, not guessed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(processes: list[subprocess.Popen]) -> None:
    """Terminate, then kill, every process still running."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + 5.0
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class _Watchdog(threading.Thread):
    """Ends rank 0 when a child rank fails and rank 0 does not notice by itself (e.g. blocked in NCCL)."""

    def __init__(self, children: list[subprocess.Popen]) -> None:
        super().__init__(name="medvol-rank-watchdog", daemon=True)
        self.children = children
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            failed = [(rank, p.returncode) for rank, p in enumerate(self.children, 1) if p.poll() not in (None, 0)]
            if not failed:
                continue
            rank, code = failed[0]
            _stop(self.children)
            if self.done.wait(_GRACE_SECONDS):
                return
            print(f"medvol: error: rank {rank} exited with code {code}; stopping rank 0", file=sys.stderr, flush=True)
            os._exit(1)


def _save_config(cfg: DictConfig) -> Path:
    """The fully resolved config in a private file, so ranks 1..N-1 need neither Hydra nor the sweep."""
    handle, name = tempfile.mkstemp(prefix="medvol-ranks-", suffix=".yaml")
    os.close(handle)
    job = {key: cfg[key] for key in cfg if key != "hydra"}
    OmegaConf.save(OmegaConf.to_container(OmegaConf.create(job), resolve=True), name)
    return Path(name)


@contextmanager
def local_ranks(cfg: DictConfig, devices: int) -> Iterator[None]:
    """Make this process rank 0 of `devices` ranks on this node for the duration of the block.

    On leaving, the other ranks have exited (or been stopped), the process group is gone and
    the environment is as before, so the next job of a sweep starts clean.
    """
    from medvol.core.process_group import release_process_group

    config_path = _save_config(cfg)
    rank_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(devices),
        "NODE_RANK": "0",
    }
    saved = {name: os.environ.get(name) for name in _RANK_VARIABLES}
    os.environ.update(rank_env, LOCAL_RANK="0", RANK="0")
    python_path = os.pathsep.join(filter(None, [str(_PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    children: list[subprocess.Popen] = []
    watchdog = _Watchdog(children)
    failed = True
    try:
        for rank in range(1, devices):
            env = {**os.environ, "LOCAL_RANK": str(rank), "RANK": str(rank), "PYTHONPATH": python_path}
            children.append(
                subprocess.Popen([sys.executable, "-m", "medvol.run.rank", str(config_path), str(os.getpid())], env=env)
            )
        log.info("Started ranks 1..%d (pids %s), rendezvous at port %s", devices - 1,
                 [p.pid for p in children], rank_env["MASTER_PORT"])
        watchdog.start()
        yield
        failed = False
    finally:
        watchdog.done.set()
        if failed:
            _stop(children)
        else:
            _wait_for(children)
        # After the other ranks have gone: rank 0 holds the rendezvous store they talk to until then.
        release_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        config_path.unlink(missing_ok=True)


def _wait_for(children: list[subprocess.Popen]) -> None:
    """After a successful rank 0: every other rank must finish too, and cleanly."""
    deadline = time.monotonic() + _EXIT_SECONDS
    for process in children:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _stop(children)
            raise RuntimeError(f"rank pid {process.pid} did not finish {_EXIT_SECONDS:.0f} s after rank 0") from None
    codes = [p.returncode for p in children]
    if any(codes):
        raise RuntimeError(f"ranks 1..{len(children)} exited with codes {codes}")
