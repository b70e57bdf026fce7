"""A labelled RGB grid of anatomical mid-planes: one column per volume (and error map), one row per sample and plane."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from medvol.volumes.anatomical_planes import Plane, mid_planes
from medvol.volumes.segmentation_report import COLOURS

HEADER = 30
ROW_LABEL = 120
COLORBAR = 70
# Dark gap between panels, so the orientation letters of neighbours do not run together.
GAP = 6
# Structure colours, those of the report page's pictures (`medvol.volumes.segmentation_report`): its k-th structure
# (a sample's `segments`, e.g. WT, TC, ET), else label value k+1, in the k-th colour; background stays transparent.
LABEL_COLOURS = np.array(COLOURS, dtype=np.float32)
# The grey window of a sample's images: these percentiles of its first image's shown planes (a z-scored scan spans
# several units: a fixed [-1, 1] window left most of a brain white).
WINDOW_PERCENTILES = (0.5, 99.5)
LEGEND_HEIGHT = 28
# Error-map colour ramp (black -> purple -> orange -> pale yellow), linear between the anchors.
ERROR_RAMP = np.array([[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]], dtype=np.float32)
OVERLAY_ALPHA = 0.5


@dataclass
class Sample:
    """One subject's volumes (name -> (D, H, W)), its affine, and which pair to draw as an error map."""

    subject: str
    volumes: dict[str, torch.Tensor]
    affine: torch.Tensor | None = None
    difference: tuple[str, str] | None = None
    # Structure name -> the label values it covers (a segmentation's `segments`: BraTS' WT = 1, 2, 3).
    segments: dict[str, list[int]] | None = None


def window(planes: list[Plane]) -> tuple[float, float]:
    """The grey window of an image: `WINDOW_PERCENTILES` of its shown planes' voxels."""
    values = np.concatenate([plane.image.float().numpy().ravel() for plane in planes])
    low, high = (float(v) for v in np.percentile(values, WINDOW_PERCENTILES))
    return (low, high) if high > low else (low, low + 1.0)


