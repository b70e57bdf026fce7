"""DDP scaling, 1 vs 2 processes: medvol (`train.py`) next to a minimal hand-written PyTorch DDP loop.

    .venv/bin/python benchmarks/training/scaling.py [--repeats 5] [--steps 40] [--batch 2] [--size 32]

Both sides train the same 3D conv network (`ScalingNet`) with the same per-process batch,
SGD, one thread per process, gloo on the CPU (nccl where `--accelerator gpu`). The four
configurations (medvol x1, medvol x2, plain x1, plain x2) run one after the other, in a
rotating order, `--repeats` times, so slow phases of a shared machine hit all of them; the
figures are medians.

Throughput is batch x processes / the median time of one training step on rank 0
(forward, backward with its all-reduce, optimizer step; the first `--warmup` steps left
out), timed the same way on both sides; the median keeps bursts of other load on a shared
machine out of the figure. Process start-up and validation are not timed. The
hand-written loop also times the same steps under `no_sync()` (no gradient all-reduce):
the difference is the time spent waiting for the all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, child_env, table_header  # noqa: E402

# The project's imports come after the path set-up for direct runs.
from datamodules.sources.synthetic import SyntheticDataModule  # noqa: E402
from lightning_modules.base import MedvolModule  # noqa: E402


def build_network(channels: int = 16) -> nn.Sequential:
    """Strided 3D convolutions with batch norm, pooled to one regression output (0.18 M parameters)."""
    return nn.Sequential(
        nn.Conv3d(1, channels, 3, padding=1),
        nn.BatchNorm3d(channels),
        nn.ReLU(),
        nn.Conv3d(channels, 2 * channels, 3, stride=2, padding=1),
        nn.BatchNorm3d(2 * channels),
        nn.ReLU(),
        nn.Conv3d(2 * channels, 4 * channels, 3, stride=2, padding=1),
        nn.BatchNorm3d(4 * channels),
        nn.ReLU(),
        nn.Conv3d(4 * channels, 4 * channels, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(4 * channels, 1),
    )


def regression_loss(network: nn.Module, image: torch.Tensor) -> torch.Tensor:
    """Predict each volume's mean intensity: cheap targets, real gradients."""
    return F.mse_loss(network(image).squeeze(1), image.mean(dim=(1, 2, 3, 4)))


class ScalingNet(MedvolModule):
    """`build_network` as a medvol model (automatic optimization, SGD), for `train.py`.

    Args:
        channels: width of the first convolution.
        lr: SGD learning rate.
    """

    def __init__(self, channels: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.network = build_network(channels)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = regression_loss(self.network, batch["image"])
        self.log("train/loss", loss, batch_size=batch["image"].shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class StepTimer(pl.Callback):
    """Rank 0's training-step durations (batch start to batch end), written as JSON when training ends.

    Args:
        path: where the list of step durations in seconds goes.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.durations: list[float] = []
        self._start = 0.0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.durations.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.durations))


def throughput(durations: list[float], batch: int, world: int, warmup: int) -> float:
    """Samples/s over all ranks from the median step time after `warmup` steps (robust to load bursts)."""
    return batch * world / statistics.median(durations[warmup:])


class RandomVolumes(SyntheticDataModule):
    """Uniform random volumes made once at set-up, like the hand-written loop's batches.

    Taking phantom generation out of the loop leaves medvol's own machinery (Lightning loop,
    sampler, loader, callbacks, logging, DDP strategy) as the only difference between the sides.
    The synthetic dataset's settings (`dataset=synthetic`, the default) with this class as its
    `_target_`: `num_subjects` volumes of `size`^3, one channel.
    """

    def subjects(self) -> list[dict[str, Any]]:
        return [{"subject": f"random-{index:05d}", "index": index} for index in range(self.num_subjects)]

    def build_dataset(self, records: list[dict[str, Any]], stage: str) -> list[dict[str, Any]]:
        generator = torch.Generator().manual_seed(len(records))
        edges = [self.size] * 3 if isinstance(self.size, int) else [int(edge) for edge in self.size]
        shape = (1, *edges)
        return [{"image": torch.rand(shape, generator=generator) * 2 - 1} for _ in records]


def random_volume_epoch(subjects: int, size: int, batch: int, steps: int) -> list[str]:
    """train.py overrides for one epoch of `steps` training steps on `RandomVolumes` (`subjects` of them, `size`^3,
    `batch` a step), no validation: a run that times medvol's steps and nothing else."""
    return [
        "dataset=synthetic",
        "dataset._target_=benchmarks.training.scaling.RandomVolumes",
        f"dataset.num_subjects={subjects}",
        f"dataset.size={size}",
        f"dataset.batch_size={batch}",
        f"dataset.val_fraction={2 / subjects}",
        f"dataset.test_fraction={1 / subjects}",
        "dataset.split_file=null",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={steps}",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
    ]


def medvol_run(processes: int, args: argparse.Namespace) -> dict[str, float]:
    """One `train.py` run; samples/s from its summary.json (all ranks' samples over rank 0's step time)."""
    subjects = args.steps * args.batch * processes + 4
    overrides = [
        "~model",
        f"+model={{_target_:benchmarks.training.scaling.ScalingNet,channels:{args.channels}}}",
        *random_volume_epoch(subjects, args.size, args.batch, args.steps),
        f"trainer.accelerator={args.accelerator}",
        f"trainer.devices={processes}",
        f"strategy={'ddp' if processes > 1 else 'auto'}",
        "trainer.precision=32-true",
        "+trainer.enable_model_summary=false",
        "callbacks.progress_bar=null",
        "callbacks.model_summary=null",
        "callbacks.volume_slices=null",
        "callbacks.model_checkpoint=null",
        "optimized_metric=train/loss",
        "optimized_mode=min",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        timings = Path(tmp) / "steps.json"
        subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={tmp}/run",
             f"+callbacks.step_timer={{_target_:benchmarks.training.scaling.StepTimer,path:{timings}}}"],
            cwd=tmp, env=child_env(threads=1), check=True, capture_output=True, text=True,
        )
        durations = json.loads(timings.read_text())
    return {"samples_per_second": throughput(durations, args.batch, processes, args.warmup)}


