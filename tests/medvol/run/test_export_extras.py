"""export.py without the `[export]` extra: `format=onnx` is refused in one line naming the install command where the
onnx package is missing (PyTorch's exporter writes with it), before anything is read or written; the command line
says it with exit code 2. The other formats need neither onnx nor onnxruntime. With onnx but without onnxruntime
the file is written and its check recorded as not run.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from medvol.core.build import build_model
from medvol.core.errors import MedvolError
from medvol.run.exporting import export
from tests.conftest import ROOT

REFUSAL = r"`format=onnx` needs the onnx package .*: pip install -e '\.\[export\]'"
# export.py run where `import onnx` fails, as in a venv without the extra.
WITHOUT_ONNX = """
import runpy, sys
sys.modules["onnx"] = None
sys.argv = ["export.py", *sys.argv[1:]]
runpy.run_path("export.py", run_name="__main__")
"""


def test_onnx_without_the_onnx_package_is_refused_in_one_line_before_the_checkpoint_is_read(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` fails, as where it is not installed
    cfg = OmegaConf.create({"ckpt_path": str(tmp_path / "missing.ckpt"), "format": "onnx",
                            "output_dir": str(tmp_path / "out"), "opset": 17, "tta": None, "model": {}})
    with pytest.raises(MedvolError, match=REFUSAL):
        export(cfg)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
    # TorchScript needs no onnx: the same command goes on to the checkpoint.
    with pytest.raises(MedvolError, match=r"`ckpt_path`: no file at"):
        export(OmegaConf.merge(cfg, {"format": "torchscript"}))


def test_the_command_line_says_it_in_one_line_with_exit_code_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_ONNX, f"ckpt_path={tmp_path / 'missing.ckpt'}", "format=onnx",
         f"output_dir={tmp_path / 'out'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("medvol: error: `format=onnx` needs the onnx package"), lines
    assert "pip install -e '.[export]'" in lines[0] and not (tmp_path / "out").exists()


def test_onnx_without_onnxruntime_is_written_and_its_check_recorded_as_not_run(tmp_path, monkeypatch):
    pytest.importorskip("onnx", reason="the [export] extra (onnx) is not installed")
    from tests.lightning_modules.ldm.test_ldm import save_checkpoint
    from tests.medvol.run.test_exporting import classifier_run, export_cfg

    run_dir = classifier_run(tmp_path)
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    ckpt = save_checkpoint(build_model(cfg.model), run_dir / "checkpoints" / "last.ckpt",
                           "lightning_modules.discriminative.classifier.ClassifierModel")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` fails, as where it is not installed
    record = export(export_cfg(ckpt, tmp_path / "onnx"))
    (network,) = record["networks"]
    assert (tmp_path / "onnx" / network["file"]).is_file()
    assert network["check"] == {"checked": "not checked: onnxruntime is not installed (pip install -e '.[export]')"}
