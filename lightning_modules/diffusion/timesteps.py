"""Timestep sets: the steps a Fast-DDPM model trains on and its sampler walks (uniform, non-uniform, explicit).

Fast-DDPM's reference code builds its uniform set as `arange(-1, 1000, 1000 // T)` with the
first entry set to 0, which has T + 1 entries for T = 10 (0, 99, 199, ..., 999). medvol's sets
have exactly T entries: uniform is `round(linspace(0, 999, T))` (both ends kept, as in the
non-uniform set); non-uniform for T = 10 is the paper's hard-coded set, for other T it takes
int(0.4 T) steps from [0, 699) and the other T - int(0.4 T) from [699, 999], as the reference does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from medvol.core.errors import MedvolError

SPACINGS = ("uniform", "non_uniform")
PAPER_NON_UNIFORM_10 = (0, 199, 399, 599, 699, 799, 849, 899, 949, 999)


def uniform_set(count: int, num_train_timesteps: int = 1000) -> list[int]:
    """`count` evenly spaced steps from 0 to num_train_timesteps - 1 (count = num_train_timesteps: every step)."""
    if count == 1:
        return [num_train_timesteps - 1]
    step = (num_train_timesteps - 1) / (count - 1)
    return [int(round(i * step)) for i in range(count)]


def non_uniform_set(count: int, num_train_timesteps: int = 1000) -> list[int]:
    """Fast-DDPM's non-uniform set: 40% of the steps in the low-noise part [0, 699), 60% in [699, 999]."""
    if count == 10 and num_train_timesteps == 1000:
        return list(PAPER_NON_UNIFORM_10)
    # The reference's split point (699 of 1000), scaled for other chain lengths.
    split = round(0.7 * num_train_timesteps) - 1
    low = int(0.4 * count)
    high = count - low
    low_steps = [math.ceil(v) for v in torch.linspace(0, split, low + 1, dtype=torch.float64)[:-1].tolist()]
    high_steps = [
        math.ceil(v) for v in torch.linspace(split, num_train_timesteps - 1, high, dtype=torch.float64).tolist()
    ]
    return low_steps + high_steps


def check_timesteps(values: Sequence[int], num_train_timesteps: int, key: str) -> list[int]:
    """The set as ints, or a `MedvolError` naming `key` if it is empty, unsorted, repeats or leaves [0, T)."""
    steps = [int(v) for v in values]
    if not steps:
        raise MedvolError(f"`{key}` is empty; expected at least one step in [0, {num_train_timesteps})")
    if len(set(steps)) != len(steps):
        repeated = sorted({s for s in steps if steps.count(s) > 1})
        raise MedvolError(
            f"`{key}` repeats steps {repeated} (set {steps}); expected distinct steps, e.g. fewer of them"
        )
    if steps != sorted(steps):
        raise MedvolError(f"`{key}` is not sorted: {steps}; expected increasing steps")
    if steps[0] < 0 or steps[-1] >= num_train_timesteps:
        raise MedvolError(
            f"`{key}` leaves [0, {num_train_timesteps}): {steps}; expected steps in [0, {num_train_timesteps})"
        )
    return steps


def timestep_set(
    timesteps: int | Sequence[int],
    spacing: str = "non_uniform",
    num_train_timesteps: int = 1000,
    key: str = "model.timesteps",
) -> torch.Tensor:
    """The checked set as a sorted int64 tensor: T steps with `spacing`, or an explicit list of steps."""
    if isinstance(timesteps, int):
        if timesteps < 1 or timesteps > num_train_timesteps:
            raise MedvolError(f"`{key}` must be in [1, {num_train_timesteps}], got {timesteps}")
        if spacing == "uniform":
            values = uniform_set(timesteps, num_train_timesteps)
        elif spacing == "non_uniform":
            values = non_uniform_set(timesteps, num_train_timesteps)
        else:
            raise MedvolError(
                f"`{key.rsplit('.', 1)[0]}.timestep_spacing`: got {spacing!r}; expected one of {list(SPACINGS)}"
            )
    else:
        values = list(timesteps)
    return torch.tensor(check_timesteps(values, num_train_timesteps, key), dtype=torch.long)


def antithetic_indices(batch_size: int, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices into a set of `count` steps: half the batch i, the other half count - 1 - i (Fast-DDPM's pairs)."""
    half = torch.randint(0, count, ((batch_size + 1) // 2,), generator=generator)
    return torch.cat([half, count - 1 - half])[:batch_size]