def plain_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Path) -> None:
    """One rank of the hand-written loop: DDP over gloo/nccl, same network, batch and optimizer as medvol."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(f"cuda:{rank}" if args.accelerator == "gpu" else "cpu")
    network = build_network(args.channels).to(device)
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        network = DistributedDataParallel(network, device_ids=[rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(network.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    batches = [
        torch.rand(args.batch, 1, args.size, args.size, args.size, generator=generator) * 2 - 1 for _ in range(8)
    ]

    def steps(count: int, synced: bool) -> list[float]:
        durations = []
        for step in range(count):
            image = batches[step % len(batches)].to(device)
            start = time.perf_counter()
            if synced or world == 1:
                loss = regression_loss(network, image)
                loss.backward()
            else:
                with network.no_sync():
                    loss = regression_loss(network, image)
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            durations.append(time.perf_counter() - start)
        return durations

    synced = steps(args.steps, synced=True)
    unsynced = steps(args.steps, synced=False) if world > 1 else synced
    if rank == 0:
        out.write_text(json.dumps({
            "samples_per_second": throughput(synced, args.batch, world, args.warmup),
            "step_ms": 1000 * statistics.median(synced[args.warmup:]),
            "compute_ms": 1000 * statistics.median(unsynced[args.warmup:]),
        }))
    if world > 1:
        dist.destroy_process_group()


def plain_run(processes: int, args: argparse.Namespace) -> dict[str, float]:
    from medvol.run.launch import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        common = ["--steps", str(args.steps), "--batch", str(args.batch), "--size", str(args.size),
                  "--channels", str(args.channels), "--accelerator", args.accelerator, "--warmup", str(args.warmup)]
        workers = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", f"{rank},{processes},{port},{out}", *common],
                env=child_env(threads=1),
            )
            for rank in range(processes)
        ]
        codes = [w.wait(timeout=600) for w in workers]
        if any(codes):
            raise RuntimeError(f"hand-written DDP workers exited with {codes}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=2, help="per-process batch")
    parser.add_argument("--size", type=int, default=32, help="volume edge in voxels")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, world, port, out = args.worker.split(",")
        plain_worker(int(rank), int(world), int(port), args, Path(out))
        return

    configs = [("medvol", 1), ("medvol", 2), ("plain", 1), ("plain", 2)]
    results: dict[tuple[str, int], list[dict[str, float]]] = {config: [] for config in configs}
    ratios: dict[str, list[float]] = {"medvol": [], "plain": []}
    for repeat in range(args.repeats):
        order = configs[repeat % 4 :] + configs[: repeat % 4]
        measured = {}
        for side, processes in order:
            run = medvol_run if side == "medvol" else plain_run
            measured[side, processes] = run(processes, args)
            results[side, processes].append(measured[side, processes])
        for side in ratios:
            ratios[side].append(measured[side, 2]["samples_per_second"] / measured[side, 1]["samples_per_second"])
        print(f"repeat {repeat + 1}/{args.repeats}: speed-up medvol {ratios['medvol'][-1]:.2f}x, "
              f"plain {ratios['plain'][-1]:.2f}x", file=sys.stderr, flush=True)

    median = statistics.median
    print(f"{args.repeats} repeats x {args.steps} steps, per-process batch {args.batch}, {args.size}^3 volumes, "
          f"{args.accelerator}, {os.cpu_count()} cores, 1 thread per process\n")
    print(table_header(["", "1 process (samples/s)", "2 processes (samples/s)", "speed-up", "scaling efficiency"]))
    for side, label in (("medvol", "medvol `train.py`"), ("plain", "hand-written DDP loop")):
        one = median(r["samples_per_second"] for r in results[side, 1])
        two = median(r["samples_per_second"] for r in results[side, 2])
        speedup = median(ratios[side])
        print(f"| {label} | {one:.1f} | {two:.1f} | {speedup:.2f}x | {speedup / 2:.0%} |")
    relative = median(m / p for m, p in zip(ratios["medvol"], ratios["plain"], strict=True))
    step = median(r["step_ms"] for r in results["plain", 2])
    compute = median(r["compute_ms"] for r in results["plain", 2])
    print(f"\nmedvol's speed-up / hand-written speed-up: {relative:.3f} (median over repeats of the ratio "
          f"measured within one repeat); {median(ratios['medvol']) / median(ratios['plain']):.3f} (ratio of the "
          "median speed-ups)")
    print(f"hand-written 2-process step: {step:.1f} ms = {compute:.1f} ms compute (no_sync) "
          f"+ {step - compute:.1f} ms waiting for the gradient all-reduce ({(step - compute) / step:.0%})")


if __name__ == "__main__":
    main()
