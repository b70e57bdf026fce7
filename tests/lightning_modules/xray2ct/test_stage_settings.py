"""A stage's grids read from its settings, and the one-line refusals of settings no stage can be built from."""

from __future__ import annotations

import pytest

from lightning_modules.xray2ct.stage_settings import as_size, check_grids, check_stage, crop_of, window_of
from medvol.core.errors import MedvolError


def _refusal(check, *args) -> str:
    with pytest.raises(MedvolError) as caught:
        check(*args)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_size_is_three_ints_and_an_int_a_cube():
    assert as_size(12) == [12, 12, 12]
    assert as_size((8.0, 16, 32)) == [8, 16, 32]


def test_stage_one_trains_whole_and_a_later_stage_on_its_crop_capped_at_the_volume():
    assert crop_of({"stage": 1, "size": 16, "crop_size": 8}) == [16, 16, 16]
    # Stage 2 on a [16, 32, 48] grid with 24^3 crops: depth is capped at 16.
    assert crop_of({"stage": 2, "size": [16, 32, 48], "crop_size": 24}) == [16, 24, 24]
    assert crop_of({"stage": 2, "size": [16, 32, 48], "crop_size": None}) == [16, 32, 48]


def test_a_stage_samples_with_its_window_else_with_its_training_crop():
    assert window_of({"stage": 2, "size": 32, "crop_size": 16}) == [16, 16, 16]
    assert window_of({"stage": 2, "size": 32, "crop_size": 16, "sampling_window": [8, 32, 32]}) == [8, 32, 32]


def test_a_stage_below_one_is_refused():
    assert _refusal(check_stage, 0, [], None, 0.05) == "`model.stage` must be >= 1, got 0"


def test_a_new_stage_needs_one_checkpoint_for_each_stage_before_it():
    check_stage(3, ["one.ckpt", "two.ckpt"], None, 0.05)
    assert _refusal(check_stage, 3, ["one.ckpt"], None, 0.05) == (
        "`model.previous_stages` lists 1 checkpoint(s) for stage 3; expected the best checkpoints of stages 1..2 "
        "(run the cascade with `experiment=xray2ct_cascade`)"
    )


def test_a_restored_stage_counts_the_stages_its_checkpoint_recorded_not_the_files_its_run_read():
    # Restored (settings recorded): the checkpoints listed by the run are not read, so not counted either.
    check_stage(2, [], [{"stage": 1}], 0.05)
    assert _refusal(check_stage, 3, ["one.ckpt", "two.ckpt"], [{"stage": 1}], 0.05) == (
        "`model.previous_settings` holds 1 earlier stage(s) for stage 3; expected 2, as a stage's checkpoint "
        "records them"
    )


@pytest.mark.parametrize("noise", [-0.1, float("nan")])
def test_a_hand_off_noise_that_is_no_std_is_refused(noise):
    assert _refusal(check_stage, 1, [], None, noise) == (
        f"`model.previous_sampling_noise` must be a std >= 0, got {noise}"
    )
    check_stage(1, [], None, 0.0)


def test_grids_the_network_divides_are_accepted():
    check_grids({"stage": 2, "size": [16, 32, 32], "crop_size": 16, "sampling_window": [16, 16, 32]}, 8)
    # Stage 1 trains whole: its crop setting is not its crop.
    check_grids({"stage": 1, "size": 16, "crop_size": 12}, 8)


def test_a_volume_the_network_does_not_divide_is_refused():
    assert _refusal(check_grids, {"stage": 1, "size": [16, 12, 16]}, 8) == (
        "stage 1 volume size [16, 12, 16] must divide by the network's downsampling 8 "
        "(2 ** (len(model.channels) - 1)); change the stage's size"
    )


@pytest.mark.parametrize("crop", [[8, 8], 0, [8, -8, 8]])
def test_a_crop_that_is_no_three_positive_sizes_is_refused(crop):
    assert _refusal(check_grids, {"stage": 2, "size": 16, "crop_size": crop}, 2) == (
        f"`model.crop_size`: got {crop!r}; expected a crop size [D, H, W] of positive ints or null"
    )


def test_a_training_crop_the_network_does_not_divide_is_refused():
    assert _refusal(check_grids, {"stage": 2, "size": 16, "crop_size": 12}, 8) == (
        "stage 2: the training crop [12, 12, 12] (`model.crop_size` within the volume [16, 16, 16]) must divide "
        "by the network's downsampling 8; change `model.crop_size`"
    )


@pytest.mark.parametrize("window", [[4, 8, 8], [8, 8, 24]])
def test_a_sampling_window_the_network_does_not_divide_or_larger_than_the_volume_is_refused(window):
    settings = {"stage": 2, "size": 16, "crop_size": 8, "sampling_window": window}
    assert _refusal(check_grids, settings, 8) == (
        f"stage 2: `model.sampling_window` {window} must divide by the network's downsampling 8 and fit in the "
        "stage's volume [16, 16, 16]"
    )
