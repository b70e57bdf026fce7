"""Where one CTPA VQ-GAN training step spends its time: a torch.profiler trace, summed by part.

    .venv/bin/python benchmarks/gpu/profile_vqgan.py [--size 128] [--batch 1] [--steps 3] [--warmup 1]
        [--device cuda|cpu] [--precision bf16-mixed|32-true] [--trace trace.json] [--json parts.json]
        [hydra overrides ...]

The model is `experiment=ctpa_vqgan`'s (16384 codes, downsample 4, 64-channel discriminators),
built as `benchmarks/gpu/gpu_vqgan.py` builds it, with the discriminators on. Each profiled step is
the training step of `VQGAN.training_step` without Lightning (`benchmarks.training.overhead.gan_step`):
the losses (`VQGAN.gan_losses`: encoder, codebook, decoder, both discriminators on the real and
the reconstructed input, the gradient taken through the discriminators), the autoencoder's
backward pass and Adam step, the discriminators' backward pass and Adam step. Forward hooks
mark each network's forward pass, so the table gives, per part, its time (CPU time of the ops
on the CPU; on a GPU the CUDA kernel time too) and how often it ran per step; "losses, rest"
is `gan_losses` minus the networks' forward passes (the loss arithmetic and the gradient
through the discriminators). On a GPU the host syncs (every call that makes the host wait, by
`torch.cuda.set_sync_debug_mode`, with the line that made it) and kernel launches per step are counted as well:
launches that the GPU outruns are the launch overhead `torch.compile` removes. `--json FILE` writes the parts and the
top ops by their own time (on a GPU: the CUDA kernels'), per step and as a share of the whole (benchmarks/gpu_round.py
keeps it).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run

from benchmarks.gpu.gpu_vqgan import training_setup  # noqa: E402 - after the path set-up for direct runs

NETWORKS = ("encoder", "codebook", "decoder", "image_discriminator", "video_discriminator")
PHASES = ("losses", "discriminator backward", "discriminator Adam step", "generator backward", "generator Adam step")
# Kernels (or, on the CPU, ops) listed by their own time in `--json`.
TOP = 15
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")


def mark_forward_passes(model: torch.nn.Module) -> None:
    """Wrap each network's forward pass in a profiler range named `forward <network>`."""
    for name in NETWORKS:
        network = getattr(model, name)
        ranges: list[record_function] = []

        def enter(_module, _inputs, name=name, ranges=ranges) -> None:
            ranges.append(record_function(f"forward {name}"))
            ranges[-1].__enter__()

        def leave(_module, _inputs, _output, ranges=ranges) -> None:
            ranges.pop().__exit__(None, None, None)

        network.register_forward_pre_hook(enter)
        network.register_forward_hook(leave)