def _grey(image: torch.Tensor, limits: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    """Values in the window `limits` -> RGB float [0, 255] (clipped beyond it)."""
    low, high = limits
    values = ((image.float().numpy() - low) / (high - low)).clip(0, 1) * 255.0
    return np.repeat(values[..., None], 3, axis=-1)


def structures(labels: torch.Tensor, segments: dict[str, list[int]] | None) -> list[tuple[str, np.ndarray]]:
    """(name, mask) per structure: a sample's `segments` in their order, else each label value present."""
    index = labels.long().numpy()
    if segments:
        return [(name, np.isin(index, list(values))) for name, values in segments.items()]
    return [(f"label {value}", index == value) for value in range(1, max(int(index.max(initial=0)), 0) + 1)]


def _labels_over(base: np.ndarray, labels: torch.Tensor, segments: dict[str, list[int]] | None = None) -> np.ndarray:
    """Each structure in its colour over `base`, in order: a region inside another (TC in WT) drawn over it."""
    coloured = base.copy()
    for k, (_, mask) in enumerate(structures(labels, segments)):
        coloured[mask] = (1 - OVERLAY_ALPHA) * base[mask] + OVERLAY_ALPHA * LABEL_COLOURS[k % len(LABEL_COLOURS)]
    return coloured


def legend_names(samples: list[Sample]) -> list[str]:
    """The structures the grid's label maps show, in colour order: the samples' `segments`, else label values."""
    for sample in samples:
        if sample.segments:
            return list(sample.segments)
    largest = max((int(v.max()) for s in samples for v in s.volumes.values() if not torch.is_floating_point(v)),
                  default=0)
    return [f"label {value}" for value in range(1, largest + 1)]


def _legend(names: list[str], width: int, font: ImageFont.ImageFont) -> Image.Image:
    strip = Image.new("RGB", (width, LEGEND_HEIGHT), (24, 24, 24))
    draw = ImageDraw.Draw(strip)
    x = 8
    for k, name in enumerate(names):
        colour = tuple(int(c) for c in LABEL_COLOURS[k % len(LABEL_COLOURS)])
        draw.rectangle([x, 8, x + 14, 20], fill=colour)
        draw.text((x + 20, LEGEND_HEIGHT // 2), name, fill="white", font=font, anchor="lm")
        x += 20 + int(font.getlength(name)) + 18
    return strip


def error_colours(values: np.ndarray, vmax: float) -> np.ndarray:
    """|error| in [0, vmax] -> RGB float [0, 255] along `ERROR_RAMP`."""
    position = np.clip(values / vmax, 0, 1) * (len(ERROR_RAMP) - 1)
    low = np.floor(position).astype(int).clip(0, len(ERROR_RAMP) - 2)
    frac = (position - low)[..., None]
    return ERROR_RAMP[low] * (1 - frac) + ERROR_RAMP[low + 1] * frac


def _difference(a: Plane, b: Plane) -> Plane:
    return Plane(a.name, (a.image.float() - b.image.float()).abs(), a.spacing, a.top, a.left)


def _panel(rgb: np.ndarray, plane: Plane, size: int, font: ImageFont.ImageFont) -> Image.Image:
    """`rgb` scaled with nearest neighbour to fit `size` x `size` at the true voxel aspect, letters at the edges."""
    rows, cols = rgb.shape[:2]
    height, width = rows * plane.spacing[0], cols * plane.spacing[1]
    scale = size / max(height, width)
    shape = (max(1, round(width * scale)), max(1, round(height * scale)))
    image = Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).resize(shape, Image.Resampling.NEAREST)
    panel = Image.new("RGB", (size, size))
    panel.paste(image, ((size - shape[0]) // 2, (size - shape[1]) // 2))
    draw = ImageDraw.Draw(panel)
    for letter, anchor, xy in (
        (plane.top, "mt", (size // 2, 2)), (plane.bottom, "mb", (size // 2, size - 2)),
        (plane.left, "lm", (3, size // 2)), (plane.right, "rm", (size - 3, size // 2)),
    ):
        draw.text(xy, letter, fill=(255, 255, 0), font=font, anchor=anchor, stroke_width=1, stroke_fill=(0, 0, 0))
    return panel


def _colorbar(vmax: float, height: int, font: ImageFont.ImageFont) -> Image.Image:
    bar = Image.new("RGB", (COLORBAR, height))
    ramp = error_colours(np.linspace(vmax, 0, height - 20)[:, None].repeat(14, axis=1), vmax)
    bar.paste(Image.fromarray(ramp.astype(np.uint8)), (4, 10))
    draw = ImageDraw.Draw(bar)
    draw.text((22, 10), f"{vmax:.2g}", fill=(255, 255, 255), font=font, anchor="lt")
    draw.text((22, height - 10), "0", fill=(255, 255, 255), font=font, anchor="lb")
    return bar


def column_names(sample: Sample) -> list[str]:
    """Column titles: the volumes in order, then the error map if one is asked for."""
    names = list(sample.volumes)
    if sample.difference is not None:
        names.append(f"|{sample.difference[0]} - {sample.difference[1]}|")
    return names


def slice_grid(samples: list[Sample], panel_size: int = 256, colorbar: bool = True) -> np.ndarray:
    """The grid as an (H, W, 3) uint8 image.

    Layout: a header row of column names; per sample, three rows (axial, coronal, sagittal)
    labelled with the subject and the plane; panels `panel_size` px square, `GAP` px apart. Float volumes are grey in
    a window of their sample's first float volume (`WINDOW_PERCENTILES` of its shown planes: z-scores and [-1, 1]
    alike); integer volumes are label maps drawn over it, each structure in the report page's colour, named in a
    legend strip under the grid; the error map |a - b| shares one scale over the grid, shown by a colour bar when
    `colorbar`.
    """
    font = ImageFont.load_default(size=16)
    small = ImageFont.load_default(size=14)
    columns = column_names(samples[0])
    # Planes first: the error map and its scale come from the shown planes, never whole volumes (256^3 costs seconds).
    sample_planes = [{name: mid_planes(v, s.affine) for name, v in s.volumes.items()} for s in samples]
    errors = [
        [_difference(a, b) for a, b in zip(p[s.difference[0]], p[s.difference[1]], strict=True)]
        for s, p in zip(samples, sample_planes, strict=True)
        if s.difference
    ]
    vmax = max([float(plane.image.max()) for row in errors for plane in row] + [1e-6])
    with_bar = colorbar and bool(errors)
    pitch = panel_size + GAP
    # Row labels never run under the first panel: the column is as wide as the longest subject id needs.
    label_width = max([ROW_LABEL, *(int(font.getlength(sample.subject)) + 16 for sample in samples)])
    width = label_width + len(columns) * pitch + (COLORBAR if with_bar else 0)
    has_labels = any(not torch.is_floating_point(v) for s in samples for v in s.volumes.values())
    names = legend_names(samples) if has_labels else []
    height = HEADER + 3 * len(samples) * pitch
    grid = Image.new("RGB", (width, height + (LEGEND_HEIGHT if names else 0)), (24, 24, 24))
    draw = ImageDraw.Draw(grid)
    for c, name in enumerate(columns):
        draw.text((label_width + c * pitch + panel_size // 2, HEADER // 2), name, fill="white", font=font, anchor="mm")
    error_rows = iter(errors)
    for s, sample in enumerate(samples):
        per_column = list(sample_planes[s].values())
        floats = [p for p in per_column if torch.is_floating_point(p[0].image)]
        base_planes = floats[0] if floats else None
        limits = window(base_planes) if base_planes else (-1.0, 1.0)
        if sample.difference is not None:
            per_column.append(next(error_rows))
        for p in range(3):
            top = HEADER + (3 * s + p) * pitch
            plane_name = per_column[0][p].name
            draw.text((8, top + panel_size // 2 - 10), sample.subject, fill="white", font=font, anchor="lm")
            draw.text((8, top + panel_size // 2 + 10), plane_name, fill=(190, 190, 190), font=font, anchor="lm")
            for c, planes in enumerate(per_column):
                plane = planes[p]
                if sample.difference is not None and c == len(per_column) - 1:
                    rgb = error_colours(plane.image.float().numpy(), vmax)
                elif torch.is_floating_point(plane.image):
                    rgb = _grey(plane.image, limits)
                else:
                    base = _grey(base_planes[p].image, limits) if base_planes else \
                        np.zeros((*plane.image.shape, 3), np.float32)
                    rgb = _labels_over(base, plane.image, sample.segments)
                grid.paste(_panel(rgb, plane, panel_size, small), (label_width + c * pitch, top))
            if with_bar:
                grid.paste(_colorbar(vmax, panel_size, small), (label_width + len(columns) * pitch, top))
    if names:
        grid.paste(_legend(names, width, small), (0, height))
    return np.asarray(grid)
