"""`dataset.label_regions` is the one source of the segmentation model's regions: the README's BraTS row trains."""

from __future__ import annotations

import pytest

from datamodules.sources.brats import REGIONS
from datamodules.sources.example_data import write_brats
from medvol.core.errors import MedvolError
from medvol.run.run_check import check_label_regions
from medvol.run.training import run
from tests.conftest import TINY_COMMON, TINY_MODEL, compose_cfg

TINY_FILES = [o for o in [*TINY_COMMON, *TINY_MODEL["segmentation"]] if not o.startswith("dataset.")]
README_ROW = ["model=segmentation", "dataset=brats", "dataset.label_regions=[WT,TC,ET]"]


def test_the_readme_brats_row_trains_on_the_datasets_region_channels(tmp_path):
    root = write_brats(tmp_path / "brats", subjects=4, year=2023, size=16)
    cfg = compose_cfg(tmp_path / "run", [
        *README_ROW, f"dataset.root={root}", *TINY_FILES, "dataset.transforms.spatial_size=[16,16,16]",
        "dataset.val_fraction=0.25", "dataset.test_fraction=0.25", "dataset.batch_size=1", "dataset.num_workers=0",
    ], tiny=False)
    assert dict(cfg.model.regions) == {name: list(REGIONS[name]) for name in ("WT", "TC", "ET")}
    metrics = run(cfg)
    assert {"val/dice", "val/dice_WT", "val/dice_TC", "val/dice_ET"} <= set(metrics)


@pytest.mark.parametrize(
    ("regions", "accepted"),
    [
        (None, True),  # not given: follows dataset.label_regions
        ("{WT:[1,2,3],TC:[1,3],ET:[3]}", True),  # given, and the same
        ("{WT:[3,2,1],TC:[3,1],ET:[3]}", True),  # the same sets
        ("{TC:[1,3],WT:[1,2,3],ET:[3]}", False),  # another channel order
        ("{WT:[1,2,3]}", False),
        ("null", False),  # classes: the three region channels would be read as one label map
    ],
)
def test_model_regions_that_disagree_with_the_datasets_channels_are_refused_before_anything_runs(tmp_path, regions, accepted):
    overrides = [*README_ROW, "dataset.root=/data", *([f"model.regions={regions}"] if regions else [])]
    cfg = compose_cfg(tmp_path, overrides, tiny=False)
    if accepted:
        check_label_regions(cfg)
        return
    with pytest.raises(MedvolError, match=r"`model.regions` is .*`dataset.label_regions=\[WT,TC,ET\]` gives one label channel"):
        check_label_regions(cfg)


def test_an_unknown_region_name_is_one_line(tmp_path):
    cfg = compose_cfg(tmp_path, ["model=segmentation", "dataset=brats", "dataset.root=/data", "dataset.label_regions=[WT,XX]"],
                      tiny=False)
    with pytest.raises(MedvolError, match="`dataset.label_regions`: unknown region 'XX'"):
        check_label_regions(cfg)
