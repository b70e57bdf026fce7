"""benchmarks/gpu/gpu_estimates.py and its CUDA emulation: CUDA's autocast policy on CPU tensors, device memory counted
as CUDA's allocator counts it, and (slow) every GPU row estimated at a reduced size, so the estimate cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from medvol.core.cuda_emulation import DeviceMemory, StepFlops, cuda_autocast_policy, gpu_autocast
from tests.conftest import ROOT, subprocess_env


def test_autocast_follows_cudas_op_lists_on_the_cpu_and_only_within():
    x = torch.randn(1, 8, 6, 6, 6)
    weight = torch.randn(8, 8, 3, 3, 3)
    with cuda_autocast_policy(), gpu_autocast():
        y = F.conv3d(x, weight, padding=1)
        # torch.amp's documented CUDA lists: convolutions in bf16; GroupNorm, softmax, mse_loss, pow and sums in
        # float32; ops on neither list (max pooling, which CPU autocast runs in float32) in their input's dtype.
        assert y.dtype == torch.bfloat16
        assert F.group_norm(y, 4).dtype == torch.float32
        assert y.softmax(-1).dtype == torch.float32 and y.sum().dtype == torch.float32
        assert F.mse_loss(y, x).dtype == torch.float32 and (y**2).dtype == torch.float32
        assert F.max_pool3d(y, 2).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # Outside, CPU autocast's own lists again.
        y = F.conv3d(x, weight, padding=1)
        assert F.group_norm(y, 4).dtype == torch.bfloat16 and F.max_pool3d(y, 2).dtype == torch.float32


def test_device_memory_counts_live_storages_in_512_byte_blocks_and_flops_by_torchs_formulas():
    mode = FakeTensorMode()
    memory, flops = DeviceMemory(), StepFlops()
    with mode:
        a = torch.empty(2**20)  # 4 MiB
        b = torch.empty(3, 5, 7)  # 420 bytes: one 512-byte block
    memory.track(a, b)
    assert memory.current == 4 * 2**20 + 512
    with mode, memory, flops:
        c = a * 2
        view = c[:10]  # a view: no new storage, and it keeps c's alive
        del c
        m = torch.randn(64, 32) @ torch.randn(32, 16)
    # a, b and c, then the two operands (8192 and 2048 bytes) and the product (4096).
    assert memory.peak == 2 * 4 * 2**20 + 512 + 8192 + 2048 + 4096
    assert memory.largest == 4 * 2**20 and view.shape == (10,) and m.shape == (64, 16)
    assert flops.total == 2 * 64 * 32 * 16  # a multiply and an add per term


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_gpu_row_is_estimated_at_a_reduced_size_and_fused_attention_holds_no_attention_matrix(tmp_path):
    out = tmp_path / "estimates.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_estimates.py"), "--reduce", "4", "--json", str(out)],
        env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=3600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    failed = {key: row["error"] for key, row in rows.items() if "error" in row}
    assert not failed, failed
    assert all(row["peak_gib"] > 0 and row["tflop"] > 0 for row in rows.values())
    # At 32^3 latents (128 / 4) the coarsest level holds 8^3 = 512 tokens in 16 heads; MONAI's explicit attention
    # keeps a float32 softmax of 512 x 512 x 16 for the backward pass in each of the preset's six attention blocks
    # (two down, one middle, three up). Fused attention keeps none of them.
    matrix = 512 * 512 * 16 * 4 / 2**30
    assert rows["ldm-128"]["peak_gib"] - rows["ldm-128-fused-only"]["peak_gib"] >= 6 * matrix
    # Checkpointing keeps less still.
    assert rows["ldm-128-fused"]["peak_gib"] < rows["ldm-128-fused-only"]["peak_gib"]
    assert "sizes / 4" in done.stdout and "| CTPA LDM step, 128^3 latents" in done.stdout


@pytest.mark.parametrize("low_precision_norm, dtype", [(False, "float32"), (True, "bfloat16")])
def test_the_fast_ddpm_steps_groupnorm_outputs_are_counted_by_dtype_as_cuda_autocast_gives_them(low_precision_norm,
                                                                                                  dtype):
    # The ddpm-seed step's diagnostic (benchmarks/generation/ddpm.py): under CUDA's autocast GroupNorm runs in float32
    # unless the network's norms are LowPrecisionGroupNorm; every norm of the step counted, the checkpointed blocks'
    # recomputations too (each block's two norms run again in the backward pass).
    from argparse import Namespace

    from benchmarks.generation import ddpm

    torch.manual_seed(0)
    args = Namespace(channels=[8, 8], attention=False, groups=4, head_channels=8, explicit_attention=False,
                     checkpointing=True, low_precision_norm=low_precision_norm)
    module = ddpm.build_module(args)
    optimizer = torch.optim.Adam(module.network.parameters())
    x0, cond = torch.rand(1, 1, 8, 8, 8), torch.rand(1, 1, 8, 8, 8)
    norms = sum(isinstance(m, torch.nn.GroupNorm) for m in module.network.modules())
    with cuda_autocast_policy():
        counts = ddpm.norm_output_dtypes(module, lambda: ddpm.training_step(module, optimizer, x0, cond, gpu_autocast))
    assert list(counts) == [dtype]
    # Each norm once forward; those in checkpointed residual blocks once more in the backward pass (the network's
    # closing norm is outside every block).
    assert norms < counts[dtype] < 2 * norms
