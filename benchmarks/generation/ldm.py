"""Latent diffusion: a training step's peak memory and time, and the wall time to generate and decode a volume.

The model is `LatentDiffusion` on a first stage of the preset's shape (random weights; speed and
memory do not depend on them), the denoiser the preset's UNet:

- `cpu` (experiment=ldm_cpu): VQ-GAN 16 hidden channels, 8-dim latents, downsample 4; UNet 32/64.
- `ctpa` (experiment=ctpa_ldm): the same VQ-GAN (the CTPA seed's), UNet 128/256/512, 2 res blocks,
  attention at the coarsest level; training on 64^3 latents (256^3 crops), generation of a whole
  512x512x604 volume (a 128x128x152 latent, sampled by 64^3 Gaussian-blended windows, decoded by
  depth slabs of 2^26 values, each layer's whole activation in pinned host memory only where the GPU's free memory is
  short of it: `decode_offload` null).

Rows: `train` (encode the batch, the diffusion loss, backward, an Adam step; batch 1), `generate`
(the sampler's walk from noise to a latent and its decoding: Fast-DDPM's 10-step DDIM set, DDIM
over 50 uniform steps, ancestral DDPM over all 1000) and `decode` (a latent decoded whole and by
depth slabs). Each row runs in its own process. Memory: on a GPU `torch.cuda.max_memory_allocated`
(bf16 autocast); on the CPU (fp32) the growth of the process's peak resident set over the
measurement.

`--snapping CKPT` measures `model.decode_quantized` instead: the first stage's reconstruction PSNR
and SSIM over the val and test subjects of the run of an LDM checkpoint, decoding each encoded
latent as it is (false) and snapped to its nearest codes (true), with the run's own transforms.

`--denoise` measures one denoising call (no gradient) of the preset's UNet on whole latents of growing size, with
MONAI's attention and with `use_flash_attention` (PyTorch's fused attention): the memory a whole-latent walk needs,
per latent voxel, to extrapolate to a whole CTPA latent.

`--anatomy OUT` measures whether whole volumes get whole anatomy (issue 38 item 5): on the MNI152 BraTS-layout brains
(`datamodules.sources.brain_lesions`, T1 at 4 mm, 48^3), one VQ-GAN, then latent models trained three ways and
sampled whole (48^3, a 12^3 latent): trained on whole latents and sampled whole (MAISI); trained on 24^3 crops
(6^3 latents of the patches dataset) without positions, sampled by 6^3 windows (the CTPA preset before) and whole;
trained on the crops with position channels (PatchDDM), sampled by windows and whole. Each set of samples against
the training set: the mean intensity profile along each axis (the anatomy's place), and the generation metrics
against the test subjects.

    OMP_NUM_THREADS=1 python benchmarks/generation/ldm.py                   # CPU rows, reduced sizes
    OMP_NUM_THREADS=1 python benchmarks/generation/ldm.py --snapping <run>/stage2/best.ckpt
    OMP_NUM_THREADS=1 python benchmarks/generation/ldm.py --denoise --preset ctpa   # whole-latent memory, CPU
    OMP_NUM_THREADS=1 python benchmarks/generation/ldm.py --anatomy DIR     # whole anatomy, CPU (about an hour)
    OMP_NUM_THREADS=1 python benchmarks/generation/ldm.py --anatomy DIR --epochs 10 16 --crop-epochs 3 --val-every 16
        --samples 8
    python benchmarks/generation/ldm.py --device cuda --preset ctpa   # GPU rows (one 80 GB GPU)
    python benchmarks/generation/ldm.py --device cuda --preset ctpa --rows train generate --samplers fast_ddpm_10
        --json l.json

`--rows` picks the kinds of row (train, generate, decode; all by default), `--json FILE` also writes every row's
figures to FILE.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path

import torch
from monai.networks.nets import DiffusionModelUNet

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, split_images, table_header  # noqa: E402
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
        "checkpointing": False,
    },
    "ctpa": {
        "network": {"channels": [128, 256, 512], "attention_levels": [False, False, True], "num_res_blocks": 2,
                    "norm_num_groups": 32, "num_head_channels": 32},
        "train": [[64, 64, 64], [128, 128, 128]],
        "generate": [128, 128, 152],
        "decode": [128, 128, 152],
        "window": [64, 64, 64],
        "checkpointing": True,
    },
}
SAMPLERS = {"fast_ddpm_10": {"sampler": "ddim", "timesteps": 10, "timestep_spacing": "non_uniform"},
            "ddim_50": {"sampler": "ddim", "timesteps": 1000, "timestep_spacing": "uniform", "sampling_timesteps": 50},
            "ddpm_1000": {"sampler": "ddpm", "timesteps": 1000, "timestep_spacing": "uniform"}}
SLAB_ELEMENTS = 2**26


def build(preset: str, device: torch.device, fused: bool = True, checkpointing: bool | None = None,
          **settings) -> LatentDiffusion:
    """The preset's latent model with random weights: fused attention (MONAI's explicit attention matrix with
    `fused=False`) and the preset's activation checkpointing unless `checkpointing` says otherwise."""
    network = partial(DiffusionModelUNet, spatial_dims=3, use_flash_attention=fused, **PRESETS[preset]["network"])
    if checkpointing is None:
        checkpointing = PRESETS[preset]["checkpointing"]
    module = LatentDiffusion(network, first_stage_settings=FIRST_STAGE, ema_decay=None,
                             activation_checkpointing=checkpointing, **settings).to(device)
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


