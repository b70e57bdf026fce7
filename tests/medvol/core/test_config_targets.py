"""A config read from a run folder builds only medvol's classes and its libraries' networks, optimizers, ..."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from medvol.core.config_targets import check_file_targets, file_targets, target_problem
from medvol.core.errors import MedvolError
from tests.conftest import CONF_DIR, compose_cfg


@pytest.mark.parametrize("target", [
    "lightning_modules.segmentation.segmentation.Segmenter",
    "datamodules.sources.nifti.NiftiDataModule",
    "callbacks.rng_state.RNGState",
    "torch.optim.Adam",
    "torch.optim.lr_scheduler.PolynomialLR",
    "monai.networks.nets.DiffusionModelUNet",
    "pytorch_lightning.strategies.DDPStrategy",
    "pytorch_lightning.loggers.WandbLogger",
    "pytorch_lightning.Trainer",
])
def test_the_classes_medvol_builds_may_come_from_a_file(target):
    assert target_problem(target) is None


@pytest.mark.parametrize(("target", "problem"), [
    ("os.system", "lies outside"),
    ("subprocess.Popen", "lies outside"),
    ("builtins.eval", "lies outside"),
    ("torch.hub.load", "is no class"),
    ("torch.load", "is no class"),
    ("torch.utils.cpp_extension.load_inline", "is no class"),
    ("monai.bundle.ConfigParser", "is not a class medvol builds"),
    ("torch.Tensor", "is not a class medvol builds"),
    ("medvol.core.build.build", "is no class"),
    ("torch.no_such_thing.Nope", "names nothing importable"),
    ("${oc.env:TARGET}", "is an interpolation"),
])
def test_a_callable_elsewhere_is_refused_for_what_it_is(target, problem):
    assert problem in target_problem(target)


def test_every_target_of_every_shipped_config_group_passes(tmp_path):
    for model in sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")):
        cfg = compose_cfg(tmp_path, [f"model={model}"], tiny=False)
        with open_dict(cfg):
            cfg.pop("hydra")  # as train.py saves .hydra/config.yaml
        check_file_targets(cfg, tmp_path / "config.yaml")
        assert any(key == "model" for key, _ in file_targets(OmegaConf.to_container(cfg, resolve=False)))


def test_a_run_config_with_a_shell_call_is_refused_naming_the_key_and_the_file(tmp_path):
    cfg = OmegaConf.create({"model": {"_target_": "lightning_modules.vqgan.vqgan.VQGAN",
                                      "optimizer": {"_target_": "torch.optim.Adam", "_partial_": True}},
                            "callbacks": {"x": {"_target_": "os.system", "command": "touch ran"}}})
    source = Path(tmp_path / ".hydra" / "config.yaml")
    with pytest.raises(MedvolError) as err:
        check_file_targets(cfg, source)
    assert str(err.value).startswith(f"`callbacks.x._target_: os.system` in {source} lies outside")
    assert not (tmp_path / "ran").exists()


def test_targets_inside_lists_are_found_with_their_index():
    tree = {"a": [{"b": {"_target_": "torch.nn.ReLU"}}, 3], "_target_": "torch.nn.Identity"}
    assert sorted(file_targets(tree)) == [("<root>", "torch.nn.Identity"), ("a[0].b", "torch.nn.ReLU")]


@pytest.mark.parametrize("node", [
    {"_target_": "torch.optim.Adam", "_partial_": True, "params": {"_target_": "torch.nn.Identity"}},
    {"_target_": "torch.nn.Sequential", "_args_": [{"_target_": "torch.nn.ReLU"}]},
])
def test_a_partial_holding_another_target_is_refused_from_a_file(tmp_path, node):
    # Each target alone is allowed; bound together they make a callable out of a built object.
    with pytest.raises(MedvolError, match=r"^`model\.optimizer` in .* is a partial .* holding another `_target_`"):
        check_file_targets({"model": {"optimizer": node}}, tmp_path / "run.json")
    check_file_targets({"model": {"optimizer": {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 1e-3}}},
                       tmp_path / "run.json")
