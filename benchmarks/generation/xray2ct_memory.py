"""X-ray-to-CT at the seed's scale: per stage, a training step's peak memory and speed, and the wall time of a whole CT.

The stages are built from the composed `experiment=xray2ct_a100x4` config, each stage's
`cascade.stage<k>` merged in as the cascade runner merges it (ViewConditionedDenoiser with
channels 64/128/256/256, attention at the two coarsest levels, 2 res blocks, 512 px views, token
dim 256, fused attention, activation checkpointing; stages 2-3 residual with x0-prediction;
random weights): stage 1 trains on the whole 64^3 volume at batch 16, stages 2 and 3 on 64^3
crops of 128^3 / 256^3 at batch 8 / 4 (`XrayToCT.training_step`: the crop cut, the degraded
condition, the diffusion loss; then backward and an Adam step). Then `XrayToCT.generate`
samples a whole CT through all three stages (stage 1 whole, stages 2 and 3 by Gaussian-blended
64^3 windows, `--steps` each): the code path of validation, test and predict. A step that runs
out of GPU memory is reported as such, and the other rows still run.

On a GPU: bf16 autocast, peak `torch.cuda.max_memory_allocated`. On the CPU (fp32) the sizes
are divided by `--reduce` (default 4: 16^3 -> 32^3 -> 64^3 volumes, 16^3 crops, 128 px views),
the batches by `--batch-divisor` (default 8: 2 / 1 / 1), 2 sampling steps a stage, and the memory
is the growth of the process's peak resident set over the training steps; each measurement runs
in its own process. The CPU estimate of the preset's GPU memory (last column): the activation bytes
autograd keeps per trained voxel (`--activations`, below; the resident set's growth at these sizes
is mostly fixed costs) times the preset's trained voxels (64^3 x batch), plus 20 bytes per trained
parameter (weights, gradients, Adam's two moments, the EMA copy). It counts fp32 activations (bf16
autocast keeps the convolutions' in half), and leaves out the view encoder's and the frozen earlier
stages' memory: a floor, not a ceiling. `--modes` picks activation checkpointing off and/or on (CPU
default: on, the preset's).

`--activations` counts instead the bytes the preset's stage >= 2 network keeps for its backward
pass (every distinct storage saved by autograd, fp32, batch 1, 128 px views) at 16^3 and 32^3
inputs, with and without activation checkpointing: the slope is the activation memory per
trained voxel, which times 64^3 x batch estimates a stage's activations at the preset.

    python benchmarks/generation/xray2ct_memory.py                      # CPU, reduced sizes
    python benchmarks/generation/xray2ct_memory.py --activations        # CPU, saved activations per voxel
    python benchmarks/generation/xray2ct_memory.py --device cuda --reduce 1
    python benchmarks/generation/xray2ct_memory.py --device cuda --reduce 1 --modes on --repeats 2 --parts train
        --json x.json
    python benchmarks/generation/xray2ct_memory.py --reduce 8 --parts whole model.channels=[16,16,16,16]  # toy

`--parts` picks the per-stage training rows (`train`) and/or the whole CT (`whole`); `--json FILE` also writes
every row and the whole CT's figures to FILE. Arguments of the form `key=value` are Hydra overrides of the
preset (a check of the command with a toy network, say).
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
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, composed, table_header  # noqa: E402
from lightning_modules.xray2ct.crops import coordinate_channels  # noqa: E402
from lightning_modules.xray2ct.denoiser import NETWORK_SETTINGS, ViewConditionedDenoiser  # noqa: E402
from lightning_modules.xray2ct.module import XrayToCT, as_size  # noqa: E402
from lightning_modules.xray2ct.stage_settings import window_of  # noqa: E402
from medvol.core.build import RUN_KEYS  # noqa: E402

# Set here, not taken from the preset: the stage, the benchmark's sizes, the earlier stages, what the preset
# leaves to the data or the cascade runner, and the run's keys that are no constructor argument (`RUN_KEYS`).
RUN_SETTINGS = {"_target_", "stage", "size", "crop_size", "xray_size", "activation_checkpointing", "timesteps",
                "previous_stages", "init_from", "optimizer", "scheduler", *RUN_KEYS}


def preset_stages(overrides: list[str]) -> list[tuple[dict[str, Any], int]]:
    """(model settings, batch per GPU) of each stage of `experiment=xray2ct_a100x4` with Hydra `overrides`, each
    stage's `cascade.stage<k>` merged over the job's config as the cascade runner merges it."""
    from omegaconf import OmegaConf

    cfg = composed(["experiment=xray2ct_a100x4", "dataset.root=/unused", *overrides], job_name="xray2ct_memory")
    stages = []
    for stage in cfg.cascade.stages:
        merged = OmegaConf.merge(cfg, cfg.cascade[f"stage{stage}"])
        settings = OmegaConf.to_container(merged.model, resolve=True)
        settings.update(stage=int(stage), xray_size=list(merged.dataset.xray_size))
        stages.append((settings, int(merged.dataset.batch_size)))
    return stages


# The preset's stages, read in `main` (with the command's overrides).
STAGES: list[tuple[dict[str, Any], int]] = []


def stage_settings(
    stage: int, reduce: int, checkpointing: bool, steps: int, overlap: float | None = None
) -> dict[str, Any]:
    """The preset's stage `stage` with its volume, crop and views divided by `reduce` (and its sampling windows'
    overlap `overlap`, where given)."""
    preset, _ = STAGES[stage - 1]
    settings = {} if overlap is None else {"sampling_window_overlap": overlap}
    return {
        **{key: value for key, value in preset.items() if key not in RUN_SETTINGS},
        **settings,
        "stage": stage,
        "size": [s // reduce for s in as_size(preset["size"])],
        "crop_size": [c // reduce for c in as_size(preset["crop_size"])],
        "xray_size": [s // reduce for s in preset["xray_size"]],
        "activation_checkpointing": checkpointing,
        "timesteps": steps,
    }


def volume_of(stage: int) -> int:
    """The edge of stage `stage`'s (cubic) volume in the preset."""
    return as_size(STAGES[stage - 1][0]["size"])[0]


