"""docs/reliability.md's exact resume, per model family: a run resumed from its `last.ckpt` (given `ckpt_path=` and
nothing of the first command) ends with the weights and the per-epoch validation metrics of the run that was never
stopped; once after 2 epochs resumed to 3, once after a failure in the middle of epoch 3 (as `kill -9` leaves a run:
the last checkpoint is the one written at the end of epoch 2)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from monai.data import Dataset as TransformDataset
from monai.data.utils import worker_init_fn
from monai.transforms import Compose
from torch.utils.data import DataLoader

from benchmarks.segmentation.nnunet_plans import write_raw
from callbacks.rng_state import RNGState
from datamodules.pipeline.augmentation import nnunet_augmentation
from datamodules.pipeline.draws import DrawDataset, SeededDraws
from datamodules.pipeline.oversampling import OversamplingSampler
from medvol.run.training import run
from tests.conftest import compose_cfg
from tests.medvol.run.test_train import model_extra

# A sanity check first, as by default (it draws nothing from the run's generators).
COMMON = ["seed=7", "trainer.deterministic=true", "logger=csv", "callbacks.volume_slices=null",
          "trainer.num_sanity_val_steps=1"]
# Per family: what its tiny run needs beyond the tiny settings, from a test folder (the LDM a VQ-GAN to encode with).
FAMILIES = ["vqgan", "ddpm", "ldm", "xray2ct", "survival", "classifier", "segmentation"]
SLOW = {"ldm", "xray2ct", "segmentation"}
# Survival's C-index needs an event among the validation subjects; the classifier's batch norm a second sample in
# every training batch (5 training subjects leave one alone).
EXTRA = {"survival": ["dataset.num_subjects=16", "dataset.val_fraction=0.5"],
         "classifier": ["trainer.limit_train_batches=2"]}


class Killed(RuntimeError):
    """The failure that stops the first run in the middle of an epoch."""


def planned_segmentation(root: Path) -> list[str]:
    """A planned segmentation run (nnU-Net's epoch of batches drawn with replacement, foreground oversampling and
    augmentation) on a small nnU-Net raw dataset written under `root`."""
    rng = np.random.default_rng(0)
    cases = {}
    for i in range(6):
        label = np.zeros((16, 14, 10), np.uint8)
        label[4 + i % 3 : 10, 4:9, 3:7] = 1
        t2 = rng.normal(100, 5, label.shape).astype(np.float32) + 50 * label
        cases[f"case_{i:02d}"] = ([t2], label, [1.0, 1.0, 2.0])
    write_raw(root, "Dataset001_Box", ["T2"], {"background": 0, "box": 1}, cases)
    return [
        "model=segmentation", "dataset=nnunet", f"dataset.root={root / 'Dataset001_Box'}", "dataset.val_fraction=0.34",
        "dataset.test_fraction=0.0", "dataset.num_workers=2", "model.plan.base_features=4",
        "model.plan.iterations_per_epoch=3", "model.plan.batch_size=2", "hardware=cpu", "callbacks.progress_bar=null",
        "callbacks.model_summary=null", "trainer.log_every_n_steps=1",
    ]


def family_overrides(family: str, folder: Path) -> list[str]:
    if family == "segmentation":
        return planned_segmentation(folder / "raw")
    return [f"model={family}", *model_extra(family, folder), *EXTRA.get(family, [])]


def validation_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """Per epoch, the `val/` metrics the run's CSV logger wrote (a resumed run appends to the same file)."""
    found: dict[int, dict[str, float]] = {}
    with open(run_dir / "csv" / "metrics.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            values = {k: float(v) for k, v in row.items() if k.startswith("val/") and v not in ("", None)}
            if values:
                found.setdefault(int(row["epoch"]), {}).update(values)
    return found


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0) for k in a)


def same_metrics(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]]) -> bool:
    if a.keys() != b.keys() or any(a[e].keys() != b[e].keys() for e in a):
        return False
    return all(x == y or (math.isnan(x) and math.isnan(y)) for e in a for x, y in
               ((a[e][k], b[e][k]) for k in a[e]))


