"""Every GPU row's peak memory and FLOPs per step, predicted on this CPU machine at the seed's sizes.

    OMP_NUM_THREADS=1 python benchmarks/gpu/gpu_estimates.py                  # the table, predicted beside measured
    OMP_NUM_THREADS=1 python benchmarks/gpu/gpu_estimates.py --rows ldm-128 ldm-128-fused --json e.json
    OMP_NUM_THREADS=1 python benchmarks/gpu/gpu_estimates.py --reduce 4       # every size / 4 (the slow test)

Each row runs the GPU benchmark's own step (the function `benchmarks/gpu_round.py` times on the card) on fake tensors
(`FakeTensorMode`: shapes, dtypes and autograd, no data), under bf16 autocast with CUDA's op lists, the device memory
counted as PyTorch's CUDA allocator counts it (`medvol/core/cuda_emulation.py`, the preflight's own). Nothing of the
seed's size is allocated: only the networks' weights, once, on the CPU, before they are made fake. Two steps run (the
second with the optimizer's state); the peak is over both, as `torch.cuda.max_memory_allocated` after the benchmark's
reset. The FLOPs (by `torch.utils.flop_counter.FlopCounterMode`'s formulas) are a third step's. Rows with a figure
measured on a GPU (the 2026-11-27 round on one H200, ../shared/gpu-rounds/) are predicted as that round ran them ("as
measured") and as the code runs them now where that differs.

Not counted: cuDNN's and cuBLAS's workspaces and the allocator's fragmentation (its reserved, not allocated, memory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import table_header  # noqa: E402
from benchmarks.gpu_round import commit  # noqa: E402
from medvol.core.cuda_emulation import (  # noqa: E402
    as_fake,
    cuda_autocast_policy,
    gpu_autocast,
    measured_step,
)

GIB = 2**30
GB = 1e9 / GIB  # one GB in GiB: the targets are in GB
# The card of the measured figures (the 2026-11-27 round): what "out of memory" is held against.
H200_GIB = 139.8
# Step times the round measured on it (s): the CTPA LDM's at 64^3 latents (MONAI's attention), the X-ray-to-CT
# stage 3 step at batch 4. Their rows' FLOPs over these are the rates a GPU ran these networks at.
MEASURED_STEP_S = {"ldm-64": 0.146, "xray2ct-stage3": 0.348}
CPU = torch.device("cpu")
# The CTPA first stage's latent channels (benchmarks/generation/ldm.py's FIRST_STAGE).
FIRST_STAGE_CHANNELS = 8

# What a row's setup returns: every tensor allocated before the benchmark resets its peak (weights, buffers,
# inputs), and one step.
Setup = tuple[list[torch.Tensor], Callable[[], None]]


@dataclass
class Row:
    """A GPU row: its name in the round, the figure measured there (GiB; None: none), its target, and its setup
    (`reduce` divides every spatial size) run under a fake-tensor mode."""

    key: str
    name: str
    measured: float | None
    target: float | None
    setup: Callable[[int, FakeTensorMode], Setup]
    note: str = ""


def module_tensors(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [t for module in modules for t in (*module.parameters(), *module.buffers())]


# ---- the rows' setups: each builds the benchmark's own model and calls the benchmark's own step ------------------


def ldm_setup(latent: int, fused: bool, checkpointing: bool, reduce: int, mode: FakeTensorMode) -> Setup:
    """`benchmarks/generation/ldm.py`'s CTPA training row: encode a (4 x latent)^3 crop, the diffusion loss, backward,
    Adam."""
    from benchmarks.generation import ldm

    module = as_fake(ldm.build("ctpa", CPU, fused, checkpointing), mode)
    with mode:
        optimizer = torch.optim.Adam(module.network.parameters(), lr=1e-4)
        images = torch.randn(1, 1, *[4 * latent // reduce] * 3)
    return [*module_tensors(module), images], partial(ldm.training_step, module, optimizer, images, gpu_autocast)


def ddpm_setup(fused: bool, per_block: bool, low_precision_norm: bool, reduce: int, mode: FakeTensorMode) -> Setup:
    """`benchmarks/generation/ddpm.py memory`'s Fast-DDPM seed step: 128^3, the BraTS seed's network (32-64-128-128,
    attention at the coarsest level), bf16, activation checkpointing; the loss, backward, Adam and the EMA update. The
    round of 2026-11-27 ran MONAI's explicit attention and checkpointed whole down, middle and up blocks
    (`per_block=False`); medvol checkpoints each residual and attention block now, and experiment=fast_ddpm_brats runs
    its GroupNorms in bf16 (`low_precision_norm`)."""
    from benchmarks.generation import ddpm
    from lightning_modules.diffusion.checkpointing import checkpointed

    args = argparse.Namespace(channels=[32, 64, 128, 128], attention=True, groups=32, head_channels=32,
                              explicit_attention=not fused, checkpointing=per_block,
                              low_precision_norm=low_precision_norm)
    module = ddpm.build_module(args)
    if not per_block:
        network = module.network
        for block in [*network.down_blocks, network.middle_block, *network.up_blocks]:
            checkpointed(block)
    module = as_fake(module, mode)
    size = 128 // reduce
    with mode:
        optimizer = torch.optim.Adam(module.network.parameters(), lr=1e-4)
        x0, cond = (torch.rand(1, 1, size, size, size) * 2 - 1 for _ in range(2))
    return [*module_tensors(module), x0, cond], partial(ddpm.training_step, module, optimizer, x0, cond,
                                                        gpu_autocast)


def xray2ct_setup(stage: int, reduce: int, mode: FakeTensorMode) -> Setup:
    """`benchmarks/generation/xray2ct_memory.py --parts train`: stage `stage` of experiment=xray2ct_a100x4 at its seed
    batch (16 / 8 / 4), activation checkpointing as the preset, its earlier stages frozen on the device."""
    from benchmarks.generation import xray2ct_memory

    xray2ct_memory.STAGES[:] = xray2ct_memory.preset_stages([])
    module = xray2ct_memory.build(stage, reduce, True, 10)
    module.log = module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    module = as_fake(module, mode)
    with mode:
        optimizer = torch.optim.Adam(module.network.parameters(), lr=1e-4)
        inputs = xray2ct_memory.training_inputs(module, stage, reduce, xray2ct_memory.STAGES[stage - 1][1], CPU)
    tensors = [*module_tensors(module), *(v for v in inputs.values() if isinstance(v, torch.Tensor))]

    def step() -> None:
        with mock.patch("lightning_modules.xray2ct.module.random_crops", corner_crops):
            xray2ct_memory.training_step(module, optimizer, inputs, gpu_autocast)

    return tensors, step


def corner_crops(volumes: list[torch.Tensor], crop: list[int]) -> list[torch.Tensor]:
    """`lightning_modules.xray2ct.crops.random_crops` as the estimate cuts it: MONAI's SpatialCrop wraps each sample
    in a MetaTensor, which cannot hold a fake tensor. The same allocations (the volumes stacked on channels, then
    the crops stacked), the crop at the corner: where it lies changes no memory."""
    channels = [v.shape[1] for v in volumes]
    stacked = torch.cat(list(volumes), dim=1)
    return list(stacked[:, :, : crop[0], : crop[1], : crop[2]].contiguous().split(channels, dim=1))


def segmentation_setup(reduce: int, mode: FakeTensorMode) -> Setup:
    """`benchmarks/segmentation/segmentation.py gpu --nets dynunet --batch 2`: the DynUNet
    experiment=brats_segmentation's plan builds for 128^3 patches (32-320 filters, deep supervision), 4 channels, 3
    regions, AdamW."""
    from benchmarks.segmentation import segmentation

    size = 128 // reduce
    module = as_fake(segmentation.planned_segmenter("dynunet", size), mode)
    with mode:
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        image = torch.randn(2, 4, size, size, size)
        target = (torch.rand(2, 3, size, size, size) > 0.9).to(torch.uint8)
    return [*module_tensors(module), image, target], partial(segmentation.train_steps, module, optimizer, image,
                                                            target, 1, gpu_autocast)


def vqgan_setup(batch: int, reduce: int, mode: FakeTensorMode) -> Setup:
    """`benchmarks/gpu/gpu_vqgan.py --batch B`: the CTPA VQ-GAN (experiment=ctpa_vqgan) on 128^3 patches, the
    generator's step then the discriminators', bf16."""
    from benchmarks.gpu.gpu_vqgan import build_model
    from benchmarks.training.overhead import gan_step

    model = build_model([]).train()
    model.log = model.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    model = as_fake(model, mode)
    size = 128 // reduce
    with mode:
        opt_ae, opt_disc = model.configure_optimizers()
        patches = torch.rand(batch, 1, size, size, size) * 2 - 1

    def step() -> None:
        with gpu_autocast():
            gan_step(model, opt_ae, opt_disc, patches)

    return [*module_tensors(model), patches], step


def ldm_sampling_setup(reduce: int, mode: FakeTensorMode) -> Setup:
    """One denoising call of the CTPA generation's walk (`benchmarks/generation/ldm.py`'s generate row): the EMA-less
    network on a batch of the preset's sampling windows (4 of 64^3 latents, `model.sampling_window_batch_size`), no
    gradient, beside the whole 128x128x152 latent; the walk makes `sampling_calls()` of them."""
    from benchmarks.generation import ldm

    module = as_fake(ldm.build("ctpa", CPU).eval(), mode)
    window, latent = ldm.PRESETS["ctpa"]["window"], ldm.PRESETS["ctpa"]["generate"]
    channels = FIRST_STAGE_CHANNELS
    with mode:
        whole = torch.randn(1, channels, *[s // reduce for s in latent])
        windows = torch.randn(module.sampling_window_batch_size, channels, *[w // reduce for w in window])
        coordinates = torch.rand(windows.shape[0], 3, *windows.shape[2:])
        spacing = torch.ones(windows.shape[0], 3)
        t = torch.full((windows.shape[0],), 500, dtype=torch.long)

    def step() -> None:
        with torch.no_grad(), gpu_autocast():
            module.network_output(module.network, windows, t, spacing=spacing if module.hparams.spacing_conditioning
                                  else None, coordinates=coordinates if module.hparams.position_channels else None)

    return [*module_tensors(module), whole], step


def sampling_calls(reduce: int) -> int:
    """The denoising calls of the CTPA generation's walk: windows a step (MONAI's placement) over the window batch,
    times Fast-DDPM's 10 steps."""
    from benchmarks.generation import ldm
    from medvol.volumes.sliding_window import SlidingWindow

    window = SlidingWindow.of([w // reduce for w in ldm.PRESETS["ctpa"]["window"]], overlap=0.5)
    windows = window.windows([1, 1, *[s // reduce for s in ldm.PRESETS["ctpa"]["generate"]]])
    return -(-windows // 4) * 10


def ldm_decode_setup(reduce: int, mode: FakeTensorMode) -> Setup:
    """The CTPA generation's decoding (`benchmarks/generation/ldm.py`'s generate row): a 128x128x152 latent to
    512x512x608 by depth slabs of 2^26 values, every whole activation on the device (what `model.decode_offload` null
    keeps there when it fits), no gradient, bf16 autocast."""
    from benchmarks.generation import ldm

    module = as_fake(ldm.build("ctpa", CPU, decode_slab_elements=ldm.SLAB_ELEMENTS, decode_offload=False).eval(), mode)
    with mode:
        latent = torch.randn(1, FIRST_STAGE_CHANNELS, *[s // reduce for s in ldm.PRESETS["ctpa"]["generate"]])

    def step() -> None:
        with torch.no_grad(), gpu_autocast():
            module.images(latent)

    return [*module_tensors(module), latent], step


def xray2ct_window_setup(count: int, reduce: int, mode: FakeTensorMode) -> Setup:
    """`count` sampling windows of the whole CT's last stage in one call (`xray2ct_memory.py --parts whole`'s probe):
    the stage's network on 64^3 windows with their condition and coordinates, no gradient, bf16."""
    from benchmarks.generation import xray2ct_memory

    xray2ct_memory.STAGES[:] = xray2ct_memory.preset_stages([])
    stage = len(xray2ct_memory.STAGES)
    module = as_fake(xray2ct_memory.build(stage, reduce, False, 10).eval(), mode)
    edge = 64 // reduce
    with mode:
        x_t, previous = (torch.randn(count, 1, edge, edge, edge) for _ in range(2))
        coordinates = torch.rand(count, 3, edge, edge, edge)
        views = torch.rand(count, len(module.hparams.views), *module.hparams.xray_size)
        t = torch.full((count,), 500, dtype=torch.long)

    def step() -> None:
        with torch.no_grad(), gpu_autocast():
            module.sampling_network(x_t, t, views, previous, coordinates)

    return [*module_tensors(module), x_t, previous, coordinates, views], step


def whole_ct_windows(reduce: int, overlap: float) -> int:
    """The network calls' windows of a whole CT: the first stage whole, each later stage's windows a step, times 10
    steps."""
    from benchmarks.generation import xray2ct_memory
    from medvol.volumes.sliding_window import SlidingWindow

    xray2ct_memory.STAGES[:] = xray2ct_memory.preset_stages([])
    total = 0
    for stage in range(1, len(xray2ct_memory.STAGES) + 1):
        edge, crop = xray2ct_memory.volume_of(stage) // reduce, xray2ct_memory.crop_edge(stage) // reduce
        total += SlidingWindow.of([crop] * 3, overlap=overlap).windows([1, 1, edge, edge, edge])
    return total * 10


ROWS = [
    Row("ldm-64", "CTPA LDM step, 64^3 latents, MONAI's attention, no checkpointing (as measured)", 18.761, None,
        partial(ldm_setup, 64, False, False)),
    Row("ldm-64-fused", "CTPA LDM step, 64^3 latents, fused attention, checkpointing (experiment=ctpa_ldm now)",
        None, None, partial(ldm_setup, 64, True, True)),
    Row("ldm-128", "CTPA LDM step, 128^3 latents, MONAI's attention, no checkpointing (as measured)", None,
        40 * GB, partial(ldm_setup, 128, False, False), "measured: CUDA out of memory asking for 64 GiB at once"),
    Row("ldm-128-fused-only", "CTPA LDM step, 128^3 latents, fused attention, no checkpointing", None, 40 * GB,
        partial(ldm_setup, 128, True, False)),
    Row("ldm-128-fused", "CTPA LDM step, 128^3 latents, fused attention, checkpointing (experiment=ctpa_ldm now)",
        None, 40 * GB, partial(ldm_setup, 128, True, True)),
    *(Row(f"xray2ct-stage{k}", f"X-ray-to-CT stage {k} step, batch {b}", measured, 40 * GB,
          partial(xray2ct_setup, k)) for k, b, measured in ((1, 16, 24.011), (2, 8, 13.080), (3, 4, 7.918))),
    Row("ddpm-seed", "Fast-DDPM seed step 128^3, MONAI's attention, whole-block checkpointing (as measured)", 6.649,
        4 * GB, partial(ddpm_setup, False, False, False)),
    Row("ddpm-seed-blocks", "Fast-DDPM seed step 128^3, fused attention, per-block checkpointing", None, 4 * GB,
        partial(ddpm_setup, True, True, False)),
    Row("ddpm-seed-now", "Fast-DDPM seed step 128^3, the same with GroupNorm in bf16 (experiment=fast_ddpm_brats now)",
        None, 4 * GB, partial(ddpm_setup, True, True, True)),
    Row("segmentation", "planned BraTS segmentation step, DynUNet, batch 2, 128^3", 5.0, None, segmentation_setup,
        "measured 5.0 GiB as the round printed it, one decimal"),
    Row("vqgan-b1", "CTPA VQ-GAN step, 128^3, batch 1", 3.653, None, partial(vqgan_setup, 1)),
    Row("vqgan-b4", "CTPA VQ-GAN step, 128^3, batch 4", 13.909, None, partial(vqgan_setup, 4)),
    Row("ldm-sampling-call", "CTPA generation: one denoising call, 4 windows of 64^3 latents", None, None,
        ldm_sampling_setup, "x the walk's calls: see TFLOP a volume"),
    Row("ldm-decode", "CTPA generation: decoding 128x128x152 -> 512x512x608 by slabs, activations on the device", None,
        None, ldm_decode_setup),
    Row("xray2ct-window-1", "X-ray-to-CT whole CT: one 64^3 window of stage 3 (no gradient)", None, None,
        partial(xray2ct_window_setup, 1)),
    Row("xray2ct-window-2", "X-ray-to-CT whole CT: two 64^3 windows of stage 3 in one call", None, None,
        partial(xray2ct_window_setup, 2)),
]


def estimate(row: Row, reduce: int) -> dict[str, Any]:
    """The row's predicted peak and largest allocation (GiB) over two steps, and a third step's TFLOPs."""
    began = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    tensors, step = row.setup(reduce, mode)
    memory, flops = measured_step(step, tensors, mode)
    return {"peak_gib": memory.peak / GIB, "largest_gib": memory.largest / GIB,
            "tflop": flops.total / 1e12, "seconds": time.perf_counter() - began}


def verdict(row: Row, result: dict[str, Any]) -> str:
    """Whether the row fits: on the round's H200 at all, and within its target."""
    if "error" in result:
        return "-"
    if result["peak_gib"] > H200_GIB:
        return f"out of memory on a {H200_GIB:.0f} GiB H200 (largest single allocation {result['largest_gib']:.1f} GiB)"
    if row.target is None:
        return "fits"
    return f"{'within' if result['peak_gib'] <= row.target else '**over**'} {row.target / GB:.0f} GB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=[row.key for row in ROWS], help="these rows (default: all)")
    parser.add_argument("--reduce", type=int, default=1, help="divide every spatial size by this (the slow test)")
    parser.add_argument("--json", type=Path, help="also write every row's figures to this file")
    args = parser.parse_args()
    rows = [row for row in ROWS if not args.rows or row.key in args.rows]
    results = {}
    print(f"sizes / {args.reduce}; measured: the 2026-11-27 round on one H200 (GiB, torch.cuda.max_memory_allocated)")
    print(table_header([
        "row", "predicted peak (GiB)", "measured (GiB)", "predicted / measured", "largest allocation (GiB)",
        "TFLOP per step", "verdict"
    ]))
    with cuda_autocast_policy():
        for row in rows:
            try:
                result = estimate(row, args.reduce)
            except Exception as error:  # noqa: BLE001 - one row's failure is that row's figure, not the table's end
                result = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
            results[row.key] = {"name": row.name, "measured_gib": row.measured, "target_gib": row.target, **result}
            if "error" in result:
                print(f"| {row.name} | error: {result['error']} | | | | | |", flush=True)
                continue
            measured = "-" if row.measured is None or args.reduce != 1 else f"{row.measured:.2f}"
            ratio = "-" if measured == "-" else f"{result['peak_gib'] / row.measured:.2f}"
            note = f" ({row.note})" if row.note else ""
            print(f"| {row.name}{note} | {result['peak_gib']:.2f} | {measured} | {ratio} | "
                  f"{result['largest_gib']:.2f} | {result['tflop']:.2f} | {verdict(row, result)} |", flush=True)
    for line in derived(results, args.reduce):
        print(line)
    if args.json:
        # The commit and day they were predicted at: benchmarks/gpu_round.py shows them beside its measurements.
        made = {"commit": commit(), "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
        args.json.write_text(json.dumps({**made, "reduce": args.reduce, "rows": results}, indent=1) + "\n")


def derived(results: dict[str, dict[str, Any]], reduce: int) -> list[str]:
    """What the rows say about whole volumes: the generation's and the whole CT's work, and the seconds it takes at the
    rate the GPU ran the same network's training step (a rough figure: sampling runs no backward pass)."""
    def rate(key: str) -> float | None:
        row = results.get(key, {})
        return row["tflop"] / MEASURED_STEP_S[key] if "tflop" in row and reduce == 1 else None

    lines = []
    call, ldm_rate = results.get("ldm-sampling-call", {}), rate("ldm-64")
    if "tflop" in call:
        calls = sampling_calls(reduce)
        total = calls * call["tflop"]
        at = f"; at the 64^3 LDM step's {ldm_rate:.0f} TFLOP/s on the H200: {total / ldm_rate:.0f} s" if (
            ldm_rate) else ""
        lines.append(f"\nCTPA generation, 10 Fast-DDPM steps: {calls} calls of 4 windows, {total:.0f} TFLOP{at}")
    one, two = results.get("xray2ct-window-1", {}), results.get("xray2ct-window-2", {})
    if "tflop" in one:
        xray_rate = rate("xray2ct-stage3")
        for overlap in (0.0, 0.25, 0.5):
            windows = whole_ct_windows(reduce, overlap)
            total = windows * one["tflop"]
            at = f", {total / xray_rate:.0f} s at the stage-3 step's {xray_rate:.0f} TFLOP/s" if xray_rate else ""
            lines.append(f"whole CT, windows overlapping {overlap}: {windows} windows, {total:.0f} TFLOP{at}")
    if "peak_gib" in one and "peak_gib" in two:
        per_window = two["peak_gib"] - one["peak_gib"]
        batches = ", ".join(f"{int((0.8 * card - one['peak_gib']) // per_window)} on {name}"
                            for name, card in (("an 80 GB H100", 79.1), ("the H200", H200_GIB)))
        lines.append(f"whole CT: {per_window:.2f} GiB a window: window batches sized to 80% of the memory: {batches}")
    return lines


if __name__ == "__main__":
    main()
