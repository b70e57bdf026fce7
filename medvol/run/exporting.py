"""`export(cfg)`: a trained model out of medvol, as TorchScript, ONNX or a MONAI bundle (`python export.py`).

The checkpoint and its run are opened as predict.py opens them (`medvol.run.trained_run`: the checkpoint read once
as data, the run's record settled, the plan applied), and the family says which of its networks can leave
(`MedvolModule.exported_networks`: plain tensors in and out, an example of the training size and a larger one).
Each file is checked against PyTorch on both examples (ONNX through ONNX Runtime where it is installed) and
described in `export.json`, with the pre- and post-processing predict.py applies around it. A bundle is the whole
pipeline instead (`medvol.run.bundle`). Everything is written into a scratch folder beside `output_dir` and
renamed into place at the end: a refused or failed export leaves nothing.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from lightning_modules.base import ExportedNetwork, MedvolModule, class_path
from medvol.core.checkpoint_read import TRUST_KEY, checkpoints_trusted
from medvol.core.errors import MedvolError
from medvol.run.bundle import inference_settings, traced, write_bundle
from medvol.run.ensemble import predictor
from medvol.run.predict_check import switch
from medvol.run.predict_config import window_size
from medvol.run.trained_run import open_trained_runs

log = logging.getLogger("medvol")

FORMATS = ("bundle", "torchscript", "onnx")
MIN_OPSET = 17
DESCRIPTION = "export.json"
# Largest |difference| from PyTorch an exported file may show on its examples (float32 through another runtime),
# times the largest output magnitude where that exceeds 1.
TOLERANCE = 1e-4


def export(cfg: DictConfig) -> dict[str, Any]:
    """Write `cfg.ckpt_path`'s model in `cfg.format` to the new folder `cfg.output_dir`; return export.json's record.

    Checkpoints are read as data unless this command says `trust_checkpoints=true`."""
    with checkpoints_trusted(cfg.get(TRUST_KEY, False)):
        return _exported(cfg)


def _exported(cfg: DictConfig) -> dict[str, Any]:
    chosen = check_format(cfg.get("format"))
    check_exporter(chosen)
    output_dir = check_output_dir(cfg.get("output_dir"))
    opset = check_opset(cfg.get("opset", MIN_OPSET))
    tta = switch(cfg, "tta", None)
    if cfg.get("ckpt_path") is None:
        raise MedvolError("`ckpt_path` is not set; expected a checkpoint of a medvol run (<run>/checkpoints/last.ckpt)")
    ckpt = str(cfg.ckpt_path)
    runs = open_trained_runs(ckpt, model=cfg.get("model"))
    run = runs.first.config
    # Mirroring as the command's `tta` says, and the post-processing of the run, as predict.py applies them.
    module = predictor(runs, torch.device("cpu"), tta, cfg.get("postprocessing"))
    size = window_size(run)
    family = type(module).__name__
    started = time.perf_counter()
    scratch = output_dir.parent / f".{output_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        if chosen == "bundle":
            if module.bundle_network() is None:
                raise MedvolError(
                    f"`format=bundle`: a {family} cannot be exported as a MONAI bundle: {module.not_exportable()}"
                )
            record = write_bundle(
                scratch, module, run, ckpt, size, str(cfg.get("authors") or "not given (export.py authors=...)"),
                str(cfg.get("copyright") or "not given (export.py copyright=...)"),
            )
        else:
            networks = module.exported_networks(size)
            if not networks:
                raise MedvolError(f"`ckpt_path`: a {family} cannot be exported: {module.not_exportable()}")
            record = write_networks(scratch, networks, chosen, opset)
        record = {"family": class_path(module), "format": chosen, "checkpoint": ckpt, **record,
                  "pipeline": pipeline(module, run, size)}
        (scratch / DESCRIPTION).write_text(json.dumps(record, indent=2) + "\n")
        scratch.rename(output_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("exported %s (%s) as %s in %.1f s -> %s", family, ckpt, chosen, time.perf_counter() - started, output_dir)
    return record


def check_format(value: Any) -> str:
    if value not in FORMATS:
        raise MedvolError(f"`format` is {value!r}; expected one of {', '.join(FORMATS)}")
    return str(value)


def check_exporter(chosen: str) -> None:
    """Refuse ONNX where the onnx package PyTorch's exporter writes with is missing (the `[export]` extra), before
    anything is read; its check, through onnxruntime, is only noted as not run where that alone is missing."""
    if chosen == "onnx" and importlib.util.find_spec("onnx") is None:
        raise MedvolError(
            "`format=onnx` needs the onnx package (PyTorch's ONNX exporter writes with it), which is not installed: "
            "pip install -e '.[export]'; format=torchscript and format=bundle need neither"
        )


def check_output_dir(value: Any) -> Path:
    """The folder to create: refused if it exists (nothing the user wrote is overwritten)."""
    if value in (None, "", "???"):
        raise MedvolError("`output_dir` is not set; expected a folder that does not exist yet, e.g. output_dir=export/")
    folder = Path(str(value)).expanduser()
    if folder.exists():
        raise MedvolError(f"`output_dir`: {folder} exists; expected a new folder (an export never overwrites files)")
    return folder


def check_opset(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < MIN_OPSET:
        raise MedvolError(f"`opset` is {value!r}; expected an ONNX opset of at least {MIN_OPSET}")
    return value


def write_networks(folder: Path, networks: list[ExportedNetwork], chosen: str, opset: int) -> dict[str, Any]:
    """Each network as `<name>.ts` or `<name>.onnx`, checked on both of its examples; their records."""
    records = []
    for network in networks:
        suffix = ".ts" if chosen == "torchscript" else ".onnx"
        path = folder / f"{network.name}{suffix}"
        if chosen == "torchscript":
            save_torchscript(network.network, network.inputs, path)
        else:
            save_onnx(network, path, opset)
        records.append(describe(network, path, parity(network, path)))
    return {"opset": opset if chosen == "onnx" else None, "networks": records}


def save_torchscript(network: torch.nn.Module, inputs: dict[str, torch.Tensor], path: Path) -> None:
    traced(network, inputs).save(str(path))


def save_onnx(network: ExportedNetwork, path: Path, opset: int) -> None:
    """ONNX through PyTorch's TorchScript-based exporter, the dynamic axes named (`dynamo=False`: it needs no
    onnxscript, and it keeps the axes the example's shapes do not fix)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            network.network.eval(), tuple(network.inputs.values()), str(path), input_names=list(network.inputs),
            output_names=[network.output], dynamic_axes=network.dynamic, opset_version=opset, dynamo=False,
        )


