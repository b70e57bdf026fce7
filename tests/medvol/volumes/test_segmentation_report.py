"""The page a person reads: a picture per subject (existing files), volumes in ml equal to metrics.csv and to a hand
count, flagged subjects first."""

from __future__ import annotations

import csv
from html.parser import HTMLParser

import nibabel as nib
import numpy as np
import pytest
import torch
from PIL import Image

from medvol.volumes.prediction_writer import PredictionWriter
from medvol.volumes.segmentation_report import picture_centre

AFFINE = np.diag([2.0, 1.5, 3.0, 1.0])  # voxel volume 9 mm^3


class Table(HTMLParser):
    """The rows of the page's table: cell texts and image sources."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []
        self.header: list[str] = []
        self._cell: list[str] | None = None
        self._in_head = False

    def handle_starttag(self, tag, attrs):
        if tag == "thead":
            self._in_head = True
        elif tag == "tr" and not self._in_head:
            self.rows.append({"cells": [], "images": [], "class": dict(attrs).get("class")})
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.rows[-1]["images"].append(dict(attrs)["src"])

    def handle_endtag(self, tag):
        if tag == "thead":
            self._in_head = False
        elif tag in ("td", "th") and self._cell is not None:
            text = "".join(self._cell).strip()
            (self.header if self._in_head else self.rows[-1]["cells"]).append(text)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def test_the_page_parses_names_existing_pictures_and_repeats_metrics_csv(tmp_path):
    shape = (10, 12, 8)
    scan = np.random.default_rng(0).normal(100, 20, shape).astype(np.float32)
    scan_path = tmp_path / "scan.nii.gz"
    nib.save(nib.Nifti1Image(scan, AFFINE), str(scan_path))
    full, empty = torch.zeros(1, *shape, dtype=torch.int64), torch.zeros(1, *shape, dtype=torch.int64)
    full[0, 2:6, 3:8, 2:5] = 1  # 60 voxels of class 1
    full[0, 7, 7, 7] = 2  # one of class 2
    batch = {
        "subject": ["b_case", "z_empty"], "affine": torch.from_numpy(AFFINE)[None].repeat(2, 1, 1),
        "source_affine": torch.from_numpy(AFFINE)[None].repeat(2, 1, 1), "source_shape": torch.tensor([shape] * 2),
        "source_file": [str(scan_path)] * 2,
    }
    outputs = {
        "volumes": {"seg": [full, empty]}, "as_is": ["seg"], "segments": {"core": [1], "oedema": [2]},
        "subject_metrics": {"dice_core": torch.tensor([0.75, 0.0]), "dice_oedema": torch.tensor([1.0, 0.0])},
        "volume_range": {"core": [0.3, 0.6], "oedema": [0.001, 0.05]},
    }
    writer = PredictionWriter(tmp_path / "out")
    writer.write(outputs, batch)
    writer.write_metrics()
    with (tmp_path / "out" / "metrics.csv").open() as handle:
        table = {row["subject"]: row for row in csv.DictReader(handle)}
    # By hand: 60 voxels x 9 mm^3 = 0.54 ml; 1 voxel = 0.009 ml.
    assert float(table["b_case"]["volume_core_ml"]) == pytest.approx(0.54)
    assert float(table["b_case"]["volume_oedema_ml"]) == pytest.approx(0.009)

    page = Table()
    page.feed((tmp_path / "out" / "index.html").read_text())
    assert page.header[:4] == ["subject", "picture", "volume_core_ml", "volume_oedema_ml"]
    # The empty prediction is flagged and comes first; the other is within the training range.
    assert [r["cells"][0] for r in page.rows] == ["z_empty", "b_case"]
    assert page.rows[0]["class"] == "flagged" and "empty prediction" in page.rows[0]["cells"][-1]
    assert page.rows[1]["class"] == "ok"
    for row in page.rows:
        (source,) = row["images"]
        picture = Image.open(tmp_path / "out" / source)
        assert picture.size[0] == 3 * 256
        values = dict(zip(page.header, row["cells"], strict=True))
        for column in ("volume_core_ml", "volume_oedema_ml", "dice_core", "dice_oedema"):
            assert float(values[column]) == pytest.approx(float(table[values["subject"]][column]), rel=1e-3)


def test_a_volume_far_from_the_training_range_is_flagged(tmp_path):
    shape = (6, 6, 6)
    seg = torch.zeros(1, *shape, dtype=torch.int64)
    seg[0, :5, :5, :5] = 1  # 125 x 9 mm^3 = 1.125 ml, over twice the training's largest 0.5 ml
    batch = {"subject": ["big"], "affine": torch.from_numpy(AFFINE)[None]}
    outputs = {"volumes": {"input": torch.zeros(1, 1, *shape), "seg": seg[None]}, "as_is": ["seg"],
               "segments": {"core": [1]}, "volume_range": {"core": [0.1, 0.5]}}
    writer = PredictionWriter(tmp_path)
    writer.write(outputs, batch)
    writer.write_metrics()
    page = Table()
    page.feed((tmp_path / "index.html").read_text())
    assert page.rows[0]["class"] == "flagged" and "core 1.1 ml, training 0.1-0.5 ml" in page.rows[0]["cells"][-1]


def test_the_planes_cross_inside_the_largest_structure():
    label_map = np.zeros((20, 20, 20), dtype=np.int64)
    label_map[2:4, 2:4, 2:4] = 2
    label_map[10:18, 5:9, 12:15] = 1
    centre = picture_centre(label_map, {"core": [1], "oedema": [2]})
    # The centre of mass (13.5, 6.5, 13): the nearest voxels tie, the first in array order is taken.
    assert label_map[centre] == 1 and centre == (13, 6, 13)