def resume(run_dir: Path, *overrides: str) -> None:
    (run_dir / ".hydra").mkdir(exist_ok=True)
    run(compose_cfg(run_dir, [f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", *overrides], tiny=False))


def kill_in_epoch(monkeypatch: pytest.MonkeyPatch, epoch: int, batch: int) -> None:
    """The next run fails at training batch `batch` of `epoch`, after its last checkpoint (epoch - 1's end)."""

    def on_train_batch_start(self: Any, trainer: Any, pl_module: Any, data: Any, batch_idx: int) -> None:
        if trainer.current_epoch == epoch and batch_idx == batch:
            raise Killed(f"killed in epoch {epoch} at batch {batch}")

    monkeypatch.setattr(RNGState, "on_train_batch_start", on_train_batch_start, raising=False)


def assert_same_run(family: str, straight: Path, resumed: Path) -> None:
    """The same epoch, step, weights (to 1e-6) and per-epoch validation metrics at the end of both runs."""
    a = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    assert (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"]) and a["epoch"] == 2
    difference = largest_difference(a["state_dict"], b["state_dict"])
    expected, got = validation_metrics(straight), validation_metrics(resumed)
    assert difference <= 1e-6 and same_metrics(expected, got), (
        f"{family}: weights differ by {difference:.3g}; validation per epoch {expected} against {got}")


def first_run(run_dir: Path, base: list[str], epochs: int) -> None:
    # The tiny settings are those of the synthetic phantoms: a file dataset gives its own (`planned_segmentation`).
    tiny = "dataset=nnunet" not in base
    run(compose_cfg(run_dir, [*base, f"trainer.max_epochs={epochs}"], tiny=tiny))


def straight_run(family: str, tmp_path: Path) -> tuple[list[str], Path]:
    base = [*COMMON, *family_overrides(family, tmp_path)]
    straight = tmp_path / "straight"
    first_run(straight, base, 3)
    return base, straight


def marked(families: list[str]) -> list[Any]:
    return [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in families]


@pytest.mark.parametrize("family", marked(FAMILIES))
def test_a_run_killed_in_its_third_epoch_resumes_to_the_weights_and_metrics_of_the_run_never_stopped(
    family, tmp_path, monkeypatch
):
    base, straight = straight_run(family, tmp_path)
    resumed = tmp_path / "resumed"
    with monkeypatch.context() as patch:
        kill_in_epoch(patch, epoch=2, batch=1)
        with pytest.raises(Killed):
            first_run(resumed, base, 3)
    resume(resumed)
    assert_same_run(family, straight, resumed)


# Planned segmentation decays its learning rate to 0 over the epochs the run was planned with (nnU-Net's poly
# schedule): a 2-epoch run is a different run from a 3-epoch one, so it is resumed from a kill only (above).
@pytest.mark.parametrize("family", marked([f for f in FAMILIES if f != "segmentation"]))
def test_two_epochs_resumed_to_three_equal_three_epochs(family, tmp_path):
    base, straight = straight_run(family, tmp_path)
    resumed = tmp_path / "resumed"
    first_run(resumed, base, 2)
    resume(resumed, "trainer.max_epochs=3")
    assert_same_run(family, straight, resumed)


def augmented_epochs(epochs: range, workers: int) -> list[torch.Tensor]:
    """The planned segmentation's augmented patches of `epochs`, drawn through a dataset and loader built anew (as a
    resume builds them) with `workers` loader processes reseeded as the nnU-Net and NIfTI datasets reseed them."""
    rng = np.random.default_rng(0)
    items = [{"image": torch.from_numpy(rng.normal(size=(1, 12, 12, 12)).astype(np.float32)),
              "label": torch.from_numpy((rng.random((1, 12, 12, 12)) > 0.9).astype(np.int64))} for _ in range(3)]
    settings = {"patch": [8, 8, 8], "initial_patch": [10, 10, 10], "rotation": 0.5, "in_plane": False, "axis": 0,
                "classes": [[1]]}
    tail = Compose(nnunet_augmentation(settings, "image", "label", [0.0], [], 0.33)).set_random_state(seed=7)
    dataset = DrawDataset(TransformDataset(items), tail)
    sampler = SeededDraws(dataset, OversamplingSampler(dataset, 2, 3, 0.33, seed=7), seed=7)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=workers,
                        worker_init_fn=worker_init_fn if workers else None,
                        generator=torch.Generator().manual_seed(7))
    patches = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        patches.append(torch.cat([batch["image"] for batch in loader]))
    return patches


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epochs_augmentation_is_the_same_in_a_loader_built_again(workers):
    never_rebuilt = augmented_epochs(range(3), workers)
    assert not torch.equal(never_rebuilt[1], never_rebuilt[2])
    assert torch.equal(augmented_epochs(range(2, 3), workers)[0], never_rebuilt[2])
    # Nor does the number of loader processes change what an epoch draws.
    assert torch.equal(augmented_epochs(range(2, 3), 2 - workers)[0], never_rebuilt[2])
