"""export.py's default format needs nothing beyond the base install (issue 63 item 12)."""

from __future__ import annotations

import importlib.util

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from medvol.run.exporting import check_exporter
from medvol.volumes.prediction_writer import PredictionWriter, mask_dtype
from tests.conftest import CONF_DIR

OPTIONAL = ("onnx", "onnxruntime", "onnxscript")


def test_the_default_format_is_written_without_the_export_extra(monkeypatch):
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="export"):
        cfg = compose(config_name="export", overrides=["output_dir=x"])
    GlobalHydra.instance().clear()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in OPTIONAL else real(name, *a))
    assert cfg.format == "torchscript"
    check_exporter(str(cfg.format))


def test_label_maps_are_written_as_nnunets_masks_and_named_as_nnunet_names_them(tmp_path):
    assert (mask_dtype(0), mask_dtype(255), mask_dtype(256), mask_dtype(65535)) == (np.uint8, np.uint8, np.uint16,
                                                                                    np.uint16)
    import nibabel as nib

    batch = {"subject": ["case"], "affine": torch.eye(4, dtype=torch.float64)[None]}
    label_map = torch.zeros(1, 1, 4, 4, 4, dtype=torch.int64)
    label_map[0, 0, 1:3, 1:3, 1:3] = 2
    for nnunet, name in ((False, "case_seg.nii.gz"), (True, "case.nii.gz")):
        out = tmp_path / str(nnunet)
        PredictionWriter(out, nnunet_names=nnunet).write({"volumes": {"seg": label_map}}, batch)
        assert sorted(p.name for p in out.iterdir()) == [name]
        written = nib.load(str(out / name))
        assert written.get_data_dtype() == np.uint8 and np.array_equal(np.asarray(written.dataobj), label_map[0, 0])
    # A label value past 255 (a segments record naming it): uint16 for every subject, as nnU-Net's.
    PredictionWriter(tmp_path / "wide").write({"volumes": {"seg": label_map}, "segments": {"big": [300]}}, batch)
    assert nib.load(str(tmp_path / "wide" / "case_seg.nii.gz")).get_data_dtype() == np.uint16
