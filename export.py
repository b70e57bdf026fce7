"""medvol's export entry point: `python export.py ckpt_path=CKPT format=onnx output_dir=DIR` (see `--help`)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

import medvol.run.resolvers  # noqa: F401 - registers the resolvers the run configs use
from medvol.core.console import quiet_console
from medvol.core.errors import MedvolError
from medvol.run.exporting import export
from medvol.run.override_check import override_error


@hydra.main(version_base="1.3", config_path="conf", config_name="export")
def main(cfg: DictConfig) -> None:
    quiet_console()
    try:
        export(cfg)
    except MedvolError as err:
        sys.stderr.write(f"medvol: error: {err}\n")
        sys.stderr.flush()
        sys.exit(2)


if __name__ == "__main__":
    problem = override_error(Path(__file__).resolve().parent / "conf", "export", sys.argv[1:])
    if problem:
        print(f"medvol: error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
