"""export.py's networks: TorchScript and ONNX of every family whose model is a network, equal to PyTorch's outputs
on inputs of two sizes (ONNX through ONNX Runtime), and its one-line refusals.

Each family is built from its tiny config with seeded noise on every weight (a fresh diffusion U-Net's last layer
is zero, which any file would match). The reference is the module in PyTorch; the files are read back by
`torch.jit.load` and `onnxruntime.InferenceSession` here, not through the exporter's own check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from lightning_modules.base import MODEL_KEY, ExportedNetwork
from lightning_modules.vqgan.vqgan import VQGAN
from medvol.core.build import build_model
from medvol.core.errors import MedvolError
from medvol.run.exporting import TOLERANCE, export, write_networks
from tests.conftest import ROOT, TINY_MODEL, compose_cfg, subprocess_env
from tests.lightning_modules.ldm.test_ldm import TINY_VQGAN, save_checkpoint
from tests.payloads import crafted_checkpoint

onnx = pytest.importorskip("onnx", reason="the [export] extra (onnx, onnxruntime) is not installed")
onnxruntime = pytest.importorskip("onnxruntime", reason="the [export] extra (onnx, onnxruntime) is not installed")

VQGAN_CLASS = "lightning_modules.vqgan.vqgan.VQGAN"
# Per family: the overrides of its tiny config (a segmentation built without data is told its classes), and the
# networks it exports.
FAMILIES = {
    "segmentation": (["model=segmentation", "model.num_classes=3"], ["network", "window"]),
    "classifier": (["model=classifier", "model.num_covariates=2"], ["network"]),
    "survival": (["model=survival"], ["network"]),
    "vqgan": (["model=vqgan"], ["reconstruction", "encoder", "decoder"]),
    "ddpm": (["model=ddpm", "model.network.channels=[4,4]", "model.network.num_head_channels=2"], ["denoiser"]),
    "ddpm-conditional": (["model=ddpm", "model.cond_channels=1", "model.network.channels=[4,4]",
                          "model.network.num_head_channels=2"], ["denoiser"]),
    "ldm": (["model=ldm"], ["denoiser", "encoder", "decoder"]),
    "xray2ct": (["model=xray2ct", "model.channels=[4,8]", "model.num_head_channels=4", "model.encoder_channels=[4,8]",
                 "model.norm_num_groups=4", "model.token_dim=8"], ["denoiser"]),
}
# The fast suite exports one family of each kind (a segmentation, an outcome network with covariates, an
# autoencoder, a denoiser with a condition); the others, which share their code paths, are slow.
SLOW = {"survival", "ddpm", "ldm", "xray2ct"}


def noisy(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with seeded noise on every weight, half its tensor's spread (0.05 where the tensor is constant,
    e.g. a zeroed output layer), so the outputs stay of the size a trained network gives."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in module.parameters():
            spread = float(parameter.std()) if parameter.numel() > 1 else 0.0
            parameter.add_(torch.randn(parameter.shape, generator=generator) * (0.5 * spread or 0.05))
    return module.eval()


def family_module(name: str, tmp_path: Path) -> torch.nn.Module:
    overrides, _ = FAMILIES[name]
    if name == "ldm":
        torch.manual_seed(0)
        vqgan = save_checkpoint(VQGAN(**TINY_VQGAN), tmp_path / "vqgan.ckpt", VQGAN_CLASS)
        overrides = [*overrides, f"model.first_stage_ckpt={vqgan}"]
    module = noisy(build_model(compose_cfg(tmp_path / "run", overrides).model))
    if name == "ldm":
        module.scale_factor.fill_(0.7)  # what training computes before its first step
    return module


def onnx_output(path: Path, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {name: value.numpy() for name, value in inputs.items()})[0]


@pytest.mark.parametrize(
    "family", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in FAMILIES]
)
def test_every_network_exports_to_onnx_and_torchscript_equal_to_pytorch_at_two_sizes(family, tmp_path):
    module = family_module(family, tmp_path)
    networks: list[ExportedNetwork] = module.exported_networks([8, 8, 8])
    assert [n.name for n in networks] == FAMILIES[family][1]
    for chosen in ("onnx", "torchscript"):
        folder = tmp_path / chosen
        folder.mkdir()
        record = write_networks(folder, networks, chosen, 17)
        for network, described in zip(networks, record["networks"], strict=True):
            path = folder / described["file"]
            if chosen == "onnx":
                model = onnx.load(str(path))
                assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
                # The batch axis is named (free) on every input; spatial axes too where the network allows it.
                for graph_input in model.graph.input:
                    assert graph_input.type.tensor_type.shape.dim[0].dim_param == "batch"
            sizes = [network.inputs, network.larger]
            # The second example differs in batch, and in spatial size wherever the axes are dynamic.
            assert sizes[0].keys() == sizes[1].keys() and any(
                sizes[0][k].shape != sizes[1][k].shape for k in sizes[0])
            for inputs in sizes:
                with torch.no_grad():
                    expected = network.network(*inputs.values()).numpy()
                    got = (onnx_output(path, inputs) if chosen == "onnx"
                           else torch.jit.load(str(path))(*inputs.values()).numpy())
                assert got.shape == expected.shape and float(np.abs(expected).max()) > 1e-3
                assert np.abs(got - expected).max() <= TOLERANCE, (network.name, chosen)


def export_cfg(ckpt: Path, folder: Path, **settings: object) -> OmegaConf:
    return OmegaConf.create({"ckpt_path": str(ckpt), "format": "onnx", "output_dir": str(folder), "opset": 17,
                             "tta": None, "authors": None, "copyright": None, "model": {}, **settings})


def test_bad_settings_are_refused_in_one_line_before_the_checkpoint_is_read(tmp_path):
    missing = tmp_path / "missing.ckpt"
    (tmp_path / "taken").mkdir()
    cases = [
        ({"format": "tensorrt"}, r"`format` is 'tensorrt'; expected one of bundle, torchscript, onnx"),
        ({"output_dir": str(tmp_path / "taken")}, r"`output_dir`: .*taken exists; expected a new folder"),
        ({"opset": 13}, r"`opset` is 13; expected an ONNX opset of at least 17"),
        ({"tta": "yes"}, r"`tta` is 'yes'; expected true, false or null"),
        ({"ckpt_path": None}, r"`ckpt_path` is not set"),
    ]
    for settings, message in cases:
        with pytest.raises(MedvolError, match=message):
            export(export_cfg(missing, tmp_path / "out", **settings))
    assert not (tmp_path / "out").exists()


def classifier_run(tmp_path: Path) -> Path:
    """A run folder as train.py leaves it, of a tiny classifier (its config; checkpoints added by the tests)."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / ".hydra").mkdir()
    cfg = compose_cfg(run_dir, ["model=classifier", *TINY_MODEL["classifier"]])
    OmegaConf.save({k: v for k, v in cfg.items() if k != "hydra"}, run_dir / ".hydra" / "config.yaml")
    return run_dir


