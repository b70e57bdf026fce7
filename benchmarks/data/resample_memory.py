"""Peak memory of MONAI's `Spacing` per voxel of the grid it makes: what `medvol.volumes.volume_budget` counts a
resampled volume at.

    .venv/bin/python benchmarks/data/resample_memory.py

Each case runs in a fresh process: a random (C, 40, 40, 40) volume of 4 mm voxels resampled to 1 mm (157^3 voxels
out), linearly as `resampling: linear` does (images bilinear, labels nearest) and with cubic splines as
`resampling: nnunet` does its images; the process's peak resident memory (`ru_maxrss`) grows by the bytes printed
per output voxel (C channels together).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import table_header  # noqa: E402

CASE = """
import resource, torch
from monai.data import MetaTensor
from monai.transforms import Spacing
mode, channels = {mode!r}, {channels}
volume = MetaTensor(torch.rand(channels, 40, 40, 40), affine=torch.diag(torch.tensor([4.0, 4.0, 4.0, 1.0])))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = Spacing([1.0, 1.0, 1.0], mode=mode, padding_mode="nearest" if isinstance(mode, int) else "border")(volume)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024 / out[0].numel())
"""


def bytes_per_voxel(mode: str | int, channels: int) -> float:
    """The peak memory `Spacing` adds per voxel of its output grid, measured in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", CASE.format(mode=mode, channels=channels)],
        capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "1", "PATH": ""},
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(table_header(["interpolation", "channels", "bytes per output voxel"]))
    for name, mode in (("bilinear", "bilinear"), ("nearest", "nearest"), ("cubic spline (order 3)", 3)):
        for channels in (1, 2, 4):
            print(f"| {name} | {channels} | {bytes_per_voxel(mode, channels):.1f} |")


if __name__ == "__main__":
    main()
