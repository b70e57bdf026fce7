"""The data doctor: `python check_data.py dataset=brats dataset.root=DIR` reads every file and prints one table of
problems."""

from __future__ import annotations

import sys

from medvol.run.data_check import main

if __name__ == "__main__":
    sys.exit(main())
