"""`dataset.label_regions` is the one source of the segmentation model's regions: the README's BraTS row trains."""

from __future__ import annotations

import pytest
import torch

from datamodules.sources.brats import REGIONS, BratsLabelsd
from datamodules.sources.example_data import write_brats
from medvol.core.build import build_model
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
def test_model_regions_that_disagree_with_the_datasets_channels_are_refused_before_anything_runs(tmp_path, regions,
                                                                                                 accepted):
    overrides = [*README_ROW, "dataset.root=/data", *([f"model.regions={regions}"] if regions else [])]
    cfg = compose_cfg(tmp_path, overrides, tiny=False)
    if accepted:
        check_label_regions(cfg)
        return
    with pytest.raises(MedvolError,
                       match=r"`model.regions` is .*`dataset.label_regions=\[WT,TC,ET\]` gives one label channel"):
        check_label_regions(cfg)


def test_an_unknown_region_name_is_one_line(tmp_path):
    cfg = compose_cfg(tmp_path,
                      ["model=segmentation", "dataset=brats", "dataset.root=/data", "dataset.label_regions=[WT,XX]"],
                      tiny=False)
    with pytest.raises(MedvolError, match="`dataset.label_regions`: unknown region 'XX'"):
        check_label_regions(cfg)


SUBSETS = [["WT"], ["TC"], ["ET"], ["WT", "TC"], ["WT", "ET"], ["TC", "ET"], ["WT", "TC", "ET"]]


@pytest.mark.parametrize("names", SUBSETS, ids=["+".join(n) for n in SUBSETS])
def test_every_subset_of_the_brats_regions_builds_and_its_masks_come_back_from_the_written_label_map(tmp_path, names):
    cfg = compose_cfg(tmp_path, [*README_ROW[:2], "dataset.root=/data", f"dataset.label_regions=[{','.join(names)}]"],
                      tiny=False)
    check_label_regions(cfg)
    module = build_model(cfg.model)
    # Every unified BraTS value once; the dataset's own region channels for it.
    label = torch.arange(4).view(1, 4, 1, 1)
    regions = BratsLabelsd("label", 2023, names)({"label": label})["label"][None].to(torch.uint8)
    assert regions.shape[1] == len(names) == module.scheme.out_channels
    written = module.scheme.label_map(regions)
    assert torch.equal(module.scheme.target(written), regions)
    expected = torch.stack([torch.isin(written[:, 0], torch.tensor(REGIONS[n])) for n in names], 1)
    assert torch.equal(expected.to(torch.uint8), regions)


def test_a_tumour_core_model_alone_trains_and_scores_tc(tmp_path):
    root = write_brats(tmp_path / "brats", subjects=4, year=2021, size=16)
    cfg = compose_cfg(tmp_path / "run", [
        "model=segmentation", "dataset=brats", "dataset.label_regions=[TC]", f"dataset.root={root}", *TINY_FILES,
        "model.plan.base_features=4", "dataset.val_fraction=0.25", "dataset.test_fraction=0.25",
        "dataset.num_workers=0",
    ], tiny=False)
    metrics = run(cfg)
    assert {"val/dice", "val/dice_TC"} <= set(metrics) and "val/dice_WT" not in metrics
