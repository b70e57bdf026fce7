"""Every family's test epoch and predict.py as on a GPU (tests/device_tensors.py): tensors reach numpy (and so
lifelines, scipy, PIL and the written files) only through `.cpu()`.

The 2026-11-27 GPU round's survival run crashed at the end of its test epoch (`.numpy()` of the gathered
risks, still on the GPU); these runs catch that on the CPU. Each family runs as the round's `family-*` step runs
it (`test=true` and predict.py; the test epoch again under bf16 autocast), at toy size; the cascades are slow
tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import ndimage

from datamodules.sources.example_data import write_brats
from medvol.run.predicting import predict
from medvol.run.training import run
from tests.conftest import TINY_COMMON, TINY_MODEL, compose_cfg
from tests.device_tensors import ACCELERATOR, REFUSAL, DeviceTensor, accelerator
from tests.medvol.run.test_predict import predict_cfg, saved_run

# Trained and tested in float32, then (but the cascades) tested again from the checkpoint under bf16 autocast, as
# the GPU round's family steps test: torch 2.13's CPU bf16 convolution backward at one thread gives garbage gradients
# now and then (1e20; a NaN log-risk in one run of the whole suite), so no bf16 training here.
BF16_TEST = ["train=false", "test=true", "trainer.precision=bf16-mixed"]
TINY_CASCADE = [
    *[o for o in TINY_COMMON if not o.startswith("dataset.size")], "experiment=xray2ct_cascade", *TINY_MODEL["xray2ct"],
    "cascade.stages=[1,2]", "cascade.stage1={dataset:{size:8,spacing:24.0,batch_size:2},trainer:{max_epochs:1}}",
    "cascade.stage2={dataset:{size:16,spacing:12.0,batch_size:2},trainer:{max_epochs:1}}",
]


@dataclass(frozen=True)
class Family:
    """A family's tiny run: its overrides (given the test's folder), the checkpoint predict.py reads and predict.py's
    own overrides, and the files (patterns) a user gets: in the run's folder, then in predict.py's output folder."""

    overrides: Callable[[Path], list[str]]
    written: tuple[str, ...]
    predicted: tuple[str, ...]
    checkpoint: str = "checkpoints/last.ckpt"
    predict: tuple[str, ...] = ("split=test",)
    tiny: bool = True
    bf16_test: bool = True


def planned_brats(folder: Path) -> list[str]:
    """A planned BraTS segmentation (the round's `family-segmentation`) on 8 example subjects of 24^3."""
    write_brats(folder / "brats", 8, year=2021, size=24)
    return [*(o for o in TINY_COMMON if not o.startswith("dataset.")), "model=segmentation", "dataset=brats",
            "dataset.label_regions=[WT,TC,ET]", f"dataset.root={folder / 'brats'}", "model.plan.base_features=4",
            "model.plan.memory_budget_mib=64", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
            "trainer.limit_test_batches=1"]


FAMILIES = {
    # Enough subjects that the test half has a comparable pair (the C-index and the risk groups are defined).
    "survival": Family(lambda _: ["model=survival", "dataset.num_subjects=16", "dataset.test_fraction=0.5"],
                       ("predictions/risks.csv", "predictions/km_risk_groups.png"), ("predictions.csv",)),
    "classifier": Family(lambda _: ["model=classifier"], ("predictions/probabilities.csv",), ("predictions.csv",)),
    "segmentation": Family(planned_brats, ("predictions/metrics.csv", "predictions/*_seg.nii.gz"),
                           ("metrics.csv", "*_seg.nii.gz", "*_seg.png"), tiny=False),
    "vqgan": Family(lambda _: [], ("predictions/*_reconstruction.nii.gz",), ("metrics.csv", "*_reconstruction.nii.gz")),
    "ddpm": Family(lambda _: ["model=ddpm"], ("predictions/*_sample.nii.gz",), ("*_sample.nii.gz",)),
    "ldm": Family(lambda _: ["experiment=ldm_cpu", "cascade.stage1.trainer.max_epochs=1",
                             "cascade.stage2.trainer.max_epochs=1",
                             *(f"cascade.stage2.{o}" for o in TINY_MODEL["ldm"])],
                  ("stage2/predictions/*_sample.nii.gz",), ("sample_0.nii.gz", "sample_1.nii.gz"),
                  checkpoint="stage2/best.ckpt", predict=("num_samples=2",), bf16_test=False),
    "xray2ct": Family(lambda _: TINY_CASCADE, ("stage2/predictions/*_ct.nii.gz",), ("*_ct.nii.gz",),
                      checkpoint="stage2/best.ckpt", tiny=False, bf16_test=False),
}
# Over ~10 s each on 2 cores: the cascades.
SLOW = {"ldm", "xray2ct"}


def test_a_device_tensor_keeps_to_the_device_and_refuses_numpy_until_copied_to_the_host(monkeypatch):
    with accelerator(monkeypatch):
        moved = torch.arange(6.0).view(2, 3).to(ACCELERATOR)
        made = torch.zeros(3, device=ACCELERATOR)
        derived = [moved * 2, moved.sum(0) + made, torch.cat([moved, moved]), moved[0], moved.to(torch.float64)]
        assert all(type(t) is DeviceTensor for t in [moved, made, *derived])
        for refused in (lambda: moved.numpy(), lambda: np.asarray(moved), lambda: np.array([moved[0], moved[1]]),
                        lambda: ndimage.gaussian_filter(moved, 1.0)):
            with pytest.raises(TypeError, match="use Tensor.cpu"):
                refused()
        # What CUDA allows on a device tensor: a Python number, a list, a format.
        assert float(moved[1, 2]) == 5.0 and moved.tolist()[1] == [3.0, 4.0, 5.0] and f"{moved[0, 1]:.1f}" == "1.0"
        for host in (moved.cpu(), moved.to("cpu"), moved.to("cpu", torch.float64), moved.detach().to(device="cpu")):
            assert type(host) is torch.Tensor and np.asarray(host).sum() == 15.0
    assert REFUSAL.startswith("can't convert")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in FAMILIES])
def test_a_test_epoch_and_predict_hand_numpy_only_host_tensors(tmp_path, monkeypatch, name):
    family = FAMILIES[name]
    run_dir, bf16_dir, out = tmp_path / "run", tmp_path / "bf16", tmp_path / "predicted"
    overrides = family.overrides(tmp_path)
    with accelerator(monkeypatch):
        saved_run(run_dir, compose_cfg(run_dir, [*overrides, "test=true"], tiny=family.tiny))
        checkpoint = run_dir / family.checkpoint
        predict(predict_cfg(f"ckpt_path={checkpoint}", *family.predict, f"output_dir={out}"))
        bf16 = run(compose_cfg(bf16_dir, [*overrides, *BF16_TEST, f"ckpt_path={checkpoint}"], tiny=family.tiny)) \
            if family.bf16_test else {}
    summaries = sorted(run_dir.glob("**/summary.json"))
    tested = [json.loads(s.read_text())["metrics"] for s in summaries]
    assert summaries and all(any(k.startswith("test/") for k in metrics) for metrics in tested), tested
    assert all(list(out.glob(pattern)) for pattern in family.predicted), family.predicted
    for folder in [run_dir, bf16_dir] if family.bf16_test else [run_dir]:
        assert all(list(folder.glob(pattern)) for pattern in family.written), (folder, family.written)
    assert not family.bf16_test or any(name.startswith("test/") for name in bf16), bf16
