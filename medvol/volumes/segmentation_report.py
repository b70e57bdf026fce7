"""Segmentation results a person looks at: one picture per subject and one static page for all of them.

Per subject, `<subject>_<name>.png`: the axial, coronal and sagittal planes (radiological view) through the
largest predicted structure, the scan in its window (its 0.5th-99.5th percentiles), each structure outlined in
its own colour, a legend with each structure's volume. `index.html` beside the masks: one row per subject (the
picture, the volume of every structure in ml, Dice and HD95 where a reference exists), flagged subjects first:
an empty prediction, or a volume far from the range of the training labels (under half the smallest or over
twice the largest). The page is plain HTML with relative links: it opens from disk, no server.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from scipy import ndimage

from medvol.volumes.anatomical_planes import mid_planes

INDEX_FILE = "index.html"
PANEL = 256
LEGEND = 22
# Outline colours per structure, distinguishable on grey (as the slice grids' label colours).
COLOURS = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
           (70, 240, 240), (240, 50, 230)]
# A volume is flagged when under FAR x the smallest or over 1/FAR x the largest training volume.
FAR = 0.5


def volume_column(name: str) -> str:
    return f"volume_{name}_ml"


def structure_volumes(
    label_map: np.ndarray, segments: Mapping[str, Sequence[int]], affine: np.ndarray
) -> dict[str, float]:
    """Each structure's volume in ml: its voxels (any of its label values) x the voxel volume of `affine`."""
    voxel_ml = abs(float(np.linalg.det(np.asarray(affine, dtype=np.float64)[:3, :3]))) / 1000.0
    return {name: float(np.isin(label_map, list(values)).sum()) * voxel_ml for name, values in segments.items()}


def display_window(scan: np.ndarray) -> tuple[float, float]:
    """The scan's 0.5th and 99.5th percentiles: its window on screen."""
    low, high = np.percentile(scan, [0.5, 99.5])
    return float(low), float(high) if high > low else float(low) + 1.0


def picture_centre(label_map: np.ndarray, segments: Mapping[str, Sequence[int]]) -> tuple[int, int, int] | None:
    """The voxel the three planes cross at: of the largest structure, its voxel nearest to its centre of mass."""
    sizes = {name: int(np.isin(label_map, list(values)).sum()) for name, values in segments.items()}
    if not sizes or max(sizes.values()) == 0:
        return None
    mask = np.isin(label_map, list(segments[max(sizes, key=sizes.__getitem__)]))
    points = np.argwhere(mask)
    centre = points.mean(axis=0)
    nearest = points[np.argmin(((points - centre) ** 2).sum(axis=1))]
    return int(nearest[0]), int(nearest[1]), int(nearest[2])


def outline(mask: np.ndarray) -> np.ndarray:
    """The boundary pixels of a 2D mask (the mask less its erosion)."""
    return mask & ~ndimage.binary_erosion(mask)


