"""Every GPU row's peak memory and FLOPs per step, predicted on this CPU machine at the seed's sizes.

    OMP_NUM_THREADS=1 python benchmarks/gpu_estimates.py                  # the table, predicted beside measured
    OMP_NUM_THREADS=1 python benchmarks/gpu_estimates.py --rows ldm-128 ldm-128-fused --json e.json
    OMP_NUM_THREADS=1 python benchmarks/gpu_estimates.py --reduce 4       # every size / 4 (the slow test)

Each row runs the GPU benchmark's own step (the function `benchmarks/gpu_round.py` times on the card) on fake
tensors (`FakeTensorMode`: shapes, dtypes and autograd, no data), under bf16 autocast with CUDA's op lists, the
device memory counted as PyTorch's CUDA allocator counts it (`benchmarks/cuda_emulation.py`). Nothing of the seed's
size is allocated: only the networks' weights, once, on the CPU, before they are made fake. Two steps run (the
second with the optimizer's state); the peak is over both, as `torch.cuda.max_memory_allocated` after the
benchmark's reset. The FLOPs (by `torch.utils.flop_counter.FlopCounterMode`'s formulas) are a third step's. Rows
with a figure measured on a GPU (the 2026-11-27 round on one H200, ../shared/gpu-rounds/) are predicted as that
round ran them ("as measured") and as the code runs them now where that differs.

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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cuda_emulation import (  # noqa: E402
    DeviceMemory,
    HostIntegers,
    StepFlops,
    as_fake,
    cuda_autocast_policy,
    gpu_autocast,
)

GIB = 2**30
GB = 1e9 / GIB  # one GB in GiB: the targets are in GB
# The card of the measured figures (the 2026-11-27 round): what "out of memory" is held against.
H200_GIB = 139.8
CPU = torch.device("cpu")

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
    """`benchmarks/ldm.py`'s CTPA training row: encode a (4 x latent)^3 crop, the diffusion loss, backward, Adam."""
    from benchmarks import ldm

    module = as_fake(ldm.build("ctpa", CPU, fused, checkpointing), mode)
    with mode:
        optimizer = torch.optim.Adam(module.network.parameters(), lr=1e-4)
        images = torch.randn(1, 1, *[4 * latent // reduce] * 3)
    return [*module_tensors(module), images], partial(ldm.training_step, module, optimizer, images, gpu_autocast)


def ddpm_setup(fused: bool, per_block: bool, reduce: int, mode: FakeTensorMode) -> Setup:
    """`benchmarks/ddpm.py memory`'s Fast-DDPM seed step: 128^3, the BraTS seed's network (32-64-128-128, attention
    at the coarsest level), bf16, activation checkpointing; the loss, backward, Adam and the EMA update. The round
    of 2026-11-27 ran MONAI's explicit attention and checkpointed whole down, middle and up blocks
    (`per_block=False`); medvol checkpoints each residual and attention block now."""
    from benchmarks import ddpm
    from lightning_modules.diffusion.checkpointing import checkpointed

    args = argparse.Namespace(channels=[32, 64, 128, 128], attention=True, groups=32, head_channels=32,
                              explicit_attention=not fused, checkpointing=per_block)
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
    """`benchmarks/xray2ct_memory.py --parts train`: stage `stage` of experiment=xray2ct_a100x4 at its seed batch
    (16 / 8 / 4), activation checkpointing as the preset, its earlier stages frozen on the device."""
    from benchmarks import xray2ct_memory

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
    """`benchmarks/segmentation.py gpu --nets dynunet --batch 2`: the DynUNet experiment=brats_segmentation's plan
    builds for 128^3 patches (32-320 filters, deep supervision), 4 channels, 3 regions, AdamW."""
    from benchmarks import segmentation

    size = 128 // reduce
    module = as_fake(segmentation.planned_segmenter("dynunet", size), mode)
    with mode:
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        image = torch.randn(2, 4, size, size, size)
        target = (torch.rand(2, 3, size, size, size) > 0.9).to(torch.uint8)
    return [*module_tensors(module), image, target], partial(segmentation.train_steps, module, optimizer, image,
                                                            target, 1, gpu_autocast)


def vqgan_setup(batch: int, reduce: int, mode: FakeTensorMode) -> Setup:
    """`benchmarks/gpu_vqgan.py --batch B`: the CTPA VQ-GAN (experiment=ctpa_vqgan) on 128^3 patches, the generator's
    step then the discriminators', bf16."""
    from benchmarks.gpu_vqgan import build_model
    from benchmarks.overhead import gan_step

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
        4 * GB, partial(ddpm_setup, False, False)),
    Row("ddpm-seed-now", "Fast-DDPM seed step 128^3, fused attention, per-block checkpointing (now)", None, 4 * GB,
        partial(ddpm_setup, True, True)),
    Row("segmentation", "planned BraTS segmentation step, DynUNet, batch 2, 128^3", 5.0, None, segmentation_setup,
        "measured 5.0 GiB as the round printed it, one decimal"),
    Row("vqgan-b1", "CTPA VQ-GAN step, 128^3, batch 1", 3.653, None, partial(vqgan_setup, 1)),
    Row("vqgan-b4", "CTPA VQ-GAN step, 128^3, batch 4", 13.909, None, partial(vqgan_setup, 4)),
]


def estimate(row: Row, reduce: int) -> dict[str, Any]:
    """The row's predicted peak and largest allocation (GiB) over two steps, and a third step's TFLOPs."""
    began = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memory = DeviceMemory()
    tensors, step = row.setup(reduce, mode)
    memory.track(*tensors)
    memory.reset_peak()
    with mode, HostIntegers(), memory:
        step()
        step()
    flops = StepFlops()
    with mode, HostIntegers(), flops:
        step()
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
    print("| row | predicted peak (GiB) | measured (GiB) | predicted / measured | largest allocation (GiB) | "
          "TFLOP per step | verdict |")
    print("|---|---|---|---|---|---|---|")
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
    if args.json:
        args.json.write_text(json.dumps({"reduce": args.reduce, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