def profiled_step(model, opt_ae: torch.optim.Optimizer, opt_disc: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """`benchmarks.training.overhead.gan_step` (`VQGAN.training_step`'s order), each phase in its own profiler range."""
    with record_function("losses"):
        step = model.gan_losses(x, True)
    with record_function("discriminator backward"):
        step.discriminator_loss.backward(inputs=model.discriminator_parameters())
    with record_function("discriminator Adam step"):
        opt_disc.step()
        opt_disc.zero_grad(set_to_none=True)
    with record_function("generator backward"):
        step.generator_objective.backward()
    with record_function("generator Adam step"):
        opt_ae.step()
        opt_ae.zero_grad(set_to_none=True)


def synchronizing_calls(model: torch.nn.Module, opt_ae: Any, opt_disc: Any, x: torch.Tensor, steps: int
                        ) -> dict[str, int]:
    """The calls that make the host wait for the device in `steps` steps, by the line of Python that made them: each
    warning of `torch.cuda.set_sync_debug_mode("warn")` (a `.item()`, a device-to-host copy, a tensor read as a bool,
    a synchronize), counted once per call, unlike the profiler's events (an `.item()` is a copy and a stream
    synchronisation there)."""
    counts: dict[str, int] = defaultdict(int)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                profiled_step(model, opt_ae, opt_disc, x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchronizing" in str(warning.message):
            counts[f"{Path(warning.filename).name}:{warning.lineno}"] += 1
    return dict(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=128, help="patch edge in voxels")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=1, help="steps before profiling (codebook initialisation)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    parser.add_argument("--trace", help="also write the Chrome trace here")
    parser.add_argument("--json", type=Path, help="also write the parts and the top kernels by own time here")
    args, overrides = parser.parse_known_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --device cpu")
    torch.manual_seed(0)
    if device.type == "cuda":
        # As hardware=gpu trains (trainer.benchmark): cuDNN picks its fastest kernels for the fixed patch.
        torch.backends.cudnn.benchmark = True
    model, opt_ae, opt_disc, x, autocast = training_setup(overrides, device, args.batch, args.size, args.precision)
    mark_forward_passes(model)
    cuda = device.type == "cuda"
    with autocast:
        for _ in range(args.warmup):
            profiled_step(model, opt_ae, opt_disc, x)
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                profiled_step(model, opt_ae, opt_disc, x)
            if cuda:
                torch.cuda.synchronize(device)
        syncs = synchronizing_calls(model, opt_ae, opt_disc, x, args.steps) if cuda else {}
    if args.trace:
        prof.export_chrome_trace(args.trace)

    averages = {event.key: event for event in prof.key_averages()}

    def times(key: str) -> tuple[float, float, int]:
        """CPU and CUDA milliseconds per step (the profiler counts microseconds) and calls of one range."""
        event = averages.get(key)
        if event is None:
            return 0.0, 0.0, 0
        device_us = event.device_time_total if cuda else 0.0
        return event.cpu_time_total / 1e3 / args.steps, device_us / 1e3 / args.steps, event.count

    print(f"{args.device}, batch {args.batch} x {args.size}^3, {args.precision}, {args.steps} profiled steps, "
          f"overrides: {overrides or 'none'}\n")
    print("| part | CPU ms/step | CUDA ms/step | calls/step |\n|---|---|---|---|")
    forward = defaultdict(float)
    parts = {}
    for name in PHASES:
        cpu, gpu, count = times(name)
        parts[name] = {"cpu_ms": cpu, "cuda_ms": gpu}
        print(f"| {name} | {cpu:.1f} | {gpu:.1f} | {count / args.steps:g} |")
        if name == "losses":
            for network in NETWORKS:
                f_cpu, f_gpu, f_count = times(f"forward {network}")
                forward["cpu"] += f_cpu
                forward["gpu"] += f_gpu
                print(f"| - forward {network} | {f_cpu:.1f} | {f_gpu:.1f} | {f_count / args.steps:g} |")
            print(f"| - losses, rest | {cpu - forward['cpu']:.1f} | {gpu - forward['gpu']:.1f} | |")
    if cuda:
        launches = sum(averages[k].count for k in LAUNCHES if k in averages) / args.steps
        per_step = sum(syncs.values()) / args.steps
        print(f"\nsynchronizing CUDA calls per step (torch.cuda.set_sync_debug_mode): {per_step:g}; kernel "
              f"launches per step: {launches:g}")
        for where, count in sorted(syncs.items(), key=lambda item: -item[1])[:10]:
            print(f"  {count / args.steps:g} a step: {where}")
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    print("\nTop ops by self time (all profiled steps):\n")
    print(prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=40))
    if args.json:
        # The ops and kernels themselves, not this script's ranges around them.
        ranges = {*PHASES, *(f"forward {name}" for name in NETWORKS)}
        events = sorted((e for e in prof.key_averages() if e.key not in ranges), key=lambda e: getattr(e, sort),
                        reverse=True)
        total = sum(getattr(e, sort) for e in events) or 1.0
        top = [{"name": e.key, "ms_per_step": getattr(e, sort) / 1e3 / args.steps, "share": getattr(e, sort) / total,
                "calls_per_step": e.count / args.steps} for e in events[:TOP]]
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name(device) if cuda else "cpu", "batch": args.batch, "size": args.size,
            "precision": args.precision, "steps": args.steps, "time": "CUDA kernels' own" if cuda else "ops' own CPU",
            "parts": parts, "top": top,
            **({"syncs_per_step": sum(syncs.values()) / args.steps,
                "syncs_by_line": {k: v / args.steps for k, v in syncs.items()}} if cuda else {}),
        }, indent=1))


if __name__ == "__main__":
    main()
