"""medvol's export entry point: `python export.py ckpt_path=CKPT format=onnx output_dir=DIR` (see `--help`)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from medvol.core.console import quiet_console
from medvol.core.errors import MedvolError
from medvol.run.override_check import answer_at_once

CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="export")
def main(cfg: DictConfig) -> None:
    # Imported here, not above: a typo or `--help` is answered before torch and Lightning load.
    from medvol.run.exporting import export

    quiet_console()
    try:
        export(cfg)
    except MedvolError as err:
        sys.stderr.write(f"medvol: error: {err}\n")
        sys.stderr.flush()
        sys.exit(2)


if __name__ == "__main__":
    answer_at_once(CONF_DIR, "export", sys.argv[1:])
    main()
