"""The data doctor's command line: compose the training config with the given overrides and check every file.

    python check_data.py dataset=brats dataset.root=/data/BraTS2023

prints one table of problems (exit status 1 if there are any, 2 for a bad command). The checks
themselves live with the datasets (`datamodules.pipeline.check`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import open_dict

import medvol.run.resolvers  # noqa: F401 - the configs use medvol's resolvers
from datamodules.pipeline.check import format_table
from medvol.core.build import build
from medvol.core.errors import refusal_within
from medvol.run.override_check import override_error

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the full check of the dataset the overrides choose; print the table; return the exit status."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in overrides):
        print(__doc__)
        return 0
    # A misspelt key or option is one line with exit status 2, as for train.py, not Hydra's traceback.
    problem = override_error(CONF_DIR, "train", overrides)
    if problem:
        print(f"medvol: error: {problem}", file=sys.stderr)
        return 2
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="check"):
            cfg = compose(config_name="train", overrides=overrides)
        with open_dict(cfg):
            cfg.dataset.split_file = None
        datamodule = build(cfg.dataset)
        if not hasattr(datamodule, "data_problems"):
            print(f"medvol: {cfg.dataset._target_} has no files to check")
            return 0
        problems, checked = datamodule.data_problems(full=True)
    except Exception as err:
        # A refusal met while OmegaConf resolves `${nnunet_channels:...}` (a dataset.json read) reaches here wrapped.
        refusal = refusal_within(err)
        if refusal is None:
            raise
        print(f"medvol: error: {refusal}", file=sys.stderr)
        return 2
    if problems:
        print(format_table(problems))
        print(f"\n{len(problems)} problem(s) in {checked} subject(s)")
        return 1
    print(f"no problems found in {checked} subject(s)")
    return 0
