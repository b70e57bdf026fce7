"""Digitally reconstructed radiographs (DRRs): the X-ray projector shared by the `xray_ct` dataset and X-ray-to-CT losses.

A DRR here is a parallel-beam line integral of the linear attenuation coefficient, which is
derived from Hounsfield units as mu = mu_water * (1 + HU / 1000), clipped at 0 (air). The
radiograph value is 1 - exp(-integral) (bright bone, dark air). Everything is differentiable,
so a loss can compare the projections of a predicted CT with the input views.
"""

from __future__ import annotations

import torch

# Axis of the (C, x, y, z) RAS volume that each view integrates along.
VIEW_AXES = {"ap": 2, "lateral": 1}
AIR_HU = -1000.0


def drr(hounsfield: torch.Tensor, spacing: float, axis: int, mu_water: float) -> torch.Tensor:
    """One radiograph of a (x, y, z) HU volume: line integrals of attenuation along `axis` (0..2), in [0, 1)."""
    mu = mu_water * (1.0 + hounsfield.float() / 1000.0).clamp(min=0.0)
    path_integral = mu.sum(dim=axis) * spacing
    radiograph = 1.0 - torch.exp(-path_integral)
    return radiograph.flip(-1).T  # rows: z from head (top) to feet
