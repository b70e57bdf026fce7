"""GroupNorm in the autocast precision, as MAISI keeps its networks' group norms in half precision.

Under CUDA autocast PyTorch runs `group_norm` in float32: every norm makes a float32 copy of its input and writes a
float32 output, which the SiLU after it keeps too. At 128^3 those copies are most of a Fast-DDPM step's memory
(benchmarks/gpu/gpu_estimates.py: 3.75 of the 5.0 GiB at its peak are the float32 copy, norm and SiLU gradient of the
full-resolution up block's 96-channel input; 3.26 GiB in all with the norms in bf16). Here the norm runs in the
autocast dtype instead; PyTorch's kernels sum its statistics in float32 either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LowPrecisionGroupNorm(nn.GroupNorm):
    """`nn.GroupNorm` that, inside an autocast region, normalises in the autocast dtype (its weights cast to it);
    outside, exactly `nn.GroupNorm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(device)
        weight, bias = (None if p is None else p.to(dtype) for p in (self.weight, self.bias))
        with torch.autocast(device, enabled=False):
            return F.group_norm(x.to(dtype), self.num_groups, weight, bias, self.eps)


def low_precision_group_norms(network: nn.Module) -> int:
    """Make every GroupNorm of `network` a `LowPrecisionGroupNorm` (same parameters and state-dict keys); how many."""
    norms = [module for module in network.modules() if type(module) is nn.GroupNorm]
    for norm in norms:
        norm.__class__ = LowPrecisionGroupNorm
    return len(norms)