def crop_edge(stage: int) -> int:
    """The edge of the (cubic) volume stage `stage` trains on in the preset: its crop, or the whole volume
    at stage 1."""
    settings, _ = STAGES[stage - 1]
    return volume_of(stage) if stage == 1 else min(as_size(settings["crop_size"])[0], volume_of(stage))


def build(stage: int, reduce: int, checkpointing: bool, steps: int, overlap: float | None = None) -> XrayToCT:
    """Stage `stage` with random weights, its earlier stages built in memory from their settings (as a stage restored
    from its checkpoint rebuilds them: `previous_settings`), none written to disk and read back."""
    earlier = [stage_settings(k, reduce, checkpointing, steps, overlap) for k in range(1, stage)]
    torch.manual_seed(stage)
    return XrayToCT(**stage_settings(stage, reduce, checkpointing, steps, overlap), previous_settings=earlier)


def training_inputs(module: XrayToCT, stage: int, reduce: int, batch: int, device: torch.device) -> dict[str, Any]:
    """A training batch of stage `stage`: random CTs of its (reduced) volume and random radiographs."""
    size = volume_of(stage) // reduce
    return {
        "image": torch.rand(batch, 1, size, size, size, device=device) * 2 - 1,
        "xray": torch.rand(batch, len(module.hparams.views), *module.hparams.xray_size, device=device) * 2 - 1,
        "affine": torch.eye(4, device=device).expand(batch, 4, 4),
    }


