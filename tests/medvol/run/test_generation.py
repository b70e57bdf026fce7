"""Condition-only generation's helpers (medvol/run/generation.py): a dataset config without targets, the refusals of
inputs the model cannot take (headers only), the targets' units, and N seeded draws with their voxel-wise mean and
sample standard deviation, against numpy and hand-worked values."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from medvol.core.errors import MedvolError
from medvol.run.generation import (
    check_condition_files,
    check_input_channels,
    check_refinable,
    file_channels,
    intensity_record,
    lacks_targets,
    modality_field,
    on_model_grid,
    sampled_outputs,
    with_target_units,
    without_targets,
)

# As `VolumeDataModule.fingerprint` records it: per `image` channel, the raw values mapped onto the ends of `range`.
TARGET_UNITS = {"low": [-1000.0], "high": [1000.0], "range": [-1.0, 1.0]}


def _nifti(path: Path, shape: tuple[int, ...], affine: np.ndarray | None = None) -> str:
    nib.save(nib.Nifti1Image(np.zeros(shape, dtype=np.float32), np.eye(4) if affine is None else affine), path)
    return str(path)


def test_only_the_cond_key_is_read_from_files_and_another_is_one_line():
    assert modality_field("cond") == "cond_modalities"
    with pytest.raises(MedvolError, match=r"batch key `xray`, which predict.py cannot read from files yet"):
        modality_field("xray")


def test_a_config_without_targets_lists_only_the_conditions_and_leaves_the_given_config_as_written():
    written = OmegaConf.create({"root": "/data", "image_modalities": ["t2"], "cond_modalities": ["t1"], "label": True,
                                "label_file": "seg.nii.gz"})
    config = without_targets(written, {"cond": 1})
    assert OmegaConf.to_container(config) == {"root": "/data", "image_modalities": [], "cond_modalities": ["t1"],
                                              "label": False, "label_file": None}
    assert written.image_modalities == ["t2"] and written.label is True


def test_a_config_without_targets_or_condition_modalities_is_refused():
    with pytest.raises(MedvolError, match=r"lists no `dataset.cond_modalities`"):
        without_targets(OmegaConf.create({"image_modalities": ["t2"], "cond_modalities": []}), {"cond": 1})


def test_a_subject_lacks_targets_when_some_target_modality_has_no_file():
    assert not lacks_targets([{"image": ["a_t2.nii.gz"]}, {"image": ["b_t2.nii.gz"]}])
    assert lacks_targets([{"image": ["a_t2.nii.gz"]}, {"image": ["b_t2.nii.gz", None]}])


def test_every_subject_needs_every_condition_file():
    config = OmegaConf.create({"root": "/data", "cond_modalities": ["t1", "flair"]})
    check_condition_files([{"subject": "a", "files": {"t1": "a_t1", "flair": "a_flair"}}], config, {"cond": 2})
    with pytest.raises(MedvolError, match=r"subject b has no 'flair' file"):
        check_condition_files([{"subject": "b", "files": {"t1": "b_t1", "flair": None}}], config, {"cond": 2})
    with pytest.raises(MedvolError, match=r"/data holds none of the condition files \(t1, flair\)"):
        check_condition_files([], config, {"cond": 2})


def test_channels_are_the_product_of_the_axes_past_the_third_and_a_series_folder_is_one(tmp_path):
    assert file_channels(_nifti(tmp_path / "three.nii.gz", (4, 4, 4))) == 1
    assert file_channels(_nifti(tmp_path / "four.nii.gz", (4, 4, 4, 3))) == 3
    assert file_channels(_nifti(tmp_path / "five.nii.gz", (4, 4, 4, 1, 2))) == 2
    assert file_channels(str(tmp_path)) == 1


def test_input_channels_are_summed_over_a_subjects_files_and_another_count_is_refused(tmp_path):
    files = [_nifti(tmp_path / "t1.nii.gz", (4, 4, 4)), _nifti(tmp_path / "dwi.nii.gz", (4, 4, 4, 3))]
    records = [{"subject": "a", "cond": files}, {"subject": "synthetic", "cond": None}]
    check_input_channels(records, {"cond": 4}, "input")
    with pytest.raises(MedvolError, match=r"`input`: subject a has 4 condition channels .* trained on 2"):
        check_input_channels(records, {"cond": 2}, "input")


def test_a_super_resolution_input_must_be_coarser_than_the_training_spacing_along_some_axis(tmp_path):
    geometry = {"spacing": [1.0, 1.0, 1.0], "orientation": None}

    def refinable(*zooms: float) -> None:
        path = _nifti(tmp_path / f"{'x'.join(map(str, zooms))}.nii.gz", (4, 4, 4), np.diag([*zooms, 1.0]))
        check_refinable([{"cond": [path]}], "cond", geometry, "input")

    refinable(1.0, 1.0, 2.0)
    refinable(1.0, 1.0, 1.002)  # 0.2 % coarser: beyond the 0.1 % tolerance
    with pytest.raises(MedvolError, match=r"1x1x1.0005 mm voxels, already at or finer than the training spacing 1x1x1"):
        refinable(1.0, 1.0, 1.0005)
    with pytest.raises(MedvolError, match=r"`spacing`: a super-resolution model"):
        check_refinable([], "cond", {"spacing": None}, "input")


def test_the_inputs_spacing_is_compared_on_the_training_orientations_axes(tmp_path):
    # Stored with 3 mm along its first axis, which runs superior-inferior: in RAS the voxels are 1 x 1 x 3 mm.
    stored = np.array([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    path = _nifti(tmp_path / "turned.nii.gz", (4, 4, 4), stored)
    with pytest.raises(MedvolError, match="nothing to super-resolve"):
        check_refinable([{"cond": [path]}], "cond", {"spacing": [1.0, 1.0, 3.0], "orientation": "RAS"}, "input")


def test_a_batch_without_a_scaling_record_takes_the_training_targets_units_per_subject():
    batch = with_target_units({"subject": ["a", "b"]}, TARGET_UNITS)
    torch.testing.assert_close(batch["intensity_low"], torch.tensor([[-1000.0], [-1000.0]], dtype=torch.float64))
    torch.testing.assert_close(batch["intensity_high"], torch.tensor([[1000.0], [1000.0]], dtype=torch.float64))
    torch.testing.assert_close(batch["intensity_range"], torch.tensor([[-1.0, 1.0]] * 2, dtype=torch.float64))


def test_a_batch_keeps_its_own_scaling_record_and_no_record_writes_model_units():
    own = {"subject": ["a"], "intensity_low": torch.tensor([0.0]), "intensity_high": torch.tensor([1.0])}
    assert with_target_units(own, TARGET_UNITS) is own
    assert with_target_units({"subject": ["a"]}, None) == {"subject": ["a"]}
    ranged = with_target_units({"subject": ["a"], "intensity_range": torch.tensor([[0.0, 1.0]])}, TARGET_UNITS)
    torch.testing.assert_close(ranged["intensity_range"], torch.tensor([[0.0, 1.0]]))
    assert intensity_record(SimpleNamespace(training_data=None)) is None
    assert intensity_record(SimpleNamespace(training_data={"intensity": TARGET_UNITS})) == TARGET_UNITS


def test_an_output_on_the_model_grid_drops_only_the_source_grid_keys():
    batch = {"subject": ["a"], "cond": 1, "source_affine": 2, "source_shape": 3, "source_file": 4}
    assert on_model_grid(batch) == {"subject": ["a"], "cond": 1}


class DrawRecorder:
    """Draw k of every subject is a ramp plus k squared, in HU; it records the draws it was asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def generate_volumes(self, batch: dict[str, Any], draw: int) -> dict[str, Any]:
        self.asked.append(draw)
        volume = torch.arange(8.0).reshape(1, 1, 2, 2, 2) + draw**2
        return {"volumes": {"ct": volume}, "units": {"ct": "hu"}, "spreads": [], "subject": ["a"]}


