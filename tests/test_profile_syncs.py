"""benchmarks/gpu/profile_vqgan.py's count of the calls that make the host wait (issue 61): one per warning of
`torch.cuda.set_sync_debug_mode("warn")`, by the line that made it, the mode put back after. No CUDA here: the mode is
played and the step warns as CUDA's would."""

from __future__ import annotations

import warnings

import torch

from benchmarks.gpu import profile_vqgan


def test_each_synchronizing_call_counts_once_by_its_line_and_the_mode_is_put_back(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step(*args) -> None:
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)

    monkeypatch.setattr(profile_vqgan, "profiled_step", step)
    counts = profile_vqgan.synchronizing_calls(None, None, None, None, steps=2)
    assert list(counts.values()) == [6] and next(iter(counts)).startswith("test_profile_syncs.py:")
    assert modes == ["warn", "default"]
