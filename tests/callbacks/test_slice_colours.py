"""TensorBoard's slice grids in the report page's colours, with a legend, in a window that does not saturate (issue 63
item 9)."""

from __future__ import annotations

import numpy as np
import torch

from callbacks.slice_grid import GAP, HEADER, LEGEND_HEIGHT, ROW_LABEL, Sample, slice_grid
from medvol.volumes.segmentation_report import COLOURS

PANEL = 64
SHAPE = (32, 32, 32)
# BraTS-like nested regions over label values 1 (necrosis), 2 (oedema), 3 (enhancing).
SEGMENTS = {"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]}


def brain() -> tuple[torch.Tensor, torch.Tensor]:
    """A z-scored brain (mean 0, spread 1 inside, as the plan normalizes it, and a bright rim beyond 1) and a tumour
    whose largest part is oedema (label 2)."""
    grid = torch.stack(torch.meshgrid(*[torch.arange(n, dtype=torch.float32) - n / 2 for n in SHAPE], indexing="ij"))
    radius = grid.norm(dim=0)
    image = torch.where(radius < 14, 1.5 + torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)), -1.0)
    labels = torch.zeros(SHAPE, dtype=torch.int64)
    labels[radius < 8] = 2
    labels[radius < 3] = 3
    return image, labels


def test_the_grey_window_follows_the_image_and_does_not_saturate():
    image, _ = brain()
    grid = slice_grid([Sample("s", {"input": image})], panel_size=PANEL, colorbar=False)
    axial = grid[HEADER: HEADER + PANEL, ROW_LABEL: ROW_LABEL + PANEL, 0]
    inside = axial[PANEL // 2 - 12: PANEL // 2 + 12, PANEL // 2 - 12: PANEL // 2 + 12]
    # A fixed [-1, 1] window drew almost every brain voxel white.
    assert (inside == 255).mean() < 0.05 and inside.std() > 30


def test_label_maps_take_the_report_pages_structure_colours_and_a_legend_names_them():
    image, labels = brain()
    sample = Sample("s", {"input": image, "seg": labels}, segments=SEGMENTS)
    grid = slice_grid([sample], panel_size=PANEL, colorbar=False)
    assert grid.shape[0] == HEADER + 3 * (PANEL + GAP) + LEGEND_HEIGHT
    seg_axial = grid[HEADER: HEADER + PANEL, ROW_LABEL + PANEL + GAP: ROW_LABEL + 2 * PANEL + GAP].astype(int)
    # An oedema voxel (WT only) is drawn in the report's WT colour, red, not label 2's green.
    oedema = seg_axial[PANEL // 2, PANEL // 2 + 10]
    assert oedema[0] > oedema[1] + 40, oedema
    legend = grid[-LEGEND_HEIGHT:]
    for colour in COLOURS[:3]:
        assert (legend == np.array(colour)).all(-1).any(), colour
