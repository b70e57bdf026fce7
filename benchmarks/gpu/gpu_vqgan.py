"""GPU throughput of the CTPA VQ-GAN (`experiment=ctpa_vqgan`) on 128^3 patches: patches/s and peak memory.

    .venv/bin/python benchmarks/gpu/gpu_vqgan.py [--steps 30] [--warmup 5] [--batch 1] [--size 128]
        [--precision bf16-mixed|32-true] [--channels-last] [--compile] [--no-gan] [hydra overrides ...]
    .venv/bin/python benchmarks/gpu/gpu_vqgan.py --matrix    # the four option combinations, one process each
    .venv/bin/python benchmarks/gpu/gpu_vqgan.py --steps 10 --warmup 3 --channels-last --json vqgan.json   # one, short

The model is built from the composed `experiment=ctpa_vqgan` config (16384 codes, downsample
4, discriminators with 64 channels) and trained on random patches already on the GPU, so the
figure is the model's own speed: one step is the generator step (encoder, codebook, decoder,
L1, adversarial and feature-matching losses) and the discriminator step, as in
`benchmarks/overhead.gan_step`; `--no-gan` times the warm-up phase (before
`discriminator_iter_start`) with the generator step alone. `--precision bf16-mixed` runs
the steps under bf16 autocast (the codebook stays in float32), `--channels-last` puts the
networks and the patches in `channels_last_3d`, `--compile` wraps the encoder, decoder and
discriminators in `torch.compile`. Patches/s is batch / the median step (CUDA synchronised,
warm-up steps left out); peak memory is `torch.cuda.max_memory_allocated`. `--json FILE` also writes
the figures (one measurement) or the rows (`--matrix`) to FILE.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import composed  # noqa: E402
from benchmarks.training.overhead import gan_step  # noqa: E402 - after the path set-up for direct runs


def build_model(overrides: list[str]) -> torch.nn.Module:
    from medvol.core.build import build_model

    cfg = composed(["experiment=ctpa_vqgan", "model.in_channels=1", *overrides], job_name="gpu_vqgan")
    return build_model(cfg.model)


def training_setup(overrides: list[str], device: torch.device, batch: int, size: int, precision: str) -> tuple:
    """The CTPA VQ-GAN in training mode on `device` as train.py readies it (`VQGAN.setup`'s `accelerate`, on a CUDA
    device only), its two optimizers, `batch` random patches of `size`^3 in [-1, 1] and the autocast of `precision`."""
    model = build_model(overrides).to(device).train()
    model.accelerate(device)
    opt_ae, opt_disc = model.configure_optimizers()
    patches = torch.rand(batch, 1, size, size, size, device=device) * 2 - 1
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
    return model, opt_ae, opt_disc, patches, autocast


def measure(args: argparse.Namespace) -> dict[str, float | str]:
    """Patches/s and peak memory of `args.steps` training steps with the chosen options."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    options = [f"model.compile={args.compile}", f"model.channels_last={args.channels_last}"]
    model, opt_ae, opt_disc, patches, autocast = training_setup(
        [*options, *args.overrides], device, args.batch, args.size, args.precision
    )
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    durations = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        with autocast:
            gan_step(model, opt_ae, opt_disc, patches, gan_on=not args.no_gan)
        if cuda:
            torch.cuda.synchronize(device)
        durations.append(time.perf_counter() - start)
    step = statistics.median(durations[args.warmup :])
    return {
        "options": f"{args.precision}{', channels-last-3d' if args.channels_last else ''}"
        f"{', compile' if args.compile else ''}{', no GAN' if args.no_gan else ''}",
        "patches_per_second": args.batch / step,
        "step_ms": 1000 * step,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan"),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out (compilation, autotuning)")
    parser.add_argument("--batch", type=int, default=1, help="patches per step (per GPU)")
    parser.add_argument("--size", type=int, default=128, help="patch edge in voxels")
    parser.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--no-gan", action="store_true", help="generator step only (before discriminator_iter_start)")
    parser.add_argument("--device", default="cuda", help="`cpu` for a smoke test of the script (memory not measured)")
    parser.add_argument("--matrix", action="store_true", help="fp32, bf16, bf16 + channels-last, bf16 + both")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args, args.overrides = parser.parse_known_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/gpu_vqgan.py needs a CUDA GPU")
    if not args.matrix:
        result = {**measure(args), "batch": args.batch, "size": args.size}
        print(json.dumps(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return
    common = [
        f"--device={args.device}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--batch={args.batch}",
        f"--size={args.size}",
        *(["--no-gan"] if args.no_gan else []),
        *args.overrides,
    ]
    rows = []
    for options in (["--precision=32-true"], [], ["--channels-last"], ["--channels-last", "--compile"]):
        out = subprocess.run([sys.executable, __file__, *options, *common], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{rows[0]['device']}, batch {args.batch} x {args.size}^3, median of {args.steps} steps\n")
    print("| options | patches/s per GPU | step | peak memory |\n|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['options']} | {row['patches_per_second']:.1f} | {row['step_ms']:.0f} ms | "
            f"{row['peak_memory_gib']:.1f} GiB |"
        )
    if args.json:
        args.json.write_text(json.dumps({"batch": args.batch, "size": args.size, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
