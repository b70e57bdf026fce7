"""medvol's predict entry point: `python predict.py ckpt_path=CKPT input=PATH output_dir=DIR` (see `--help`)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from medvol.core.console import quiet_console
from medvol.core.errors import MedvolError
from medvol.run.command_help import help_text
from medvol.run.override_check import added_argument_error, asks_for_help, override_error

CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="predict")
def main(cfg: DictConfig) -> None:
    # Imported here, not above: a typo or `--help` is answered before torch and Lightning load.
    from medvol.run.predicting import predict

    quiet_console()
    try:
        predict(cfg)
    except MedvolError as err:
        sys.stderr.write(f"medvol: error: {err}\n")
        sys.stderr.flush()
        # 2: refused before any output; 3: some subjects failed, every other one written (SubjectsFailed).
        sys.exit(getattr(err, "exit_code", 2))


if __name__ == "__main__":
    argv = sys.argv[1:]
    # Hydra's own --help costs as much as importing torch (medvol.run.command_help).
    text = help_text(CONF_DIR, "predict", argv)
    if text is not None:
        print(text)
        sys.exit(0)
    problem = override_error(CONF_DIR, "predict", argv)
    if not problem and not asks_for_help(argv):
        import medvol.run.resolvers  # noqa: F401 - registers the resolvers the run configs use

        try:
            problem = added_argument_error(CONF_DIR, "predict", argv)
        except MedvolError as err:
            problem = str(err)
    if problem:
        print(f"medvol: error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