def render_picture(
    scan: np.ndarray, label_map: np.ndarray, segments: Mapping[str, Sequence[int]], affine: np.ndarray,
    volumes: Mapping[str, float], title: str, path: Path,
) -> Path:
    """Write the subject's picture (three planes through the largest structure, outlines, legend) to `path`."""
    low, high = display_window(scan)
    centre = picture_centre(label_map, segments)
    scan_planes = mid_planes(torch.from_numpy(np.ascontiguousarray(scan, dtype=np.float32)), affine, centre)
    label_planes = mid_planes(torch.from_numpy(np.ascontiguousarray(label_map).astype(np.int64)), affine, centre)
    font = ImageFont.load_default()
    width = 3 * PANEL
    canvas = Image.new("RGB", (width, LEGEND + PANEL + LEGEND * max(1, len(segments))), (0, 0, 0))
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 4), title, fill=(255, 255, 255), font=font)
    for column, (scan_plane, label_plane) in enumerate(zip(scan_planes, label_planes, strict=True)):
        rows, cols = scan_plane.image.shape
        height, wide = rows * scan_plane.spacing[0], cols * scan_plane.spacing[1]
        scale = PANEL / max(height, wide)
        size = (max(1, round(wide * scale)), max(1, round(height * scale)))
        grey = ((scan_plane.image.numpy() - low) / (high - low)).clip(0, 1) * 255
        image = np.asarray(Image.fromarray(grey.astype(np.uint8)).resize(size, Image.Resampling.BILINEAR))
        labels = np.asarray(
            Image.fromarray(label_plane.image.numpy().astype(np.int32)).resize(size, Image.Resampling.NEAREST)
        )
        rgb = np.repeat(image[..., None], 3, axis=-1)
        for index, values in enumerate(segments.values()):
            rgb[outline(np.isin(labels, list(values)))] = COLOURS[index % len(COLOURS)]
        left = column * PANEL + (PANEL - size[0]) // 2
        canvas.paste(Image.fromarray(rgb), (left, LEGEND + (PANEL - size[1]) // 2))
        draw.text((column * PANEL + 4, LEGEND + 2), f"{scan_plane.name} ({scan_plane.top} up)",
                  fill=(255, 255, 0), font=font)
    for index, name in enumerate(segments):
        top = LEGEND + PANEL + index * LEGEND + 4
        draw.rectangle([6, top, 20, top + 12], fill=COLOURS[index % len(COLOURS)])
        draw.text((28, top), f"{name}: {volumes.get(name, 0.0):.2f} ml", fill=(255, 255, 255), font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return path


def flags(
    row: Mapping[str, Any], names: Sequence[str], volume_range: Mapping[str, Sequence[float]] | None
) -> list[str]:
    """Why a subject needs a look: an empty prediction, a structure's volume far from the training range."""
    volumes = {n: row.get(volume_column(n)) for n in names}
    found = []
    if volumes and all(v is not None and float(v) == 0.0 for v in volumes.values()):
        found.append("empty prediction")
    for name, value in volumes.items():
        bounds = (volume_range or {}).get(name)
        if value is None or not bounds:
            continue
        low, high = float(bounds[0]), float(bounds[1])
        if float(value) < FAR * low or float(value) > high / FAR:
            found.append(f"{name} {float(value):.1f} ml, training {low:.1f}-{high:.1f} ml")
    return found


def cell(value: Any) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    return html.escape(str(value))


def write_index(
    output_dir: Path, rows: Sequence[Mapping[str, Any]], pictures: Mapping[str, str], names: Sequence[str],
    volume_range: Mapping[str, Sequence[float]] | None = None,
) -> Path:
    """`index.html`: one row per subject (picture, volumes, scores), flagged rows first; the path written."""
    scored = [k for k in dict.fromkeys(k for r in rows for k in r) if k.startswith(("dice_", "hd95_"))]
    volume_keys = [volume_column(n) for n in names]
    marked = [(flags(r, names, volume_range), r) for r in rows]
    marked.sort(key=lambda item: (not item[0], str(item[1]["subject"])))
    header = ["subject", "picture", *volume_keys, *scored, "flags"]
    lines = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"><title>medvol segmentation</title>',
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:4px;text-align:right}tr.flagged{background:#fde2e2}img{width:384px}</style></head><body>",
        f"<h1>Segmentation: {len(rows)} subjects, {sum(1 for f, _ in marked if f)} flagged</h1>",
        "<table>", "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr></thead><tbody>",
    ]
    for found, row in marked:
        subject = str(row["subject"])
        picture = pictures.get(subject)
        link = html.escape(picture or "")
        image = f'<a href="{link}"><img src="{link}" alt="{html.escape(subject)}"></a>' if picture else ""
        cells = [f"<td>{html.escape(subject)}</td>", f"<td>{image}</td>"]
        cells += [f"<td>{cell(row.get(k, ''))}</td>" for k in [*volume_keys, *scored]]
        cells.append(f"<td>{html.escape('; '.join(found))}</td>")
        lines.append(f'<tr class="{"flagged" if found else "ok"}">' + "".join(cells) + "</tr>")
    lines += ["</tbody></table>", "</body></html>", ""]
    path = output_dir / INDEX_FILE
    output_dir.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path