def test_n_draws_are_written_with_their_voxelwise_mean_and_sample_standard_deviation():
    module = DrawRecorder()
    outputs = sampled_outputs(module, {"subject": ["a"]}, 3)
    ramp = np.arange(8.0).reshape(1, 1, 2, 2, 2)
    draws = np.stack([ramp + 0, ramp + 1, ramp + 4])
    assert module.asked == [0, 1, 2]
    assert sorted(outputs["volumes"]) == ["ct_0", "ct_1", "ct_2", "ct_mean", "ct_std"]
    for k in range(3):
        np.testing.assert_allclose(outputs["volumes"][f"ct_{k}"].numpy(), draws[k])
    np.testing.assert_allclose(outputs["volumes"]["ct_mean"].numpy(), ramp + 5 / 3, rtol=1e-6)
    # The spread of (0, 1, 4) with n - 1 = 2 degrees of freedom: sqrt(78 / 9 / 2) = sqrt(13 / 3) everywhere.
    np.testing.assert_allclose(outputs["volumes"]["ct_std"].numpy(), np.std(draws, axis=0, ddof=1), rtol=1e-6)
    np.testing.assert_allclose(outputs["volumes"]["ct_std"].numpy(), np.full_like(ramp, np.sqrt(13 / 3)), rtol=1e-6)
    assert outputs["units"] == dict.fromkeys(outputs["volumes"], "hu")
    assert outputs["spreads"] == ["ct_std"] and outputs["subject"] == ["a"]


def test_a_given_first_draw_is_draw_zero_and_one_sample_is_that_draw_as_it_is():
    module = DrawRecorder()
    first = DrawRecorder().generate_volumes({}, 0)
    first["volumes"]["ct"] = first["volumes"]["ct"] + 100.0  # not what generate_volumes gives, so it shows if used
    outputs = sampled_outputs(module, {"subject": ["a"]}, 2, first=first)
    assert module.asked == [1]
    np.testing.assert_allclose(outputs["volumes"]["ct_0"].numpy(), first["volumes"]["ct"].numpy())
    single = DrawRecorder()
    assert sampled_outputs(single, {"subject": ["a"]}, 1)["volumes"].keys() == {"ct"} and single.asked == [0]
