"""Fast-DDPM figures: sampling time (10 vs 1000 steps), peak memory of a training step, quality vs baselines.

    .venv/bin/python benchmarks/generation/ddpm.py sampling [--size 64] [--channels 8 16]
    .venv/bin/python benchmarks/generation/ddpm.py memory [--size 64] [--device cpu|cuda] [--precision 32|bf16-mixed]
        [--checkpointing] [--low-precision-norm] [--repeats 5] [--json FILE]
    .venv/bin/python benchmarks/generation/ddpm.py quality [--epochs 24] [--size 16] [hydra overrides ...]

`sampling` times one volume through the DDIM update over Fast-DDPM's 10-step set and through
DDPM's 1000 ancestral steps, with the same (randomly initialised) network; `memory` runs one
training step (forward, backward, Adam, EMA update) in a fresh process and reports its peak (host RSS
on the CPU, `torch.cuda.max_memory_allocated` on a GPU) and its time (the median of `--repeats` steps
after the first, CUDA synchronised; the first step alone when `--repeats` is 0); `quality` trains model=ddpm on the
synthetic T1 -> T2 pairs as Fast-DDPM, as full DDPM (validated with the same 10-step DDIM
sampler) and as a one-step regressor, and prints val PSNR/SSIM per validation against the
identity baseline (the condition copied as the answer).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, child_env, composed, logged_rows, table_header  # noqa: E402
from lightning_modules.diffusion.fast_ddpm import ConditionalDiffusion  # noqa: E402


def network_factory(channels: list[int], attention: list[bool], groups: int, head_channels: int, fused: bool = True):
    from monai.networks.nets import DiffusionModelUNet

    def make(in_channels: int, out_channels: int) -> torch.nn.Module:
        return DiffusionModelUNet(
            spatial_dims=3, in_channels=in_channels, out_channels=out_channels, channels=channels,
            attention_levels=attention, num_res_blocks=1, norm_num_groups=groups, num_head_channels=head_channels,
            use_flash_attention=fused,
        )

    return make


def build_module(args: argparse.Namespace, **kwargs) -> ConditionalDiffusion:
    """model=ddpm's module with the command's network: fused attention as model=ddpm has it (MONAI's explicit
    attention with `--explicit-attention`), activation checkpointing with `--checkpointing`, GroupNorm in bf16 under
    mixed precision with `--low-precision-norm` (both as experiment=fast_ddpm_brats sets them)."""
    attention = [False] * (len(args.channels) - 1) + [args.attention]
    network = network_factory(args.channels, attention, args.groups, args.head_channels,
                              not args.explicit_attention)
    return ConditionalDiffusion(
        network, image_channels=1, cond_channels=1, activation_checkpointing=args.checkpointing,
        low_precision_norm=args.low_precision_norm, **kwargs
    )


def training_step(module: ConditionalDiffusion, optimizer: torch.optim.Optimizer, x0: torch.Tensor,
                  cond: torch.Tensor, autocast: Callable[[], AbstractContextManager]) -> None:
    """One Fast-DDPM training step: the diffusion loss under `autocast()`, backward, Adam, the EMA update."""
    with autocast():
        t = module.draw_timesteps(x0.shape[0], x0.device)
        loss = module.diffusion_loss(module.network, x0, cond, t, torch.randn_like(x0))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    module.ema.update(module.network)


def sampling(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    shape = (1, 1, args.size, args.size, args.size)
    cond, x_T = torch.randn(shape), torch.randn(shape)
    print(f"one {args.size}^3 volume, network channels {args.channels}, attention {args.attention}, "
          f"{torch.get_num_threads()} thread(s)")
    print("| sampler | network passes | time |\n|---|---|---|", flush=True)
    rows = []
    for name, kwargs in (
        ("Fast-DDPM, 10 DDIM steps", {"sampler": "ddim"}),
        ("DDPM, 1000 ancestral steps", {"sampler": "ddpm"}),
    ):
        module = build_module(args, **kwargs).eval()
        start = time.perf_counter()
        module.sample(x_T, module.conditioning(cond))
        rows.append(time.perf_counter() - start)
        passes = 1000 if kwargs["sampler"] == "ddpm" else len(module.sampling_timesteps)
        print(f"| {name} | {passes} | {rows[-1]:.1f} s |", flush=True)
    print(f"ratio 10 / 1000 steps: {rows[0] / rows[1]:.4f}x")


def memory_step(args: argparse.Namespace) -> None:
    """One training step in this process, then `--repeats` timed ones; prints the peak and the step time as JSON."""
    device = torch.device(args.device)
    module = build_module(args).to(device)
    optimizer = torch.optim.Adam(module.network.parameters(), lr=1e-4)
    shape = (args.batch, 1, args.size, args.size, args.size)
    x0, cond = torch.rand(shape, device=device) * 2 - 1, torch.rand(shape, device=device) * 2 - 1
    if device.type == "cuda":
        # As hardware=gpu trains (trainer.benchmark): cuDNN picks its fastest kernels for the fixed size.
        torch.backends.cudnn.benchmark = True
        torch.cuda.reset_peak_memory_stats()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    bf16 = args.precision == "bf16-mixed"
    autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=bf16)

    def step() -> float:
        start = time.perf_counter()
        training_step(module, optimizer, x0, cond, autocast)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    # The first step allocates Adam's moments (and on a GPU picks its kernels): timed only when it is the only one.
    times = [step()]
    first_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda" and args.repeats:
        torch.cuda.reset_peak_memory_stats()
    times = [step() for _ in range(args.repeats)] or times
    result = {"step_ms": 1000 * statistics.median(times), "timed_steps": len(times),
              "norm_outputs": norm_output_dtypes(module, lambda: training_step(module, optimizer, x0, cond, autocast))}
    if device.type == "cuda":
        # The step's peak, the first step's (cuDNN's trial workspaces, Adam's moments) included; and the later steps'
        # alone (the 2026-11-28 round measured 5.74 GiB where 3.26 were predicted: these tell the two apart).
        later_peak = torch.cuda.max_memory_allocated()
        result["peak_gib"] = max(first_peak, later_peak) / 2**30
        result["first_step_peak_gib"] = first_peak / 2**30
        result["later_steps_peak_gib"] = later_peak / 2**30 if args.repeats else None
    else:
        result.update(peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, built_rss_mib=before)
    print(json.dumps(result))


def norm_output_dtypes(module: ConditionalDiffusion, step: Callable[[], None]) -> dict[str, int]:
    """How many GroupNorm outputs of one training `step` (recomputations included) came out in each dtype: under
    bf16 autocast with `--low-precision-norm` all bfloat16, without it all float32."""
    counts: dict[str, int] = {}

    def count(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        name = str(output.dtype).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + 1

    norms = [m for m in module.network.modules() if isinstance(m, torch.nn.GroupNorm)]
    hooks = [norm.register_forward_hook(count) for norm in norms]
    try:
        step()
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def memory(args: argparse.Namespace) -> None:
    # A fresh process, so the peak is this step's and not an earlier command's.
    command = [sys.executable, __file__, "_memory_step", *sys.argv[2:]]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    parameters = sum(p.numel() for p in build_module(args).network.parameters())
    print(f"one training step, batch {args.batch} at {args.size}^3, {args.device}, {args.precision}, "
          f"checkpointing {args.checkpointing}, bf16 GroupNorm {args.low_precision_norm}, network channels "
          f"{args.channels} ({parameters / 1e6:.2f} M parameters)")
    if "peak_gib" in figures:
        later = figures.get("later_steps_peak_gib")
        print(f"peak GPU memory: {figures['peak_gib']:.2f} GiB (first step {figures['first_step_peak_gib']:.2f} GiB, "
              f"later steps {'-' if later is None else f'{later:.2f}'} GiB)")
    else:
        print(f"peak host RSS: {figures['peak_rss_mib']:.0f} MiB "
              f"(model and data built: {figures['built_rss_mib']:.0f} MiB)")
    print(f"step time: {figures['step_ms']:.1f} ms (median of {figures['timed_steps']})")
    print(f"GroupNorm outputs of a step by dtype: {figures['norm_outputs']}")
    if args.json:
        args.json.write_text(json.dumps({
            "size": args.size, "batch": args.batch, "device": args.device, "precision": args.precision,
            "checkpointing": args.checkpointing, "low_precision_norm": args.low_precision_norm,
            "channels": args.channels, "parameters": parameters, **figures,
        }, indent=1))


def train(name: str, directory: Path, overrides: list[str]) -> list[dict[str, float]]:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "model=ddpm", "logger=csv", "callbacks.progress_bar=null",
         "callbacks.model_summary=null", f"hydra.run.dir={directory}", *overrides],
        check=True, capture_output=True, env=child_env(),
    )
    wall = time.perf_counter() - start
    rows = logged_rows(directory, "val/psnr")
    print(f"{name}: {wall:.0f} s", flush=True)
    return [{"epoch": int(r["epoch"]) + 1, "psnr": float(r["val/psnr"]), "ssim": float(r["val/ssim"])} for r in rows]


def identity_baseline(overrides: list[str], directory: Path) -> tuple[float, float]:
    """PSNR/SSIM of the condition taken as the answer, on the same validation subjects."""
    from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

    from medvol.core.build import build

    cfg = composed(["model=ddpm", f"paths.output_dir={directory}", *overrides], job_name="ddpm")
    datamodule = build(cfg.dataset)
    datamodule.setup("fit")
    psnr = PeakSignalNoiseRatio(data_range=2.0, reduction="elementwise_mean", dim=(1, 2, 3, 4))
    ssim = StructuralSimilarityIndexMeasure(data_range=2.0, kernel_size=int(cfg.model.ssim_kernel_size))
    for batch in datamodule.val_dataloader():
        psnr.update(batch["cond"], batch["image"])
        ssim.update(batch["cond"], batch["image"])
    return float(psnr.compute()), float(ssim.compute())


def quality(args: argparse.Namespace, overrides: list[str]) -> None:
    common = [f"trainer.max_epochs={args.epochs}", f"trainer.check_val_every_n_epoch={args.val_every}",
              f"dataset.size={args.size}", "trainer.num_sanity_val_steps=0", *overrides]
    variants = {
        "Fast-DDPM (10 non-uniform steps, DDIM)": [],
        "DDPM training (1000 steps), validated with the same 10-step DDIM": [
            "model.timesteps=1000", "model.timestep_spacing=uniform", "model.sampling_timesteps=10",
            "model.sampling_spacing=non_uniform"],
        "same network as a one-step regressor": ["model.timesteps=[999]", "model.prediction_type=sample"],
    }
    with tempfile.TemporaryDirectory() as tmp:
        identity = identity_baseline(common, Path(tmp) / "identity")
        results = {
            name: train(name, Path(tmp) / str(i), [*common, *extra]) for i, (name, extra) in enumerate(variants.items())
        }
    print(f"\nsynthetic T1 -> T2, {args.size}^3, overrides: {overrides or 'none'}")
    print(table_header(["model", *(f"epoch {r['epoch']}" for r in next(iter(results.values())))]))
    print(f"| identity baseline | {identity[0]:.2f} dB / {identity[1]:.3f} (every epoch) |")
    for name, rows in results.items():
        print(f"| {name} | " + " | ".join(f"{r['psnr']:.2f} dB / {r['ssim']:.3f}" for r in rows) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["sampling", "memory", "quality", "_memory_step"])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--channels", type=int, nargs="+", default=[16, 32, 32])
    parser.add_argument("--attention", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--head-channels", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="32", choices=["32", "bf16-mixed"])
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--low-precision-norm", action="store_true", help="GroupNorm in bf16 under bf16-mixed")
    parser.add_argument("--explicit-attention", action="store_true",
                        help="MONAI's explicit attention matrix instead of fused attention (model=ddpm's default)")
    parser.add_argument("--repeats", type=int, default=0, help="memory: timed steps after the first (0: the first)")
    parser.add_argument("--json", type=Path, help="memory: also write the figures to this file")
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--val-every", type=int, default=4)
    args, overrides = parser.parse_known_args()
    if args.command == "sampling":
        sampling(args)
    elif args.command == "memory":
        memory(args)
    elif args.command == "_memory_step":
        memory_step(args)
    else:
        quality(args, overrides)


if __name__ == "__main__":
    main()
