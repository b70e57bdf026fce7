"""The bundle and predict.py write one mask type, nnU-Net's, and the bundle's README gives its channel order and the
label values it writes (issue 63 item 12)."""

from __future__ import annotations

import json

import nibabel as nib

from tests.medvol.run.test_bundle import (  # noqa: F401 - module fixtures: the tiny BraTS-region model, its bundle
    predicted,
    run_in_process,
    segmentation_bundle,
    segmentation_run,
)


def test_predict_and_the_bundle_write_uint8_masks_and_the_readme_gives_channels_and_labels(
    segmentation_run, segmentation_bundle, tmp_path  # noqa: F811
):
    ckpt, scans = segmentation_run
    for folder in (predicted(ckpt, scans, tmp_path / "predict"),
                   run_in_process(segmentation_bundle, scans, tmp_path / "bundle")):
        masks = sorted(folder.glob("*_seg.nii.gz"))
        assert masks and {nib.load(str(path)).get_data_dtype().name for path in masks} == {"uint8"}, folder.name
    metadata = json.loads((segmentation_bundle / "configs" / "metadata.json").read_text())
    assert metadata["medvol"]["output_file"]["dtype"] == "uint8"
    readme = (segmentation_bundle / "README.md").read_text()
    assert "## Channels\n\nIn this order, 1 channel(s)" in readme and ": 0: flair." in readme
    assert "- `WT`: [1, 2, 4]" in readme and "(label map, uint8)" in readme
