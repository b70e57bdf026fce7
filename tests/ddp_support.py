"""What the DDP tests share: running `train.py` in a subprocess, and small models/callbacks the ranks import.

The ranks are separate processes that import these classes by their `_target_` path, so they
live in an importable module rather than inside a test function.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.plugins.io import TorchCheckpointIO
from torch import nn

from lightning_modules.base import MedvolModule
from lightning_modules.vqgan.vqgan import VQGAN
from medvol.run.training import run
from tests.conftest import ROOT, TINY, compose_cfg, subprocess_env

# A subprocess that outlives this is a hang, and fails the test instead of hanging CI.
RUN_TIMEOUT = 240


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def train_cli(
    args: Sequence[str], cwd: Path, timeout: float = RUN_TIMEOUT, launcher: Sequence[str] = (), tiny: bool = True
) -> subprocess.CompletedProcess:
    """`[launcher] python train.py <TINY> <args>` in `cwd`, with the repository importable; output captured."""
    env = subprocess_env(OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MEDVOL_RUN_STAMP"):
        env.pop(name, None)
    command = [*launcher] if launcher else [sys.executable]
    flags = [arg for arg in args if arg.startswith("-") and not arg.startswith("~")]
    overrides = [arg for arg in args if arg not in flags]
    command += [str(ROOT / "train.py"), *flags, *(TINY if tiny else []), *overrides]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def sweep_jobs(sweep: Path) -> dict[str, Path]:
    """A sweep's job folders (`<number>_<overrides>`) by job number."""
    return {p.name.split("_", 1)[0]: p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")}


def explain(result: subprocess.CompletedProcess) -> str:
    return (f"exit {result.returncode}\n--- stdout (end)\n{result.stdout[-4000:]}"
            f"\n--- stderr (end)\n{result.stderr[-6000:]}")


def validation_on_two_ranks_and_one(
    args: Sequence[str], tmp_path: Path
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """The validation metrics each of 2 gloo ranks recorded (`RankRecorder`, which `args` must add as
    `callbacks.rank_recorder`) in a train.py run of `args` with batch 1, and those of the same run in one process."""
    ddp = train_cli([*args, f"+callbacks.rank_recorder.directory={tmp_path / 'ranks'}", "strategy=ddp",
                     "trainer.devices=2", "dataset.batch_size=1", f"hydra.run.dir={tmp_path / 'ddp'}"], cwd=tmp_path,
                     tiny=False)
    assert ddp.returncode == 0, explain(ddp)
    single = tmp_path / "single"
    run(compose_cfg(single, [*args, f"+callbacks.rank_recorder.directory={single / 'ranks'}"], tiny=False))
    ranks = [json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text())["val"] for r in (0, 1)]
    return ranks, json.loads((single / "ranks" / "rank0.json").read_text())["val"]


class PreinitialisedVQGAN(VQGAN):
    """The VQ-GAN with a fixed, already initialised codebook.

    The codebook is normally initialised from encoder outputs drawn on rank 0 (and restarts are
    drawn there too), which by design differs from a single process drawing from the whole batch;
    starting from a fixed codebook leaves only the optimizer arithmetic to compare.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            vectors = torch.randn(self.codebook.n_codes, self.codebook.embedding_dim, generator=generator)
            self.codebook.embeddings.copy_(vectors)
            self.codebook.embedding_sum.copy_(vectors)
            self.codebook.cluster_size.fill_(1.0)
            self.codebook.initialized.fill_(True)


class TinyRegressor(MedvolModule):
    """Automatic optimization: conv -> batch norm -> pooled linear head regressing each volume's mean.

    Args:
        channels: convolution channels.
        lr: SGD learning rate.
    """

    def __init__(self, channels: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv = nn.Conv3d(1, channels, 3, padding=1)
        self.norm = nn.BatchNorm3d(channels)
        self.head = nn.Linear(channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = F.relu(self.norm(self.conv(x))).mean(dim=(2, 3, 4))
        return self.head(features).squeeze(1)

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        x = batch["image"]
        return F.mse_loss(self(x), x.mean(dim=(1, 2, 3, 4)))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, batch_size=batch["image"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True, batch_size=batch["image"].shape[0])

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("test/loss", self._loss(batch), sync_dist=True, batch_size=batch["image"].shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class RankRecorder(pl.Callback):
    """Writes `<dir>/rank<r>.json`: this rank's pid, the subjects of its training batches and its validation/test
    metrics."""

    def __init__(self, directory: str) -> None:
        self.path = Path(directory)
        self.record: dict[str, Any] = {"pid": os.getpid(), "train_subjects": []}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if isinstance(batch, dict) and "subject" in batch:
            self.record["train_subjects"].append([str(s) for s in batch["subject"]])

    def _save(self, trainer: pl.Trainer, stage: str) -> None:
        self.record[stage] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(stage + "/")}
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, "val")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, "test")


class RaiseOnRank(pl.Callback):
    """Raises on rank `rank` at training batch `batch`, while the other ranks carry on into their collectives."""

    def __init__(self, rank: int, batch: int = 1) -> None:
        self.rank = rank
        self.batch = batch

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.batch:
            raise RuntimeError(f"injected failure on rank {self.rank}")


class RecordingCheckpointIO(TorchCheckpointIO):
    """Saves as usual and appends `<rank> <path>` to `log_file` for every checkpoint file written."""

    def __init__(self, log_file: str) -> None:
        super().__init__()
        self.log_file = Path(log_file)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        with self.log_file.open("a") as handle:
            handle.write(f"{rank()} {Path(path).name}\n")


class RegressorWithUnusedBranch(TinyRegressor):
    """`TinyRegressor` with a layer that never takes part in the loss: plain DDP refuses it, `find_unused` does not."""

    def __init__(self, channels: int = 4, lr: float = 0.1) -> None:
        super().__init__(channels=channels, lr=lr)
        self.unused = nn.Linear(channels, 1)


class CodebookRecorder(pl.Callback):
    """Writes `<dir>/codebook_rank<r>.pt`: this rank's codebook buffers at the end of training."""

    def __init__(self, directory: str) -> None:
        self.path = Path(directory)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        buffers = {k: v.detach().cpu().clone() for k, v in pl_module.codebook.state_dict().items()}
        torch.save(buffers, self.path / f"codebook_rank{trainer.global_rank}.pt")
