"""Earlier stages read from their checkpoints or rebuilt from recorded settings, checked against the stage that
holds them, and a stage started from the weights of the one before it."""

from __future__ import annotations

import logging

import pytest
import torch
from omegaconf import OmegaConf

from lightning_modules.xray2ct.denoiser import CONDITION_CHANNELS, ViewConditionedDenoiser, network_settings
from lightning_modules.xray2ct.earlier_stages import (
    check_same_radiographs,
    read_stage,
    read_stages,
    rebuilt_stages,
    sampling_weights,
    start_from_stage,
)
from medvol.core.errors import MedvolError

STAGE_ONE = {
    "stage": 1, "views": ["ap", "lateral"], "xray_size": [16, 16], "channels": [8, 16],
    "attention_levels": [False, True], "num_head_channels": 8, "encoder_channels": [8, 16], "token_dim": 16,
}


def _random_weights(seed: int) -> dict[str, torch.Tensor]:
    """A stage-one network's state dict with every tensor drawn at random."""
    torch.manual_seed(seed)
    network = ViewConditionedDenoiser(**network_settings(STAGE_ONE))
    return {k: torch.randn_like(v) for k, v in network.state_dict().items()}


def _save(path, state_dict: dict[str, torch.Tensor], hparams: dict | None = None) -> str:
    torch.save({"hyper_parameters": STAGE_ONE if hparams is None else hparams, "state_dict": state_dict}, path)
    return str(path)


def _prefixed(prefix: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in weights.items()}


def _refusal(check, *args) -> str:
    with pytest.raises(MedvolError) as caught:
        check(*args)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_stage_samples_with_its_ema_weights_and_without_them_with_its_trained_ones():
    ema, raw, other = torch.ones(2), torch.zeros(2), torch.full((2,), 5.0)
    both = {"ema.module.w": ema, "network.w": raw, "physics.w": other}
    assert sampling_weights(both) == {"w": ema}
    assert sampling_weights({"network.w": raw, "physics.w": other}) == {"w": raw}


def test_a_stage_with_ema_hands_off_its_ema_network_frozen(tmp_path):
    ema, raw = _random_weights(1), _random_weights(2)
    path = _save(tmp_path / "stage1.ckpt", {**_prefixed("ema.module.", ema), **_prefixed("network.", raw)})
    settings, network = read_stage(path)
    assert settings == STAGE_ONE
    assert not network.training and not any(p.requires_grad for p in network.parameters())
    for name, tensor in network.state_dict().items():
        assert torch.equal(tensor, ema[name]), name


def test_a_stage_without_ema_hands_off_its_raw_weights(tmp_path):
    raw = _random_weights(3)
    [(settings, network, source)] = read_stages([_save(tmp_path / "stage1.ckpt", _prefixed("network.", raw))])
    assert source == str(tmp_path / "stage1.ckpt")
    for name, tensor in network.state_dict().items():
        assert torch.equal(tensor, raw[name]), name


def test_a_missing_checkpoint_is_refused_naming_the_file(tmp_path):
    missing = str(tmp_path / "stage1" / "best.ckpt")
    assert _refusal(read_stage, missing) == (
        f"`model.previous_stages`: {missing} does not exist; expected a finished stage's best.ckpt"
    )


@pytest.mark.parametrize("hparams", [{"n_codes": 512}, {"stage": 1, "size": 16}])
def test_a_checkpoint_of_another_model_is_refused(tmp_path, hparams):
    # A VQ-GAN's, and a staged model's without radiograph views.
    path = _save(tmp_path / "other.ckpt", {}, hparams)
    assert _refusal(read_stage, path) == f"`model.previous_stages`: {path} is not an X-ray-to-CT stage checkpoint"


def test_a_checkpoint_whose_weights_are_not_its_settings_network_is_refused(tmp_path):
    path = _save(tmp_path / "stage1.ckpt", _prefixed("network.", _random_weights(4)), {**STAGE_ONE, "token_dim": 32})
    assert _refusal(read_stage, path) == (
        f"`model.previous_stages`: {path} does not hold the network its settings describe (stage 1: neither EMA "
        "weights `ema.module.*` nor raw weights `network.*` fit); expected a finished stage's best.ckpt"
    )


