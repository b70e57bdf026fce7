"""Latent diffusion: a training step's peak memory and time, and the wall time to generate and decode a volume.

The model is `LatentDiffusion` on a first stage of the preset's shape (random weights; speed and
memory do not depend on them), the denoiser the preset's UNet:

- `cpu` (experiment=ldm_cpu): VQ-GAN 16 hidden channels, 8-dim latents, downsample 4; UNet 32/64.
- `ctpa` (experiment=ctpa_ldm): the same VQ-GAN (the CTPA seed's), UNet 128/256/512, 2 res blocks,
  attention at the coarsest level; training on 64^3 latents (256^3 crops), generation of a whole
  512x512x604 volume (a 128x128x152 latent, sampled by 64^3 Gaussian-blended windows, decoded by
  depth slabs of 2^26 values, each layer's whole activation kept on the CPU on a GPU: `decode_offload`).

Rows: `train` (encode the batch, the diffusion loss, backward, an Adam step; batch 1), `generate`
(the sampler's walk from noise to a latent and its decoding: Fast-DDPM's 10-step DDIM set, DDIM
over 50 uniform steps, ancestral DDPM over all 1000) and `decode` (a latent decoded whole and by
depth slabs). Each row runs in its own process. Memory: on a GPU `torch.cuda.max_memory_allocated`
(bf16 autocast); on the CPU (fp32) the growth of the process's peak resident set over the
measurement.

`--snapping CKPT` measures `model.decode_quantized` instead: the first stage's reconstruction PSNR
and SSIM over the val and test subjects of the run of an LDM checkpoint, decoding each encoded
latent as it is (false) and snapped to its nearest codes (true), with the run's own transforms.

    OMP_NUM_THREADS=1 python benchmarks/ldm.py                              # CPU rows, reduced sizes
    OMP_NUM_THREADS=1 python benchmarks/ldm.py --snapping <run>/stage2/best.ckpt
    python benchmarks/ldm.py --device cuda --preset ctpa                    # GPU rows (one 80 GB GPU)
    python benchmarks/ldm.py --device cuda --preset ctpa --rows train generate --samplers fast_ddpm_10 --json l.json

`--rows` picks the kinds of row (train, generate, decode; all by default), `--json FILE` also writes every row's
figures to FILE.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch
from monai.networks.nets import DiffusionModelUNet

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_modules.ldm.latent_diffusion import LatentDiffusion  # noqa: E402

FIRST_STAGE = {"in_channels": 1, "embedding_dim": 8, "n_codes": 16384, "n_hiddens": 16, "downsample": [4, 4, 4]}
PRESETS = {
    "cpu": {
        "network": {"channels": [32, 64], "attention_levels": [False, True], "num_res_blocks": 1,
                    "norm_num_groups": 8, "num_head_channels": 8},
        "train": [[8, 8, 8], [16, 16, 16]],
        "generate": [8, 8, 8],
        "decode": [32, 32, 32],
        "window": None,
    },
    "ctpa": {
        "network": {"channels": [128, 256, 512], "attention_levels": [False, False, True], "num_res_blocks": 2,
                    "norm_num_groups": 32, "num_head_channels": 32},
        "train": [[64, 64, 64], [128, 128, 128]],
        "generate": [128, 128, 152],
        "decode": [128, 128, 152],
        "window": [64, 64, 64],
    },
}
SAMPLERS = {"fast_ddpm_10": {"sampler": "ddim", "timesteps": 10, "timestep_spacing": "non_uniform"},
            "ddim_50": {"sampler": "ddim", "timesteps": 1000, "timestep_spacing": "uniform", "sampling_timesteps": 50},
            "ddpm_1000": {"sampler": "ddpm", "timesteps": 1000, "timestep_spacing": "uniform"}}
SLAB_ELEMENTS = 2**26


def build(preset: str, device: torch.device, **settings) -> LatentDiffusion:
    network = partial(DiffusionModelUNet, spatial_dims=3, **PRESETS[preset]["network"])
    module = LatentDiffusion(network, first_stage_settings=FIRST_STAGE, ema_decay=None, **settings).to(device)
    module.scale_factor.fill_(1.0)
    return module


def peak_start(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_gib(device: torch.device, start: float) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 - start


def autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def train_row(preset: str, latent: list[int], device: torch.device, repeats: int) -> dict:
    module = build(preset, device)
    optimizer = torch.optim.Adam(module.network.parameters(), lr=1e-4)
    images = torch.randn(1, 1, *[4 * s for s in latent], device=device)
    start = peak_start(device)
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        with autocast(device):
            z0 = module.latents(images)
            t = module.draw_timesteps(1, device)
            output, target, _ = module.training_prediction(module.network, z0, t, module.noise_like(z0),
                                                           module.conditioning(None, None))
            loss = module.regression_loss(output, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return {"step_s": sum(times[1:]) / repeats, "peak_gib": peak_gib(device, start)}


def generate_row(preset: str, sampler: str, device: torch.device) -> dict:
    module = build(preset, device, sampling_window=PRESETS[preset]["window"], decode_slab_elements=SLAB_ELEMENTS,
                   decode_offload=device.type == "cuda", **SAMPLERS[sampler])
    module.eval()
    z_T = torch.randn(1, FIRST_STAGE["embedding_dim"], *PRESETS[preset]["generate"], device=device)
    start = peak_start(device)
    began = time.perf_counter()
    with torch.no_grad(), autocast(device):
        latent = module.sample(z_T)
        sampled = time.perf_counter()
        module.images(latent)
    if device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    return {"sample_s": sampled - began, "decode_s": end - sampled, "total_s": end - began,
            "peak_gib": peak_gib(device, start)}


def decode_row(preset: str, slabs: bool, device: torch.device) -> dict:
    module = build(preset, device, decode_slab_elements=SLAB_ELEMENTS if slabs else None,
                   decode_offload=slabs and device.type == "cuda")
    latent = torch.randn(1, FIRST_STAGE["embedding_dim"], *PRESETS[preset]["decode"], device=device)
    start = peak_start(device)
    began = time.perf_counter()
    with torch.no_grad():
        module.images(latent)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"decode_s": time.perf_counter() - began, "peak_gib": peak_gib(device, start)}


def snapping(ckpt: str) -> None:
    """Reconstruction PSNR/SSIM of the run's val and test subjects, decoded unsnapped and snapped."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    from medvol.core.build import build as build_config
    from medvol.run.predict_config import run_config
    from medvol.run.trained_model import load_module

    run = run_config(ckpt)
    module = load_module(run, ckpt, torch.device("cpu"))
    datamodule = build_config(run.dataset)
    datamodule.setup("test")
    for split in ("val", "test"):
        scores: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for index in range(len(datamodule.datasets[split])):
            x = datamodule.datasets[split][index]["image"][None].float()
            z = module.first_stage.encode(x)
            for quantized in (False, True):
                y = module.first_stage.decode(z, quantized).clamp(-1, 1)
                psnr = float(peak_signal_noise_ratio(y, x, data_range=2.0))
                ssim = float(structural_similarity_index_measure(y, x, data_range=2.0, kernel_size=5))
                scores[quantized].append((psnr, ssim))
        for quantized, values in scores.items():
            psnr, ssim = (sum(v[i] for v in values) / len(values) for i in (0, 1))
            print(f"| {split} | {len(values)} | {str(quantized).lower()} | {psnr:.2f} | {ssim:.4f} |")


