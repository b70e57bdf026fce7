"""The GPU paths: mixed precision (bf16, and fp16 with a real gradient scaler), clipping after unscaling
on the manual-optimization path, transforms on the device. Skipped where no CUDA GPU is visible.

What of a GPU run the CPU can check runs everywhere: tests/test_device_placement.py takes every family through a
test epoch (also under bf16 autocast) and predict.py with its tensors on a played accelerator (numpy refuses them
until `.cpu()`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_modules.vqgan.vqgan import VQGAN
from medvol.core.build import build
from medvol.run.training import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]

ON_GPU = ["trainer.accelerator=gpu", "trainer.devices=1", "trainer.max_epochs=1", "trainer.limit_train_batches=3",
          "trainer.limit_val_batches=1", "callbacks.volume_slices=null", "logger=csv"]


class ScalerProbe(pl.Callback):
    """Writes `<file>`: the precision plugin, its gradient scaler and the scale after each step."""

    def __init__(self, file: str) -> None:
        self.file = Path(file)
        self.record: dict[str, Any] = {"scales": []}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        self.record["plugin"] = type(plugin).__name__
        self.record["scaler"] = type(scaler).__name__ if scaler is not None else None
        if scaler is not None:
            self.record["scales"].append(float(scaler.get_scale()))
        self.record["param_dtypes"] = sorted({str(p.dtype) for p in pl_module.parameters()})
        self.file.write_text(json.dumps(self.record))


class ClipProbeVQGAN(VQGAN):
    """The VQ-GAN recording, at every optimizer step, the gradient norm left after medvol's clipping."""

    def __init__(self, record: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.record = Path(record)
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        if torch.isfinite(norm):
            # A step the scaler skips (inf/nan after unscaling) is not clipped to a finite norm.
            self.norms.append(float(norm))
        self.record.write_text(json.dumps(self.norms))


def probe(tmp_path: Path) -> list[str]:
    return ["+callbacks.scaler_probe._target_=tests.test_gpu.ScalerProbe",
            f"+callbacks.scaler_probe.file={tmp_path / 'probe.json'}"]


def test_bf16_mixed_trains_with_float32_master_weights(tiny_cfg, tmp_path):
    metrics = run(tiny_cfg(*ON_GPU, "trainer.precision=bf16-mixed", *probe(tmp_path)))
    record = json.loads((tmp_path / "probe.json").read_text())
    assert record["plugin"] == "MixedPrecision" and record["param_dtypes"] == ["torch.float32"]
    # bf16 has float32's exponent range: no loss scaling.
    assert record["scaler"] is None
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if k.startswith("train/"))


def test_16_mixed_steps_through_a_real_gradient_scaler(tiny_cfg, tmp_path):
    metrics = run(tiny_cfg(*ON_GPU, "trainer.precision=16-mixed", *probe(tmp_path)))
    record = json.loads((tmp_path / "probe.json").read_text())
    assert record["plugin"] == "MixedPrecision" and record["scaler"] == "GradScaler"
    assert len(record["scales"]) == 3 and all(scale > 1.0 for scale in record["scales"]), record["scales"]
    assert torch.isfinite(torch.tensor(metrics["val/psnr"]))


def test_manual_optimization_clips_after_unscaling(tiny_cfg, tmp_path):
    clip = 1e-3  # far below the VQ-GAN's gradient norms: every finite step is clipped
    norms_file = tmp_path / "norms.json"
    run(tiny_cfg(*ON_GPU, "trainer.precision=16-mixed", f"trainer.gradient_clip_val={clip}",
                 "model._target_=tests.test_gpu.ClipProbeVQGAN", f"+model.record={norms_file}"))
    norms = json.loads(norms_file.read_text())
    assert norms, "no finite optimizer step"
    # Clipping the scaled gradients would leave clip / scale (~1e-8) after unscaling; no clipping, far more.
    assert all(norm == pytest.approx(clip, rel=1e-2) for norm in norms), norms


def test_gpu_transforms_deliver_batches_already_on_the_device(tiny_cfg, tmp_path):
    cfg = tiny_cfg(*ON_GPU, "dataset.gpu_transforms=true")
    datamodule = build(cfg.dataset)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["image"].device.type == "cuda"
    metrics = run(cfg)
    assert torch.isfinite(torch.tensor(metrics["val/psnr"]))