def run_file(path: Path, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The exported file's output on `inputs`: TorchScript loaded back, ONNX through ONNX Runtime on the CPU."""
    if path.suffix == ".ts":
        with torch.no_grad():
            return torch.jit.load(str(path))(*inputs.values())
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {name: value.numpy() for name, value in inputs.items()})[0])


def parity(network: ExportedNetwork, path: Path) -> dict[str, Any]:
    """The file against PyTorch on the training-size example and the larger one (other spatial sizes and batch
    where the axes are dynamic): the largest |difference| of each. A file that fails either, or differs beyond
    `TOLERANCE` (times the outputs' largest magnitude where that exceeds 1), is refused; ONNX is checked through
    ONNX Runtime, and only noted unchecked where it is absent."""
    if path.suffix == ".onnx" and importlib.util.find_spec("onnxruntime") is None:
        return {"checked": "not checked: onnxruntime is not installed (pip install -e '.[export]')"}
    checked: dict[str, Any] = {}
    for label, inputs in (("training_size", network.inputs), ("larger", network.larger)):
        shapes = {k: list(v.shape) for k, v in inputs.items()}
        with torch.no_grad():
            expected = network.network(*inputs.values()).float()
        try:
            got = run_file(path, inputs).float()
        except Exception as err:  # noqa: BLE001 - the runtime's own message says what it could not run
            raise MedvolError(
                f"`format`: the exported {path.name} does not run on inputs of shapes {shapes}: "
                f"{str(err).splitlines()[0][:300]}"
            ) from None
        if got.shape != expected.shape:
            raise MedvolError(
                f"`format`: the exported {path.name} gives an output of shape {list(got.shape)} on inputs of shapes "
                f"{shapes}; PyTorch gives {list(expected.shape)}"
            )
        difference = float((got - expected).abs().max())
        # 1e-4 absolute for outputs up to 1 (probabilities, images in [-1, 1]), relative beyond (logits of a deep
        # network, whose float32 sums another runtime orders differently).
        largest = float(expected.abs().max())
        if not difference <= TOLERANCE * max(1.0, largest):
            raise MedvolError(
                f"`format`: the exported {path.name} gives outputs {difference:.3g} away from PyTorch's on inputs of "
                f"shapes {shapes}; expected at most {TOLERANCE} times the largest output magnitude ({largest:.3g}) "
                "or 1"
            )
        checked[label] = {"shapes": shapes, "max_abs_difference": difference, "largest_output": largest}
    return checked


def describe(network: ExportedNetwork, path: Path, checked: dict[str, Any]) -> dict[str, Any]:
    """A network's record in export.json: its file, inputs (shape, dtype, the axes that vary), output and meaning."""
    inputs = {
        name: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
               "dynamic_axes": {str(k): v for k, v in network.dynamic.get(name, {}).items()}}
        for name, value in network.inputs.items()
    }
    output = {"name": network.output,
              "dynamic_axes": {str(k): v for k, v in network.dynamic.get(network.output, {}).items()}}
    return {"name": network.name, "file": path.name, "inputs": inputs, "output": output,
            "about": network.about, "check": checked}


def pipeline(module: MedvolModule, run: DictConfig, size: list[int]) -> dict[str, Any]:
    """What predict.py does around the network for this run: the dataset's preprocessing (the plan's spacing, crop
    and normalization), the sliding window, mirroring and post-processing, and the training data's record."""
    record: dict[str, Any] = {
        "preprocessing": inference_settings(module, run),
        "window": {"roi": [int(s) for s in size], "overlap": float(run.model.get("overlap", 0.25)),
                   "mode": "gaussian"},
        "training_data": module.training_data or {},
    }
    if hasattr(module, "probabilities"):
        record["mirroring"] = ["depth", "height", "width"] if module.tta else []
        record["postprocessing"] = module.postprocessing.to_json()
        record["pad_value"] = list(module.pad_value or [0.0])
        record["labels"] = module.scheme.names
    return record