def one(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    kind, value = args.one.split(":")
    if kind == "train":
        return train_row(args.preset, [int(v) for v in value.split("x")], device, args.repeats)
    if kind == "generate":
        return generate_row(args.preset, value, device)
    return decode_row(args.preset, value == "slabs", device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=list(SAMPLERS))
    parser.add_argument("--rows", nargs="+", default=["train", "generate", "decode"],
                        choices=["train", "generate", "decode"], help="the kinds of row to measure")
    parser.add_argument("--json", type=Path, help="also write every row's figures to this file")
    parser.add_argument("--snapping", metavar="CKPT", help="measure model.decode_quantized on an LDM run instead")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.snapping:
        snapping(args.snapping)
        return
    if args.one:
        print(json.dumps(one(args)))
        return
    preset = PRESETS[args.preset]
    rows = {
        "train": [f"train:{'x'.join(map(str, s))}" for s in preset["train"]],
        "generate": [f"generate:{s}" for s in args.samplers],
        "decode": ["decode:whole", "decode:slabs"],
    }
    results = {}
    for row in [name for kind in args.rows for name in rows[kind]]:
        command = [sys.executable, __file__, "--one", row, "--device", args.device, "--preset", args.preset,
                   "--repeats", str(args.repeats)]
        done = subprocess.run(command, capture_output=True, text=True)
        result = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
            "error": (done.stderr.strip().splitlines() or ["failed"])[-1][:120]}
        results[row] = result
        print(f"| {args.preset} | {args.device} | {row} | " + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "device": args.device, "repeats": args.repeats,
                                         "generate_latent": preset["generate"], "rows": results}, indent=1))


if __name__ == "__main__":
    main()
