"""Synchronised batch norm for CPU ranks (gloo), where torch's `SyncBatchNorm` refuses to run.

`trainer.sync_batchnorm=true` on GPUs uses torch's CUDA `SyncBatchNorm` through Lightning.
On CPU ranks (debugging a DDP setup, CI) medvol swaps every batch-norm layer for
`GlobalBatchNorm`, which sums the per-channel statistics over all ranks with a
differentiable all-reduce, so forward, backward and running statistics equal those of one
process holding the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_functional
from pytorch_lightning.plugins import LayerSync
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class GlobalBatchNorm(_BatchNorm):
    """Batch norm over the union of all ranks' batches in training; plain batch norm in evaluation."""

    restore_as: type[_BatchNorm] = nn.BatchNorm3d

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of shape (N, C, ...), got {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and _distributed()):
            return super().forward(input)
        x = input.float()
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        count = x.new_tensor([x.numel() / channels])
        # One all-reduce for sums, squared sums and counts; its backward sums the gradients of every rank.
        stats = dist_functional.all_reduce(torch.cat([x.sum(dims), x.pow(2).sum(dims), count]))
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean.pow(2)).clamp_min(0)
        if self.track_running_stats and self.num_batches_tracked is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                unbiased = var * total / (total - 1).clamp_min(1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        shape = (1, channels) + (1,) * (x.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)


def _convert(module: nn.Module, to_global: bool) -> nn.Module:
    """`module` with its batch norms swapped to `GlobalBatchNorm` (or back to their own class), state kept."""
    replacement = module
    if to_global and isinstance(module, _BatchNorm) and not isinstance(module, GlobalBatchNorm):
        replacement = GlobalBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        replacement.restore_as = type(module)
    elif not to_global and isinstance(module, GlobalBatchNorm):
        replacement = module.restore_as(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
    if replacement is not module:
        replacement.load_state_dict(module.state_dict())
        replacement.train(module.training)
    for name, child in module.named_children():
        replacement.add_module(name, _convert(child, to_global))
    return replacement


class GlobalBatchNormSync(LayerSync):
    """Lightning layer-sync plugin: every batch norm becomes a `GlobalBatchNorm` for the run."""

    def apply(self, model: nn.Module) -> nn.Module:
        return _convert(model, to_global=True)

    def revert(self, model: nn.Module) -> nn.Module:
        return _convert(model, to_global=False)


def layer_sync_plugins(settings: dict, accelerator: str, world_size: int) -> list[LayerSync]:
    """Move `sync_batchnorm` from the trainer settings to medvol's plugin where torch's cannot run (CPU ranks)."""
    if not settings.get("sync_batchnorm") or accelerator != "cpu":
        return []
    settings["sync_batchnorm"] = False
    return [GlobalBatchNormSync()] if world_size > 1 else []
