"""medvol's cost per training step: the default VQ-GAN step through `train.py` vs a hand-written PyTorch loop.

    .venv/bin/python benchmarks/training/overhead.py [--repeats 5] [--steps 30] [--size 32] [--batch 2]
        [hydra overrides ...]

medvol side: `python train.py` with the default model, callbacks (progress bar, checkpoints,
learning-rate monitor, slice images, run summary, telemetry, ...) and TensorBoard logger, on
in-memory random volumes (`benchmarks.training.scaling.RandomVolumes`, so that phantom generation is
not part of the comparison) and validation off. Hand-written side: the same `VQGAN` object
built from the same config (encoder, codebook, decoder, both discriminators, the same
`VQGAN.gan_losses` and Adam optimizers), a `DataLoader` over the same kind of volumes with the
same batch, and a plain loop: the generator's backward and update, then the discriminators'. The discriminators are on
from the first step on both sides (`discriminator_iter_start=0`), so every timed step is the full GAN step.

A step is timed from the end of the previous one to its own end (data fetch, hooks, logging
included), the first `--warmup` steps left out; each run gives its median. The two sides run
one after the other in ABBA order, `--repeats` times, one thread each; the figures are medians
over the runs. The ratio is medvol / hand-written; the fixed cost is their difference in ms.
Both wall-clock and process CPU time are reported: on a shared machine the CPU time of the
process is the steadier of the two (other jobs' load stretches the wall clock, not it).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, child_env, composed  # noqa: E402
from benchmarks.training.scaling import random_volume_epoch  # noqa: E402


class StepEnds(pl.Callback):
    """Rank 0's training-step end times (wall clock, process CPU time), written as JSON when training ends.

    Args:
        path: where the list of (`perf_counter`, `process_time`) pairs goes.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.ends: list[tuple[float, float]] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.ends.append((time.perf_counter(), time.process_time()))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.ends))


def median_step_ms(ends: list[list[float]], warmup: int) -> tuple[float, float]:
    """Median wall and CPU time between consecutive step ends after `warmup` steps, in ms."""
    pairs = list(zip(ends[warmup:], ends[warmup + 1 :], strict=False))
    return tuple(1000 * statistics.median(b[i] - a[i] for a, b in pairs) for i in (0, 1))  # type: ignore[return-value]


def interpreter(args: argparse.Namespace, side: str) -> list[str]:
    """The Python command line of one side's run: under cProfile (`<profile dir>/<side>.prof`) with `--profile`."""
    if not args.profile:
        return [sys.executable]
    return [sys.executable, "-m", "cProfile", "-o", str(Path(args.profile).resolve() / f"{side}.prof")]


def model_overrides(args: argparse.Namespace) -> list[str]:
    return ["model.discriminator_iter_start=0", *args.overrides]


