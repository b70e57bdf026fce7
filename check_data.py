"""The data doctor: reads every file of the dataset the overrides choose and prints one table of problems.

    python check_data.py dataset=brats dataset.root=/data/BraTS2023

Exit status 1 if there are problems, 2 for a bad command. The overrides are train.py's (docs/data.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from medvol.core.errors import MedvolError
from medvol.run.override_check import added_argument_error, asks_for_help, override_error

CONF_DIR = Path(__file__).resolve().parent / "conf"

if __name__ == "__main__":
    argv = sys.argv[1:]
    # Answered before the datasets' packages (torch, MONAI) load.
    if asks_for_help(argv):
        print(__doc__)
        sys.exit(0)
    problem = override_error(CONF_DIR, "train", argv)
    if not problem:
        from medvol.run.data_check import main

        try:
            problem = added_argument_error(CONF_DIR, "train", argv)
        except MedvolError as err:
            problem = str(err)
    if problem:
        print(f"medvol: error: {problem}", file=sys.stderr)
        sys.exit(2)
    sys.exit(main())
