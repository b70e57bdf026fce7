"""A CT from radiographs in Hounsfield units: the window's linear map for a CT, its scale alone for a spread."""

from __future__ import annotations

import numpy as np
import torch

from medvol.run.radiographs import in_hounsfield

# The 12-bit window of dataset=xray_ct and the A100 preset: its offset is not zero, unlike [-1000, 1000].
WINDOW, OUTPUT_RANGE = (-1024.0, 3071.0), (-1.0, 1.0)


def test_a_ct_takes_the_windows_offset_and_scale_unclamped():
    volume = torch.tensor([-1.0, 0.0, 1.0, 1.5])
    # Hand-worked: -1024 + (v + 1) * 4095 / 2; 1.5 lies beyond the window and is kept (not clamped).
    expected = [-1024.0, 1023.5, 3071.0, 4094.75]
    np.testing.assert_allclose(in_hounsfield(volume, WINDOW, OUTPUT_RANGE, spread=False), expected)


def test_a_spread_takes_the_scale_alone():
    # A std of 0.5 model units is 0.5 * 4095 / 2 HU, whatever the window's offset; zero stays zero.
    np.testing.assert_allclose(
        in_hounsfield(torch.tensor([0.0, 0.5]), WINDOW, OUTPUT_RANGE, spread=True), [0.0, 1023.75]
    )
