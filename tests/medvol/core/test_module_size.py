"""Networks sized before they are built: shapes from the meta device, compared with a state dict and the budget,
without drawing a random number (a genuine checkpoint loads exactly as before)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from lightning_modules.vqgan.vqgan import VQGAN
from medvol.core.build import build_model
from medvol.core.errors import MedvolError
from medvol.core.module_size import Mismatch, check_module_bytes, first_mismatch, load_weights, on_meta
from medvol.volumes.volume_budget import BUDGET_ENV, GIB
from tests.conftest import TINY_MODEL, compose_cfg
from tests.lightning_modules.ldm.test_ldm import vqgan_ckpt  # noqa: F401 - a fixture


def test_a_meta_build_has_every_shape_allocates_nothing_and_draws_no_random_number():
    states = (torch.random.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    meta = on_meta(lambda: VQGAN(n_codes=2**28, embedding_dim=8), "settings")
    assert torch.equal(torch.random.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1]) and random.getstate() == states[2]
    assert all(t.is_meta for t in meta.state_dict().values())
    assert meta.codebook.embeddings.shape == (2**28, 8)
    # What the real build makes, shape for shape (a small one).
    real, small = VQGAN(n_codes=16, embedding_dim=4), on_meta(lambda: VQGAN(n_codes=16, embedding_dim=4), "")
    assert {k: v.shape for k, v in real.state_dict().items()} == {k: v.shape for k, v in small.state_dict().items()}


def test_the_first_mismatch_is_a_shape_then_the_first_missing_weight_by_name():
    module = on_meta(lambda: nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 4)), "")
    weights = {k: torch.zeros(v.shape) for k, v in module.state_dict().items()}
    assert first_mismatch(module, weights) is None
    assert first_mismatch(module, {**weights, "1.weight": torch.zeros(5, 3)}) == Mismatch("1.weight", (5, 3), (4, 3))
    assert first_mismatch(module, {**weights, "0.bias": "not a tensor"}) == Mismatch("0.bias", (), (3,))
    partial = {k: v for k, v in weights.items() if k.startswith("0.")}
    assert first_mismatch(module, partial) == Mismatch("1.bias", None, (4,))


def test_a_network_larger_than_the_budget_is_refused_from_its_shapes(monkeypatch):
    module = on_meta(lambda: nn.Linear(1024, 1024), "")
    size = (1024 * 1024 + 1024) * 4
    monkeypatch.setenv(BUDGET_ENV, str(size / GIB))
    check_module_bytes(module, "x.ckpt")
    monkeypatch.setenv(BUDGET_ENV, str((size - 1) / GIB))
    with pytest.raises(MedvolError, match=r"^x\.ckpt: the network its settings build holds 0\.00391 GiB of weights"):
        check_module_bytes(module, "x.ckpt")


def test_settings_that_build_no_network_are_refused_naming_the_file():
    with pytest.raises(MedvolError, match=r"^x\.ckpt: its settings do not build the network \(TypeError: "):
        on_meta(lambda: nn.Linear("many", 3), "x.ckpt")
    with pytest.raises(MedvolError, match=r"^x\.ckpt: its settings do not build the network \(ValueError: `n_codes`"):
        on_meta(lambda: VQGAN(n_codes=1), "x.ckpt")

    def refused() -> nn.Module:
        raise MedvolError("`model.num_classes` is 10; at most 4")

    # A setting the network refuses itself: its line, naming the file the setting came from.
    with pytest.raises(MedvolError, match=r"^x\.ckpt: `model\.num_classes` is 10; at most 4$"):
        on_meta(refused, "x.ckpt")


@pytest.mark.parametrize("overrides", [
    ["model=vqgan"],
    ["model=segmentation", "model.num_classes=3", "model.net=dynunet", "model.features=[4,8,8]",
     "model.kernels=[[3,3,3],[3,3,3],[3,3,1]]", "model.strides=[[1,1,1],[2,2,2],[2,2,1]]", "model.patch_size=[8,8,4]"],
    ["model=segmentation", "model.regions={WT:[1,2,3],TC:[1,3],ET:[3]}", "model.num_classes=null"],
    ["model=survival"], ["model=classifier"], ["model=ddpm"], ["model=xray2ct"],
], ids=lambda overrides: "-".join(o.split("=", 1)[1] for o in overrides[:2]))
def test_every_familys_genuine_network_builds_on_the_meta_device_with_the_real_builds_shapes(tmp_path, overrides):
    model = compose_cfg(tmp_path, overrides).model
    meta = on_meta(lambda: build_model(model), "genuine")
    real = build_model(model)
    assert {k: tuple(v.shape) for k, v in meta.state_dict().items()} == {
        k: tuple(v.shape) for k, v in real.state_dict().items()}
    assert first_mismatch(meta, real.state_dict()) is None


def test_a_latent_models_network_builds_on_the_meta_device_from_its_first_stage(tmp_path, vqgan_ckpt):  # noqa: F811
    model = compose_cfg(tmp_path, ["model=ldm", f"model.first_stage_ckpt={vqgan_ckpt}", *TINY_MODEL["ldm"]]).model
    meta, real = on_meta(lambda: build_model(model), "genuine"), build_model(model)
    assert first_mismatch(meta, real.state_dict()) is None


def test_loading_weights_on_the_meta_device_compares_the_keys_as_load_state_dict_does_and_copies_nothing():
    weights = nn.Linear(3, 2).state_dict()
    real = nn.Linear(3, 2)
    with torch.device("meta"):
        meta = nn.Linear(3, 2)
    for module in (real, meta):
        assert load_weights(module, weights) is not None
        extra = {**weights, "other": torch.zeros(1)}
        assert load_weights(module, extra, strict=False).unexpected_keys == ["other"]
        assert load_weights(module, {"weight": weights["weight"]}, strict=False).missing_keys == ["bias"]
        with pytest.raises(RuntimeError, match="bias"):
            load_weights(module, {"weight": weights["weight"]})
    assert torch.equal(real.weight, weights["weight"]) and meta.weight.is_meta