def test_recorded_stages_are_rebuilt_as_plain_settings_and_frozen_networks_from_this_checkpoint():
    recorded = OmegaConf.create([STAGE_ONE, {**STAGE_ONE, "stage": 2}])
    stages = rebuilt_stages(recorded)
    assert [settings for settings, _, _ in stages] == [STAGE_ONE, {**STAGE_ONE, "stage": 2}]
    assert all(type(settings) is dict and type(settings["views"]) is list for settings, _, _ in stages)
    assert [source for _, _, source in stages] == ["this checkpoint"] * 2
    # Stage 2 takes the previous stage and the three coordinates before x_t.
    assert [network.unet.conv_in.conv.in_channels for _, network, _ in stages] == [1, 5]
    for _, network, _ in stages:
        assert not network.training and not any(p.requires_grad for p in network.parameters())


SHARED = {**STAGE_ONE, "window": [-1000.0, 1000.0], "mu_water": 0.02, "field_of_view": [192.0, 192.0, 192.0]}


@pytest.mark.parametrize(("key", "other"), [
    ("views", ["ap"]), ("xray_size", [32, 32]), ("window", [-1024.0, 3071.0]), ("mu_water", 0.03),
    ("field_of_view", [192.0, 192.0, 240.0]),
])
def test_an_earlier_stage_that_saw_other_radiographs_is_refused_naming_the_setting(key, other):
    check_same_radiographs({**SHARED, "stage": 2}, SHARED, "stage1.ckpt")
    assert _refusal(check_same_radiographs, {**SHARED, "stage": 2, key: other}, SHARED, "stage1.ckpt") == (
        f"`model.{key}` {other} differs from the {key} {SHARED[key]} of stage 1 (stage1.ckpt); every stage of a "
        "cascade sees the same radiographs (views, xray_size, field_of_view) in the same units (window, mu_water)"
    )
    # A stage saved before it recorded the setting is not compared on it.
    check_same_radiographs({**SHARED, key: other}, {k: v for k, v in SHARED.items() if k != key}, "old.ckpt")


def test_stage_two_starts_from_stage_one_with_its_condition_channels_at_zero(tmp_path, caplog):
    raw = _random_weights(5)
    path = _save(tmp_path / "stage1.ckpt", _prefixed("network.", raw))
    network = ViewConditionedDenoiser(**network_settings({**STAGE_ONE, "stage": 2}))
    with caplog.at_level(logging.INFO, logger="medvol"):
        start_from_stage(network, path, 2)
    first = "unet.conv_in.conv.weight"
    for name, tensor in network.state_dict().items():
        if name != first:
            assert torch.equal(tensor, raw[name]), name
    weight = network.state_dict()[first]
    # Inputs are [previous, z, y, x, x_t]: x_t's filters are stage one's, the condition's start at zero.
    assert weight.shape[1] == 1 + CONDITION_CHANNELS
    assert torch.equal(weight[:, -1:], raw[first])
    assert not weight[:, :-1].any()
    assert f"stage 2 starts from {path} (0 tensors not carried over)" in caplog.messages


def test_an_earlier_stage_checkpoint_with_other_radiographs_is_refused_before_anything_is_built(tmp_path):
    from medvol.run.training import check_config
    from tests.conftest import TINY_MODEL, compose_cfg

    stage_one = _save(tmp_path / "stage1.ckpt", _prefixed("network.", _random_weights(0)))
    cfg = compose_cfg(tmp_path / "run", ["model=xray2ct", *TINY_MODEL["xray2ct"], "dataset.xray_size=[24,24]",
                                         "model.stage=2", f"model.previous_stages=[{stage_one}]"])
    with pytest.raises(MedvolError, match=r"`model.xray_size` \[24, 24\] differs from the xray_size \[16, 16\] of "
                                          r"stage 1 \(.*stage1.ckpt\)"):
        check_config(cfg)


@pytest.mark.parametrize(("override", "refusal"), [
    ("+cascade.stage3.dataset.mu_water=0.03", r"`cascade.stage3.model.mu_water` 0.03 differs from the mu_water 0.02"),
    # 32 voxels of 7 mm: 224 mm where stage 1's 16 voxels of 12 mm span 192 (the field of view, size x spacing).
    ("cascade.stage3.dataset.spacing=7.0", r"`cascade.stage3.model.field_of_view` \[224.0, 224.0, 224.0\] differs "
                                           r"from the field_of_view \[192.0, 192.0, 192.0\]"),
])
def test_a_cascade_whose_stages_see_other_radiographs_stops_before_its_first_stage(tmp_path, override, refusal):
    from medvol.run.training import run
    from tests.conftest import compose_cfg

    cfg = compose_cfg(tmp_path, ["experiment=xray2ct_cascade", override], tiny=False)
    with pytest.raises(MedvolError, match=refusal + r" of stage 1 \(cascade.stage1\)"):
        run(cfg)
    assert not (tmp_path / "stage1").exists()
