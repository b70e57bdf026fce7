"""`GlobalBatchNorm` on one rank's half of a batch equals torch's batch norm on the whole batch.

The other rank is played by a stand-in all-reduce that adds the other half's per-channel sums,
squared sums and count (computed here with numpy): that is what the gloo all-reduce of a
two-rank run returns, without starting two processes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed.nn.functional as dist_functional
from torch import nn

import medvol.core.sync_batchnorm as sync_batchnorm
from medvol.core.sync_batchnorm import GlobalBatchNorm, GlobalBatchNormSync, layer_sync_plugins


def other_rank_stats(other: np.ndarray) -> torch.Tensor:
    """The other rank's [sum per channel, squared sum per channel, values per channel] of an (N, C, ...) half."""
    axes = (0, *range(2, other.ndim))
    count = other.size / other.shape[1]
    return torch.from_numpy(np.concatenate([other.sum(axes), (other**2).sum(axes), [count]])).float()


@pytest.fixture
def two_ranks(monkeypatch):
    """Make GlobalBatchNorm see a two-rank group whose other rank holds `other` (set on the returned dict)."""
    partner: dict[str, np.ndarray] = {}
    monkeypatch.setattr(sync_batchnorm, "_distributed", lambda: True)
    monkeypatch.setattr(dist_functional, "all_reduce", lambda stats: stats + other_rank_stats(partner["other"]))
    return partner


def whole_batch(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 2, 3, 2, generator=generator) * torch.tensor([1.0, 3.0, 0.5]).view(1, 3, 1, 1, 1) + 2


def test_forward_and_running_statistics_equal_batch_norm_over_both_ranks_batches(two_ranks):
    batch = whole_batch()
    two_ranks["other"] = batch[2:].numpy().astype(np.float64)
    reference, synced = nn.BatchNorm3d(3, momentum=0.3), GlobalBatchNorm(3, momentum=0.3)
    expected = reference(batch)[:2]
    out = synced(batch[:2])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Running variance is the unbiased variance of all 4 x 12 values per channel (numpy's ddof=1).
    values = batch.transpose(0, 1).reshape(3, -1).numpy().astype(np.float64)
    np.testing.assert_allclose(synced.running_mean.numpy(), 0.3 * values.mean(1), rtol=1e-5)
    np.testing.assert_allclose(synced.running_var.numpy(), 0.7 + 0.3 * values.var(1, ddof=1), rtol=1e-5)
    assert int(synced.num_batches_tracked) == 1


def test_gradients_through_the_local_half_equal_those_of_batch_norm_on_the_whole_batch(two_ranks):
    batch = whole_batch(seed=1)
    two_ranks["other"] = batch[2:].numpy().astype(np.float64)
    weights = torch.linspace(-1, 1, batch[:2].numel()).view_as(batch[:2])
    local = batch[:2].clone().requires_grad_(True)
    reference_local = batch[:2].clone().requires_grad_(True)
    (GlobalBatchNorm(3)(local) * weights).sum().backward()
    # This rank's loss through the statistics of the whole batch; the other half is a constant here
    # (in a real run the all-reduce's backward adds the other rank's share).
    (nn.BatchNorm3d(3)(torch.cat([reference_local, batch[2:]]))[:2] * weights).sum().backward()
    assert local.grad is not None and reference_local.grad is not None
    assert local.grad.abs().sum() > 0
    torch.testing.assert_close(local.grad, reference_local.grad, atol=1e-5, rtol=1e-4)


def test_outside_a_group_or_in_evaluation_it_is_plain_batch_norm():
    batch = whole_batch(seed=2)
    reference, synced = nn.BatchNorm3d(3), GlobalBatchNorm(3)
    torch.testing.assert_close(synced(batch), reference(batch))
    reference.eval(), synced.eval()
    torch.testing.assert_close(synced(batch), reference(batch))


def test_the_plugin_swaps_every_batch_norm_and_reverts_each_to_its_own_class_with_its_state():
    model = nn.Sequential(nn.Conv3d(1, 2, 1), nn.BatchNorm3d(2), nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    model[1].running_mean.fill_(0.5)
    model[2][1].weight.data.fill_(3.0)
    model.eval()
    swapped = GlobalBatchNormSync().apply(model)
    assert [type(m) for m in swapped.modules() if isinstance(m,
                                                             nn.modules.batchnorm._BatchNorm)] == [GlobalBatchNorm] * 2
    assert not swapped[1].training
    restored = GlobalBatchNormSync().revert(swapped)
    assert type(restored[1]) is nn.BatchNorm3d and type(restored[2][1]) is nn.BatchNorm1d
    assert torch.equal(restored[1].running_mean, torch.full((2,), 0.5))
    assert torch.equal(restored[2][1].weight, torch.full((2,), 3.0))


@pytest.mark.parametrize(("accelerator", "world_size", "plugins", "left"), [
    ("cpu", 2, [GlobalBatchNormSync], False),
    ("cpu", 1, [], False),
    ("gpu", 2, [], True),
])
def test_sync_batchnorm_moves_to_medvols_plugin_only_on_cpu_ranks(accelerator, world_size, plugins, left):
    settings = {"sync_batchnorm": True}
    assert [type(p) for p in layer_sync_plugins(settings, accelerator, world_size)] == plugins
    assert settings["sync_batchnorm"] is left