def training_step(module: XrayToCT, optimizer: torch.optim.Optimizer, inputs: dict[str, Any],
                  autocast: Callable[[], AbstractContextManager]) -> None:
    """`XrayToCT.training_step` (the crop cut, the degraded condition, the diffusion loss) under `autocast()`, then
    backward and an Adam step."""
    with autocast():
        loss = module.training_step(inputs, 0)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    module = build(args.stage, args.reduce, args.checkpointing, args.steps).to(device)
    module.log = module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    optimizer = torch.optim.Adam(module.network.parameters(), lr=1e-4)
    crop = crop_edge(args.stage)
    batch = args.batch or max(1, STAGES[args.stage - 1][1] // args.batch_divisor)
    inputs = training_inputs(module, args.stage, args.reduce, batch, device)
    autocast = partial(torch.autocast, "cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext

    def step() -> None:
        training_step(module, optimizer, inputs, autocast)

    if device.type == "cuda":
        # As hardware=gpu trains (trainer.benchmark): cuDNN picks its fastest kernels for the fixed crop.
        torch.backends.cudnn.benchmark = True
        torch.cuda.reset_peak_memory_stats(device)
    before = peak_memory_mib(device)
    step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(args.repeats):
        step()
    synchronize(device)
    seconds = (time.perf_counter() - start) / args.repeats
    peak = peak_memory_mib(device)
    trained = (crop // args.reduce) ** 3 * batch
    grown = peak - (0.0 if device.type == "cuda" else before)
    parameters = sum(p.numel() for p in module.network.parameters())
    return {"batch": batch, "trained_voxels": trained, "peak_mib": peak, "grown_mib": grown,
            "samples_per_s": batch / seconds, "step_s": seconds, "parameters": parameters}


def sample_whole(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """A whole CT from one pair of random radiographs through every stage (`XrayToCT.generate`), the earlier stages
    built in memory, each stage's progress logged as it starts (and each step's windows); on a GPU the windows go
    through the network in batches sized to its free memory (`window_batch`)."""
    logging.basicConfig(level=logging.INFO, format="[%(relativeCreated)7.0f ms] %(message)s", stream=sys.stdout)
    last = len(STAGES)
    module = build(last, args.reduce, args.checkpointing, args.steps, args.overlap).to(device).eval()
    module.progress = True
    xray = torch.rand(1, len(module.hparams.views), *module.hparams.xray_size, device=device) * 2 - 1
    autocast = partial(torch.autocast, "cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext
    size = [volume_of(last) // args.reduce] * 3
    probe: dict[str, Any] = {}
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        probe = window_batch(module, xray, autocast)
        module.sampling_window_batch_size = probe["batch"]
        print(f"window batch {probe['batch']}: {probe['per_window_mib']:.0f} MiB a window, "
              f"{probe['free_mib']:.0f} MiB free", flush=True)
    with autocast():
        synchronize(device)
        start = time.perf_counter()
        ct = module.generate(xray, size, ["bench"])["ct"]
        synchronize(device)
    return {"size": size, "seconds": time.perf_counter() - start, "peak_mib": peak_memory_mib(device),
            "finite": bool(torch.isfinite(ct).all()), "window_batch": module.sampling_window_batch_size,
            "overlap": module.sampling_window_overlap, **probe}


# The share of the free memory a window batch may plan to fill (the rest: the allocator's fragmentation).
WINDOW_SHARE = 0.8
# The most windows a call takes. A 64^3 window of stage 3 is 1.97 TFLOP (benchmarks/gpu/gpu_estimates.py), so 32 are
# seconds of a GPU's work a call: more buys no speed. The 2026-11-28 round's H100 planned 92 from its free memory
# (675 MiB a window of 79 GiB): stage 3's second step asked for 17.25 GiB at once with 23.5 GiB reserved but split
# into smaller blocks, and ran out of memory.
MAX_WINDOW_BATCH = 32


def window_batch(module: XrayToCT, xray: torch.Tensor, autocast: Callable[[], AbstractContextManager]
                 ) -> dict[str, Any]:
    """The sampling windows a network call takes on the device: the memory one window adds, measured by calling
    the stage's network on one and on two windows (no gradient), into the free memory, at most `MAX_WINDOW_BATCH`."""
    device = xray.device
    window = window_of(dict(module.hparams))
    peaks = []
    for count in (1, 2):
        inputs = [torch.randn(count, channels, *window, device=device) for channels in (1, 1, 3)]
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.no_grad(), autocast():
            module.sampling_network(inputs[0], torch.full((count,), 500, device=device), xray.expand(count, -1, -1, -1),
                                    inputs[1], inputs[2])
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - before)
    per_window = max(peaks[1] - peaks[0], 1)
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    batch = max(1, min(MAX_WINDOW_BATCH, int((WINDOW_SHARE * free - peaks[0]) // per_window)))
    return {"batch": batch, "per_window_mib": per_window / 2**20, "free_mib": free / 2**20}


def saved_mib(size: int, checkpointing: bool) -> float:
    """MiB of distinct storages autograd keeps for the backward pass of the preset's stage 2 network on one size^3
    input."""
    torch.manual_seed(0)
    preset = STAGES[1][0]
    settings = {
        k: v for k, v in preset.items() if k in NETWORK_SETTINGS and k not in ("xray_size", "activation_checkpointing")
    }
    views = [s // 4 for s in preset["xray_size"]]
    network = ViewConditionedDenoiser(
        num_views=len(preset["views"]),
        xray_size=views,
        cascaded=True,
        activation_checkpointing=checkpointing,
        **settings,
    )
    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    grid = (size, size, size)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        network(torch.randn(1, 1, *grid), torch.tensor([10]), torch.rand(1, len(preset["views"]), *views),
                torch.randn(1, 1, *grid), coordinate_channels(grid, 1))
    return sum(kept.values()) / 2**20


def saved_per_voxel(checkpointing: bool) -> tuple[float, float, float]:
    """(MiB kept at 16^3, at 32^3, MiB per trained voxel: the slope between them)."""
    small, large = saved_mib(16, checkpointing), saved_mib(32, checkpointing)
    return small, large, (large - small) / (32**3 - 16**3)


def activations() -> None:
    print(table_header([
        "activation checkpointing", "kept at 16^3", "kept at 32^3", "per trained voxel", "per 64^3 crop",
        "stage 1 (b16) / 2 (b8) / 3 (b4) activations"
    ]))
    for checkpointing in (False, True):
        small, large, per_voxel = saved_per_voxel(checkpointing)
        crop = per_voxel * 64**3 / 1024
        stages = " / ".join(f"{crop * batch:.1f}" for _, batch in STAGES)
        print(
            f"| {'on' if checkpointing else 'off'} | {small:.0f} MiB | {large:.0f} MiB | {per_voxel * 1024:.2f} KiB | "
            f"{crop:.2f} GiB | {stages} GiB (estimate) |"
        )


def measure(args: argparse.Namespace, what: str, stage: int, checkpointing: bool, batch: int = 0) -> dict[str, Any]:
    """One measurement in a fresh process (so the CPU's peak resident set is this measurement's own); its progress
    lines pass through."""
    command = [sys.executable, __file__, *args.overrides, "--one", what, "--stage", str(stage), "--device", args.device,
               "--reduce", str(args.reduce), "--batch-divisor", str(args.batch_divisor), "--steps", str(args.steps),
               "--repeats", str(args.repeats), "--batch", str(batch)]
    if args.overlap is not None:
        command += ["--overlap", str(args.overlap)]
    if checkpointing:
        command.append("--checkpointing")
    done = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    lines = []
    assert done.stdout is not None
    for line in done.stdout:
        lines.append(line)
        if not line.startswith("{"):
            print(line, end="", flush=True)
    if done.wait() != 0:
        raise SystemExit(f"{what} at stage {stage} failed (exit {done.returncode})")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--reduce", type=int, default=None, help="divide sizes, crops and views by this (CPU default 4)"
    )
    parser.add_argument("--batch-divisor", type=int, default=None, help="divide the preset's batches (CPU default 8)")
    parser.add_argument("--steps", type=int, default=None, help="sampling steps per stage (CPU 2, GPU 10)")
    parser.add_argument("--repeats", type=int, default=None, help="timed training steps (CPU 1, GPU 5)")
    parser.add_argument(
        "--modes", default=None, help="activation checkpointing: off,on (GPU default) or on (CPU default)"
    )
    parser.add_argument("--activations", action="store_true", help="only the saved activations per voxel (CPU)")
    parser.add_argument("--overlap", type=float, help="the whole CT's sampling windows' overlap (preset: 0.5)")
    parser.add_argument("--parts", default="train,whole", help="train (per-stage rows), whole (the whole CT), or both")
    parser.add_argument("--json", type=Path, help="also write the rows and the whole CT's figures to this file")
    parser.add_argument("--one", choices=["train", "sample"], help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    args, args.overrides = parser.parse_known_args()
    STAGES[:] = preset_stages(args.overrides)
    cpu = args.device == "cpu"
    args.reduce = args.reduce or (4 if cpu else 1)
    args.batch_divisor = args.batch_divisor or (8 if cpu else 1)
    args.repeats = args.repeats or (1 if cpu else 5)
    args.steps = args.steps or (2 if cpu else 10)
    args.modes = [mode == "on" for mode in (args.modes or ("on" if cpu else "off,on")).split(",")]
    device = torch.device(args.device)
    if args.activations:
        activations()
        return
    if args.one:
        try:
            result = (train_step if args.one == "train" else sample_whole)(args, device)
        except torch.cuda.OutOfMemoryError as error:
            result = {"out_of_memory": str(error).splitlines()[0]}
            if args.one == "sample":
                result["size"] = [volume_of(len(STAGES)) // args.reduce] * 3
        print(json.dumps(result))
        return
    parts = set(args.parts.split(","))
    if not parts or parts - {"train", "whole"}:
        raise SystemExit(f"--parts is {args.parts!r}; expected train, whole or train,whole")
    rows: list[dict[str, Any]] = []
    whole: dict[str, Any] | None = None
    print(f"device {args.device}, sizes / {args.reduce}, batches / {args.batch_divisor}, {args.steps} sampling steps "
          "a stage", flush=True)
    if "whole" in parts:
        whole = measure(args, "sample", len(STAGES), False)
    if "train" in parts:
        rows = train_rows(args)
    if whole is not None and "out_of_memory" in whole:
        print(f"\nwhole CT through all {len(STAGES)} stages: out of memory ({whole['out_of_memory']})")
    elif whole is not None:
        print(f"\nwhole CT {whole['size'][0]}^3 through all {len(STAGES)} stages, {args.steps} steps each, windows "
              f"overlapping {whole['overlap']}, {whole['window_batch']} a call: {whole['seconds']:.1f} s (peak "
              f"{whole['peak_mib']:.0f} MiB, finite: {whole['finite']})")
    if args.json:
        overlap = STAGES[-1][0]["sampling_window_overlap"] if args.overlap is None else args.overlap
        settings = {"device": args.device, "reduce": args.reduce, "batch_divisor": args.batch_divisor,
                    "sampling_steps": args.steps, "repeats": args.repeats, "window_overlap": overlap}
        args.json.write_text(json.dumps({**settings, "stages": rows, "whole": whole}, indent=1))
    if whole is not None and "out_of_memory" in whole:
        sys.exit(1)


def train_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One training row per stage and activation-checkpointing mode, printed as a table and returned."""
    cpu = args.device == "cpu"
    print(table_header([
        "stage", "volume", "trained on", "batch", "activation checkpointing", "peak memory", "samples/s",
        "estimate at the preset (64^3 crops, full batch)"
    ]))
    per_voxel: dict[bool, float] = {}
    rows = []
    for stage, (_, preset_batch) in enumerate(STAGES, start=1):
        size, crop = volume_of(stage), crop_edge(stage)
        trained = crop // args.reduce
        for checkpointing in args.modes:
            row = measure(args, "train", stage, checkpointing)
            rows.append({"stage": stage, "volume": size // args.reduce, "trained_edge": trained,
                         "checkpointing": checkpointing, **row})
            if "out_of_memory" in row:
                batch = args.batch or max(1, preset_batch // args.batch_divisor)
                rows[-1]["batch"] = batch
                print(
                    f"| {stage} | {size // args.reduce}^3 | {trained}^3 {'crops' if stage > 1 else 'whole'} | "
                    f"{batch} | {'on' if checkpointing else 'off'} | out of memory | - | {row['out_of_memory']} |"
                )
                continue
            memory = row["peak_mib"] if not cpu else row["grown_mib"]
            estimate = "measured"
            if cpu:
                # The resident set's growth is mostly fixed costs at these sizes: the activations come from
                # what autograd keeps per trained voxel (`--activations`), times the preset's voxels.
                if checkpointing not in per_voxel:
                    per_voxel[checkpointing] = saved_per_voxel(checkpointing)[2]
                fixed = 20 * row["parameters"] / 2**20
                voxels = crop**3 * preset_batch
                rows[-1]["estimate_gib"] = (per_voxel[checkpointing] * voxels + fixed) / 1024
                estimate = f"{rows[-1]['estimate_gib']:.1f} GiB (estimate)"
            print(f"| {stage} | {size // args.reduce}^3 | {trained}^3 {'crops' if stage > 1 else 'whole'} | "
                  f"{row['batch']} | {'on' if checkpointing else 'off'} | {memory:.0f} MiB | "
                  f"{row['samples_per_s']:.2f} | {estimate} |")
    return rows

if __name__ == "__main__":
    main()
