"""Shared test helpers: compose the real config in-process, pointed at tmp_path, on the CPU, tiny."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

import medvol.run.resolvers  # noqa: F401 - registers resolvers used by the configs

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"

# Small, fast settings shared by tests: a 16^3 volume, no rich widgets, one epoch.
TINY_COMMON = [
    "hardware=cpu",
    "callbacks.progress_bar=null",
    "callbacks.model_summary=null",
    "dataset.num_subjects=8",
    "dataset.size=16",
    "dataset.batch_size=2",
    "trainer.max_epochs=1",
    "trainer.log_every_n_steps=1",
    "trainer.num_sanity_val_steps=0",
]
# Per model family: the overrides that make its network tiny (keys of that family's model config).
TINY_MODEL: dict[str, list[str]] = {
    "vqgan": [
        "model.n_hiddens=8",
        "model.n_codes=32",
        "model.disc_channels=8",
        "model.disc_layers=2",
        "model.ssim_kernel_size=5",
        "model.discriminator_iter_start=2",
    ],
    "survival": ["model.backbone=resnet10", "model.widen_factor=0.125"],
    "classifier": ["model.backbone=resnet10", "model.widen_factor=0.125"],
    # A planned run's epoch is 250 batches (nnU-Net's); two are enough here.
    "segmentation": ["model.features=[4,8]", "model.patch_size=[8,8,8]", "model.sw_batch_size=8",
                     "model.plan.iterations_per_epoch=2"],
    "ddpm": [
        "model.network.channels=[8,8]",
        "model.network.attention_levels=[false,true]",
        "model.network.norm_num_groups=4",
        "model.network.num_head_channels=4",
        "model.ssim_kernel_size=5",
    ],
}
TINY_MODEL["xray2ct"] = [
    "dataset.image_modalities=[ct]",
    "dataset.views=[ap,lateral]",
    "dataset.xray_size=[16,16]",
    "model.channels=[8,16]",
    "model.attention_levels=[false,true]",
    "model.num_head_channels=8",
    "model.encoder_channels=[8,16]",
    "model.token_dim=16",
    "model.timesteps=4",
]
# A latent diffusion model also needs `model.first_stage_ckpt` (a trained VQ-GAN).
TINY_MODEL["ldm"] = [
    "model.network.channels=[8,8]",
    "model.network.attention_levels=[false,true]",
    "model.network.norm_num_groups=4",
    "model.network.num_head_channels=4",
    "model.ssim_kernel_size=3",
]
TINY = [*TINY_COMMON, *TINY_MODEL["vqgan"]]


def chosen_model(overrides: Sequence[str], default: str = "vqgan") -> str:
    """The model family an override list selects (`model=NAME`; the last one wins)."""
    names = [o.split("=", 1)[1] for o in overrides if o.startswith("model=")]
    return names[-1] if names else default


def tiny_overrides(overrides: Sequence[str]) -> list[str]:
    """TINY settings for the model family that `overrides` selects, followed by the overrides."""
    return [*TINY_COMMON, *TINY_MODEL.get(chosen_model(overrides), []), *overrides]


os.environ.setdefault("OMP_NUM_THREADS", "1")


def subprocess_env(**variables: str) -> dict[str, str]:
    """This environment for a Python subprocess that imports the repository: the repository first on PYTHONPATH, the
    PYTHONPATH this process had after it (packages installed beside the interpreter's own, e.g. carried wheels), then
    `variables`."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **variables}


def compose_cfg(tmp_path: Path, overrides: Sequence[str] = (), tiny: bool = True) -> DictConfig:
    """The composed `train` config with the run directory at `tmp_path`."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="train"):
        cfg = compose(
            config_name="train", overrides=tiny_overrides(overrides) if tiny else list(overrides),
            return_hydra_config=True
        )
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.root_dir = str(tmp_path)
        cfg.paths.log_dir = str(tmp_path)
        cfg.paths.output_dir = str(tmp_path)
    GlobalHydra.instance().clear()
    return cfg


@pytest.fixture(autouse=True)
def process_left_as_found() -> Iterator[None]:
    """Fails a test that leaves this process changed in a way the next test on the worker would inherit: gradient
    mode, default dtype, torch's thread count (each put back, so only the test that changed it fails).

    Put back without failing: the global random number generators (torch's CPU one, numpy's, Python's), which any
    test that draws a number moves, so that what a test draws never depends on which tests ran before it on the same
    worker; and torch's deterministic-algorithms switch, which every Lightning Trainer sets for the process by design.
    """
    grad, dtype, threads = torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads()
    deterministic, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    generators = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    changed = [
        f"{what} {before} -> {after}"
        for what, before, after in (
            ("gradient mode", grad, torch.is_grad_enabled()),
            ("default dtype", dtype, torch.get_default_dtype()),
            ("torch threads", threads, torch.get_num_threads()),
        )
        if before != after
    ]
    torch.set_grad_enabled(grad)
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_rng_state(generators[0])
    np.random.set_state(generators[1])
    random.setstate(generators[2])
    if changed:
        pytest.fail(f"the test left this process changed ({', '.join(changed)}); later tests on this worker would "
                    "inherit it: restore it in the test", pytrace=False)


@pytest.fixture
def tiny_cfg(tmp_path: Path):
    """Factory: `tiny_cfg(*overrides)` -> composed config writing into tmp_path."""

    def make(*overrides: str) -> DictConfig:
        return compose_cfg(tmp_path, overrides)

    return make


@pytest.fixture
def sqrtm_without_disp(monkeypatch: pytest.MonkeyPatch) -> None:
    """scipy.linalg.sqrtm as SciPy 1.18 has it, on any SciPy: `disp` (deprecated in 1.16) refused. MONAI 1.6's
    FIDMetric passed disp=False, and failed on the Python 3.12 install of the 2026-11-27 GPU round."""
    from scipy import linalg

    original = linalg.sqrtm

    def sqrtm(matrix: Any, **kwargs: Any) -> Any:
        if "disp" in kwargs:
            raise TypeError("sqrtm() got an unexpected keyword argument 'disp'")
        return original(matrix, **kwargs)

    monkeypatch.setattr(linalg, "sqrtm", sqrtm)
