"""What the validation image costs: render time and PNG size of one `val/slices` grid per volume size.

    .venv/bin/python benchmarks/training/slice_images.py [--repeats N]

Renders the default grid (2 subjects; input | reconstruction | error map with colour bar;
256 px panels) from random volumes with a 1.5 mm RAS affine, as the callback does once per
validation epoch on rank 0, and prints a Markdown table: median render time and the size of
the PNG TensorBoard stores.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import median_seconds, table_header  # noqa: E402
from callbacks.slice_grid import Sample, slice_grid  # noqa: E402


def grid_figures(size: int, repeats: int) -> tuple[float, int, tuple[int, int]]:
    generator = torch.Generator().manual_seed(size)
    affine = torch.tensor(np.diag([1.5, 1.5, 1.5, 1.0]))
    samples = []
    for i in range(2):
        volume = torch.rand(size, size, size, generator=generator) * 2 - 1
        volumes = {"input": volume, "reconstruction": volume + 0.1 * torch.randn(volume.shape, generator=generator)}
        samples.append(Sample(f"sub-{i:03d}", volumes, affine, ("reconstruction", "input")))
    seconds = median_seconds(lambda: slice_grid(samples), repeats, warmup=0)
    image = slice_grid(samples)
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    return seconds, len(png.getvalue()), (image.shape[1], image.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(table_header(["volume", "grid (w x h px)", "render (median)", "PNG size"]))
    for size in (32, 64, 128, 256):
        seconds, png_bytes, (width, height) = grid_figures(size, args.repeats)
        print(f"| {size}³ | {width} x {height} | {seconds * 1000:.0f} ms | {png_bytes / 1024:.0f} KiB |")


if __name__ == "__main__":
    main()