def test_a_classifier_is_refused_as_a_bundle_and_exported_as_onnx(tmp_path):
    run_dir = classifier_run(tmp_path)
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    ckpt = save_checkpoint(build_model(cfg.model), run_dir / "checkpoints" / "last.ckpt",
                           "lightning_modules.discriminative.classifier.ClassifierModel")
    with pytest.raises(MedvolError, match=r"^`format=bundle`: a ClassifierModel cannot be exported as a MONAI bundle: "
                                          r"predict.py gives it one row per subject"):
        export(export_cfg(ckpt, tmp_path / "bundle", format="bundle"))
    assert not (tmp_path / "bundle").exists()
    record = export(export_cfg(ckpt, tmp_path / "onnx"))
    assert [n["file"] for n in record["networks"]] == ["network.onnx"] and (tmp_path / "onnx" / "export.json").is_file()


def test_a_checkpoint_that_is_not_medvols_or_asks_to_run_code_is_refused_and_leaves_nothing(tmp_path):
    run_dir = classifier_run(tmp_path)
    foreign = run_dir / "checkpoints" / "foreign.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(MedvolError, match=r"foreign\.ckpt.*(medvol|family)"):
        export(export_cfg(foreign, tmp_path / "out"))
    # A crafted file whose unpickling would run a command: read as data, it is refused at that name, never run.
    marker = tmp_path / "ran"
    crafted = crafted_checkpoint(run_dir / "checkpoints" / "crafted.ckpt", marker,
                                 **{MODEL_KEY: "lightning_modules.discriminative.classifier.ClassifierModel"})
    with pytest.raises(MedvolError, match=r"crafted\.ckpt"):
        export(export_cfg(crafted, tmp_path / "out"))
    assert not marker.exists()
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.slow
def test_the_command_line_refuses_an_existing_output_folder_in_one_line(tmp_path):
    (tmp_path / "out").mkdir()
    result = subprocess.run(
        [sys.executable, str(ROOT / "export.py"), f"ckpt_path={tmp_path / 'x.ckpt'}", "format=onnx",
         f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, capture_output=True, text=True, env=subprocess_env(),
        timeout=300,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"medvol: error: `output_dir`: {tmp_path / 'out'} exists; expected a new folder (an export never overwrites "
        "files)"
    ]


class SignFlip(torch.nn.Module):
    """Python control flow on a tensor's value: tracing fixes the branch its example takes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if bool(x.sum() > 0) else -x


def test_a_file_that_differs_from_pytorch_at_the_second_size_is_refused(tmp_path):
    positive = torch.ones(1, 1, 4, 4, 4)
    network = ExportedNetwork("flip", SignFlip(), {"image": positive}, "out", {"image": {0: "batch"}},
                              {"image": -torch.ones(2, 1, 4, 4, 4)})
    with pytest.raises(MedvolError, match=r"the exported flip\.ts gives outputs 3 away from PyTorch's on inputs of "
                                          r"shapes \{'image': \[2, 1, 4, 4, 4\]\}; expected at most 0\.0001 times"):
        write_networks(tmp_path, [network], "torchscript", 17)


def test_export_reads_the_checkpoint_once(tmp_path, monkeypatch):
    """Issue 62 item 1: export opens the run as predict does (`medvol.run.trained_run`): one read of the checkpoint
    serves the family's check, the shapes' and the weights."""
    import medvol.run.checkpoint_check as checkpoint_check

    run_dir = classifier_run(tmp_path)
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    ckpt = save_checkpoint(build_model(cfg.model), run_dir / "checkpoints" / "last.ckpt",
                           "lightning_modules.discriminative.classifier.ClassifierModel")
    read = checkpoint_check.load_checkpoint
    reads: list[str] = []
    monkeypatch.setattr(checkpoint_check, "load_checkpoint", lambda path, *a, **k: reads.append(path.name) or read(
        path, *a, **k))
    export(export_cfg(ckpt, tmp_path / "scripted", format="torchscript"))
    assert reads == ["last.ckpt"]
