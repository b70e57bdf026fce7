"""Entry point of ranks 1..N-1 started by `medvol.run.launch`: `python -m medvol.run.rank <config.yaml> <rank-0 pid>`.

A module of its own so that the launcher, which `training` imports, never imports `training` back.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from omegaconf import DictConfig, OmegaConf

from medvol.core.errors import MedvolError
from medvol.run.training import run


def _exit_with_parent(parent_pid: int) -> None:
    """Leave when rank 0 is gone: its collectives will never come."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                print(f"medvol: error: rank 0 (pid {parent_pid}) is gone; rank {os.environ.get('RANK')} stops",
                      file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="medvol-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    """Load the job's resolved config as rank 0 saved it and run this rank's share of it."""
    config_path, parent_pid = argv
    _exit_with_parent(int(parent_pid))
    logging.basicConfig(level=logging.WARNING, format=f"[rank {os.environ.get('RANK')}] %(levelname)s %(message)s")
    cfg = OmegaConf.load(config_path)
    assert isinstance(cfg, DictConfig)
    try:
        # Rank 0's config as it planned it (and chose `hardware.fit`'s batch): not planned or fitted again here.
        run(cfg, settled=True)
    except MedvolError as err:
        # One write, so that rank 0's copy of the same line cannot land inside it (see train.py).
        sys.stderr.write(f"medvol: error: {err}\n")
        sys.stderr.flush()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