def training_step(module: LatentDiffusion, optimizer: torch.optim.Optimizer, images: torch.Tensor,
                  autocast: Callable[[], AbstractContextManager]) -> None:
    """One training step as `LatentDiffusion.training_step` takes it (encode, the diffusion loss), then backward and
    an Adam step; the forward under `autocast()`."""
    with autocast():
        z0 = module.latents(images)
        t = module.draw_timesteps(1, images.device)
        output, target, _ = module.training_prediction(module.network, z0, t, module.noise_like(z0),
                                                       module.conditioning(None, None))
        loss = module.regression_loss(output, target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_row(preset: str, latent: list[int], device: torch.device, repeats: int, fused: bool = True,
              checkpointing: bool | None = None) -> dict:
    module = build(preset, device, fused, checkpointing)
    optimizer = torch.optim.Adam(module.network.parameters(), lr=1e-4)
    images = torch.randn(1, 1, *[4 * s for s in latent], device=device)
    start = peak_start(device)
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        training_step(module, optimizer, images, partial(autocast, device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return {"step_s": sum(times[1:]) / repeats, "peak_gib": peak_gib(device, start)}


def generate_row(preset: str, sampler: str, device: torch.device) -> dict:
    """A whole volume from noise: the sampler's walk by the preset's windows, then the decoding by depth slabs, each
    logged as it goes (the steps and their windows, the decoder's parts and slabs); the decoder's whole activations
    stay on the GPU unless its free memory is short of them (`model.decode_offload` null)."""
    logging.basicConfig(level=logging.INFO, format="[%(relativeCreated)7.0f ms] %(message)s", stream=sys.stdout)
    module = build(preset, device, sampling_window=PRESETS[preset]["window"], decode_slab_elements=SLAB_ELEMENTS,
                   **SAMPLERS[sampler])
    module.eval()
    module.progress = True
    z_T = torch.randn(1, FIRST_STAGE["embedding_dim"], *PRESETS[preset]["generate"], device=device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    start = peak_start(device)
    began = time.perf_counter()
    with torch.no_grad(), autocast(device):
        latent = module.sample(z_T)
        if device.type == "cuda":
            torch.cuda.synchronize()
        sampled = time.perf_counter()
        offload = module.decode_offload(latent, SLAB_ELEMENTS)
        module.images(latent)
    if device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    return {"sample_s": sampled - began, "decode_s": end - sampled, "total_s": end - began,
            "peak_gib": peak_gib(device, start), "decode_offloaded": offload}


def decode_row(preset: str, slabs: bool, device: torch.device) -> dict:
    module = build(preset, device, decode_slab_elements=SLAB_ELEMENTS if slabs else None)
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
    from medvol.run.trained_run import open_trained_run

    trained = open_trained_run(ckpt)
    run, module = trained.config, trained.module(torch.device("cpu"))
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


def denoise_row(preset: str, latent: list[int], flash: bool, device: torch.device) -> dict:
    """Peak memory and time of one denoising call (no gradient) on a whole latent."""
    network = DiffusionModelUNet(spatial_dims=3, in_channels=FIRST_STAGE["embedding_dim"],
                                 out_channels=FIRST_STAGE["embedding_dim"], use_flash_attention=flash,
                                 **PRESETS[preset]["network"]).to(device).eval()
    z = torch.randn(1, FIRST_STAGE["embedding_dim"], *latent, device=device)
    start = peak_start(device)
    began = time.perf_counter()
    with torch.no_grad(), autocast(device):
        network(z, torch.tensor([500], device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"call_s": time.perf_counter() - began, "peak_gib": peak_gib(device, start)}


# ---- whole volumes with whole anatomy (--anatomy) -------------------------------------------------------------------

ANATOMY_GRID = 48
ANATOMY_CROP = 24
DOWNSAMPLE = 4


def train_run(out: Path, name: str, overrides: list[str]) -> Path:
    """`python train.py <overrides>` in `out/name` unless done; the run's best checkpoint."""
    run_dir = out / name
    if not (run_dir / "summary.json").is_file():
        began = time.perf_counter()
        with (out / f"{name}.log").open("w") as log:
            subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
                           check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        (run_dir / "wall_s.txt").write_text(f"{time.perf_counter() - began:.0f}\n")
    return Path(json.loads((run_dir / "summary.json").read_text())["best_checkpoint"])


def axis_profiles(volumes: torch.Tensor) -> list[torch.Tensor]:
    """The mean intensity along each spatial axis of (B, 1, D, H, W) volumes, over the set: where the anatomy is."""
    return [volumes.mean(dim=tuple(d for d in (0, 1, 2, 3, 4) if d != axis)).double() for axis in (2, 3, 4)]


def profile_error(volumes: torch.Tensor, training: torch.Tensor) -> tuple[float, float]:
    """(mean, worst axis) of the mean absolute difference between the set's axis profiles and the training set's."""
    errors = [float((a - b).abs().mean()) for a, b in zip(axis_profiles(volumes), axis_profiles(training),
                                                           strict=True)]
    return sum(errors) / 3, max(errors)


def sampled(ckpt: Path, count: int, window: list[int] | None) -> tuple[torch.Tensor, float]:
    """`count` whole 48^3 samples (model units) of an LDM checkpoint, by latent windows or the whole latent at once,
    and the seconds per sample."""
    from medvol.run.trained_run import open_trained_run

    module = open_trained_run(str(ckpt)).module(torch.device("cpu"))
    module.hparams.sample_size = [ANATOMY_GRID] * 3
    module.sampling_window = None if window is None else tuple(window)
    began = time.perf_counter()
    with torch.no_grad():
        volumes = [module.generate_volumes({"subject": [f"sample-{k}"], "affine": torch.eye(4)[None]})["volumes"]
                   ["sample"] for k in range(count)]
    return torch.cat(volumes).float(), (time.perf_counter() - began) / count


def anatomy_sets(out: Path, common: list[str]) -> list[torch.Tensor]:
    """(training, validation, test) brains in model units, by the whole-volume runs' own transforms."""
    return split_images(["dataset=nifti", *common, "dataset.cache=none", "dataset.num_workers=0",
                         "paths.output_dir=/tmp"])


def anatomy_row(name: str, volumes: torch.Tensor, training: torch.Tensor, test: torch.Tensor, seconds: float) -> str:
    from lightning_modules.diffusion.generation_metrics import generation_metrics, pooled

    metrics = generation_metrics(16, 32, 5)
    for metric in metrics.values():
        if hasattr(metric, "reference"):
            metric.reference = pooled(training, 16)
    metrics["mmd"].update(volumes, test)
    metrics["closer_than_real"].update(volumes, test)
    metrics["sample_msssim"].update(volumes)
    metrics["nearest_train_corr"].update(volumes)
    mean, worst = profile_error(volumes, training)
    values = [mean, worst, *(float(metrics[k].compute()) for k in ("mmd", "sample_msssim", "nearest_train_corr",
                                                                   "closer_than_real"))]
    return f"| {name} | {len(volumes)} | " + " | ".join(f"{v:.3f}" for v in values) + f" | {seconds:.2f} |"


def whole_anatomy(out: Path, subjects: int, samples: int, epochs: list[int], crop_epochs: int | None = None,
                  val_every: int = 1, only: str | None = None) -> None:
    """The arms of `--anatomy`, trained as a user types them, then the table. `crop_epochs`: the crop-trained arms'
    epochs (default the whole arm's: an epoch of crops is 4 crops a training volume at batch 1, one of whole latents
    a volume at batch 4); `val_every`: validate the latent models every so many epochs; `only`: train that arm
    alone and stop (to train two arms in two processes)."""
    from datamodules.sources.brain_lesions import write_brain_lesions

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"data-{subjects}s-4x4x4mm"
    if not (data / "complete").is_file():
        write_brain_lesions(data, subjects, (4.0, 4.0, 4.0))
        (data / "complete").write_text("written\n")
    grid = [ANATOMY_GRID] * 3
    common = [f"dataset.root={data}", "dataset.pattern='{subject}/{subject}_{modality}.nii.gz'",
              "dataset.image_modalities=[t1]", "dataset.transforms.spacing=[4.0,4.0,4.0]",
              f"dataset.transforms.spatial_size=[{','.join(map(str, grid))}]", "dataset.val_fraction=0.2",
              "dataset.test_fraction=0.2", f"dataset.split_file={out / 'split.json'}"]
    run = ["hardware=cpu", "logger=csv", "callbacks.volume_slices=null", "callbacks.progress_bar=null"]
    # experiment=ldm_cpu's two stages, run apart so three latent models share one VQ-GAN.
    vqgan = train_run(out, "vqgan", ["model=vqgan", "dataset=nifti", *common, *run, "dataset.batch_size=4",
                                     "model.n_codes=128", "model.n_hiddens=16", "model.disc_channels=16",
                                     "model.disc_layers=2", "model.discriminator_iter_start=100",
                                     f"trainer.max_epochs={epochs[0]}", "optimized_metric=val/psnr"])
    ldm = ["model=ldm", f"model.first_stage_ckpt={vqgan}", *run, "model.network.channels=[32,64]",
           "model.network.attention_levels=[false,true]", "model.network.norm_num_groups=8",
           "model.network.num_head_channels=8", "model.ssim_kernel_size=5", "model.optimizer.lr=1e-3",
           "optimized_metric=val/loss", "optimized_mode=min"]

    def lasting(count: int) -> list[str]:  # validated at least at the last epoch, so each arm has a best checkpoint
        return [f"trainer.max_epochs={count}", f"trainer.check_val_every_n_epoch={min(val_every, count)}"]

    whole_epochs = lasting(epochs[1])
    crop_epochs_ = lasting(epochs[1] if crop_epochs is None else crop_epochs)
    crops = ["dataset=patches", *common, f"dataset.patch_size=[{ANATOMY_CROP},{ANATOMY_CROP},{ANATOMY_CROP}]",
             "dataset.sampling=random", "dataset.patches_per_volume=4", "dataset.batch_size=1"]
    window = [ANATOMY_CROP // DOWNSAMPLE] * 3
    windowed = f"model.sampling_window=[{','.join(map(str, window))}]"
    arms = {"ldm-whole": [*ldm, *whole_epochs, "dataset=nifti", *common, "dataset.batch_size=4"],
            "ldm-crops": [*ldm, *crop_epochs_, *crops, windowed],
            "ldm-crops-positions": [*ldm, *crop_epochs_, *crops, "model.position_channels=true", windowed]}
    if only is not None:
        train_run(out, only, arms[only])
        return
    whole, crop, positioned = (train_run(out, name, overrides) for name, overrides in arms.items())
    training, validation, test = anatomy_sets(out, common)
    lines = [table_header(["set", "volumes", "profile error (mean of axes)", "worst axis", "MMD vs test", "MS-SSIM",
                           "nearest-training r", "closer than real", "s per sample"]),
             anatomy_row("held-out real (validation subjects)", validation, training, test, 0.0)]
    for name, ckpt, sampling in (
        ("trained whole, sampled whole (MAISI)", whole, None),
        ("trained on crops, sampled by windows", crop, window),
        ("trained on crops, sampled whole", crop, None),
        ("crops with position channels, sampled by windows", positioned, window),
        ("crops with position channels, sampled whole (PatchDDM)", positioned, None),
    ):
        volumes, seconds = sampled(ckpt, samples, sampling)
        lines.append(anatomy_row(name, volumes, training, test, seconds))
        print(lines[-1], flush=True)
    walls = {name: (out / name / "wall_s.txt").read_text().strip() for name in ("vqgan", "ldm-whole", "ldm-crops",
                                                                                 "ldm-crops-positions")}
    text = "\n".join([*lines, "", f"training wall seconds: {walls}"])
    print(text)
    (out / "results.md").write_text(text + "\n")


def one(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    kind, value = args.one.split(":")
    if kind == "train":
        return train_row(args.preset, [int(v) for v in value.split("x")], device, args.repeats)
    if kind.startswith("denoise"):
        return denoise_row(args.preset, [int(v) for v in value.split("x")], kind == "denoise-flash", device)
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
    parser.add_argument("--denoise", nargs="*", type=int, metavar="EDGE",
                        help="one whole-latent denoising call at these latent edges (default 16 24 32)")
    parser.add_argument("--anatomy", type=Path, metavar="OUT", help="whole anatomy in whole volumes, in OUT")
    parser.add_argument("--subjects", type=int, default=60, help="--anatomy: brains written")
    parser.add_argument("--samples", type=int, default=12, help="--anatomy: samples per arm")
    parser.add_argument("--epochs", type=int, nargs=2, default=[12, 40], help="--anatomy: VQ-GAN and LDM epochs")
    parser.add_argument("--crop-epochs", type=int, help="--anatomy: the crop-trained LDMs' epochs (default the LDM's)")
    parser.add_argument("--val-every", type=int, default=1, help="--anatomy: validate the LDMs every N epochs")
    parser.add_argument("--only", choices=["ldm-whole", "ldm-crops", "ldm-crops-positions"],
                        help="--anatomy: train this arm alone and stop")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.snapping:
        snapping(args.snapping)
        return
    if args.anatomy:
        whole_anatomy(args.anatomy.resolve(), args.subjects, args.samples, args.epochs, args.crop_epochs,
                      args.val_every, args.only)
        return
    if args.denoise is not None:
        for edge in args.denoise or [16, 24, 32]:
            for kind in ("denoise", "denoise-flash"):
                result = pairs(run_one(args, f"{kind}:{edge}x{edge}x{edge}"))
                print(f"| {args.preset} | {args.device} | {kind}:{edge}^3 | {result} |", flush=True)
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
        results[row] = run_one(args, row)
        print(f"| {args.preset} | {args.device} | {row} | {pairs(results[row])} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "device": args.device, "repeats": args.repeats,
                                         "generate_latent": preset["generate"], "rows": results}, indent=1))


def run_one(args: argparse.Namespace, row: str) -> dict:
    """One row in a fresh process (its peak memory its own): its figures, or the error it ended with; its progress
    lines pass through as they come."""
    command = [sys.executable, __file__, "--one", row, "--device", args.device, "--preset", args.preset,
               "--repeats", str(args.repeats)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stderr is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if not line.startswith("{"):
            print(line, end="", flush=True)
    errors = process.stderr.read().strip().splitlines()
    if process.wait() != 0 or not lines:
        return {"error": (errors or ["failed"])[-1][:120]}
    return json.loads(lines[-1])


def pairs(result: dict) -> str:
    """A row's figures as `key value` pairs."""
    return ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())


if __name__ == "__main__":
    main()