def medvol_run(args: argparse.Namespace) -> tuple[float, float]:
    """Median wall and CPU step time (ms) of one `train.py` run with the default callbacks and logger."""
    subjects = args.steps * args.batch + 4
    overrides = [
        "hardware=cpu",
        *model_overrides(args),
        *random_volume_epoch(subjects, args.size, args.batch, args.steps),
        "model.in_channels=1",
        "optimized_metric=train/loss_epoch",
        "optimized_mode=min",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        ends = Path(tmp) / "ends.json"
        subprocess.run(
            [*interpreter(args, "medvol"), str(ROOT / "train.py"), *overrides, f"hydra.run.dir={tmp}/run",
             f"+callbacks.step_ends={{_target_:benchmarks.training.overhead.StepEnds,path:{ends}}}"],
            cwd=tmp, env=child_env(threads=1), check=True, capture_output=True, text=True,
        )
        return median_step_ms(json.loads(ends.read_text()), args.warmup)


def gan_step(
    model: Any, opt_ae: torch.optim.Optimizer, opt_disc: torch.optim.Optimizer, x: torch.Tensor, gan_on: bool = True
) -> None:
    """One VQ-GAN training step written by hand, in `VQGAN.training_step`'s order: the model's losses, the
    discriminators' update (their weights' gradients alone), then the generator's."""
    step = model.gan_losses(x, gan_on)
    if step.discriminator_loss is not None:
        step.discriminator_loss.backward(inputs=model.discriminator_parameters())
        opt_disc.step()
        opt_disc.zero_grad(set_to_none=True)
    step.generator_objective.backward()
    opt_ae.step()
    opt_ae.zero_grad(set_to_none=True)


def hand_worker(args: argparse.Namespace, out: Path) -> None:
    """The hand-written loop over the same VQGAN object, losses, optimizers, batch and data."""
    from medvol.core.build import build_model

    torch.set_num_threads(1)
    cfg = composed(["hardware=cpu", *model_overrides(args)], job_name="overhead")
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    opt_ae, opt_disc = model.configure_optimizers()
    generator = torch.Generator().manual_seed(0)
    volumes = [{"image": torch.rand(1, args.size, args.size, args.size, generator=generator) * 2 - 1}
               for _ in range(args.steps * args.batch)]
    loader = torch.utils.data.DataLoader(volumes, batch_size=args.batch, shuffle=True, drop_last=True)
    ends = [(time.perf_counter(), time.process_time())]
    for batch in loader:
        gan_step(model, opt_ae, opt_disc, batch["image"])
        ends.append((time.perf_counter(), time.process_time()))
    out.write_text(json.dumps(ends))


def hand_run(args: argparse.Namespace) -> tuple[float, float]:
    """Median wall and CPU step time (ms) of one hand-written run in its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ends.json"
        subprocess.run(
            [
                *interpreter(args, "hand"),
                __file__,
                "--worker",
                str(out),
                "--steps",
                str(args.steps),
                "--size",
                str(args.size),
                "--batch",
                str(args.batch),
                *args.overrides,
            ],
            env=child_env(threads=1),
            check=True,
            capture_output=True,
            text=True,
        )
        return median_step_ms(json.loads(out.read_text()), args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", type=int, default=32, help="volume edge in voxels")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--profile", metavar="DIR", help="run each side under cProfile, writing DIR/medvol.prof and "
                        "DIR/hand.prof (the last repeat's; its timings include the profiler's own cost)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args, args.overrides = parser.parse_known_args()
    if args.worker:
        hand_worker(args, Path(args.worker))
        return

    runs: dict[str, list[tuple[float, float]]] = {"medvol": [], "hand": []}
    sides = {"medvol": medvol_run, "hand": hand_run}
    for repeat in range(args.repeats):
        order = ("medvol", "hand") if repeat % 2 == 0 else ("hand", "medvol")
        for side in order:
            runs[side].append(sides[side](args))
        print(f"repeat {repeat + 1}/{args.repeats}: medvol {runs['medvol'][-1]} ms, hand-written {runs['hand'][-1]} ms",
              file=sys.stderr, flush=True)

    median = statistics.median
    print(f"{args.repeats} repeats x {args.steps} steps (first {args.warmup} left out), batch {args.batch}, "
          f"{args.size}^3 volumes, one thread, {os.cpu_count()} cores, overrides: {args.overrides or 'none'}\n")
    print(
        "| median step | medvol `train.py` | hand-written loop | ratio | fixed cost per step |\n|---|---|---|---|---|"
    )
    for i, clock in enumerate(("wall clock", "process CPU time")):
        medvol, hand = median(r[i] for r in runs["medvol"]), median(r[i] for r in runs["hand"])
        per_repeat = median(m[i] / h[i] for m, h in zip(runs["medvol"], runs["hand"], strict=True))
        print(f"| {clock} | {medvol:.1f} ms | {hand:.1f} ms | {medvol / hand:.3f} (per-repeat median {per_repeat:.3f}) "
              f"| {medvol - hand:.1f} ms |")


if __name__ == "__main__":
    main()
