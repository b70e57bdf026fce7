"""Activation checkpointing for MONAI's `DiffusionModelUNet`, which has none (needed for 128^3 volumes).

Each residual block and each attention block recomputes its activations in the backward pass instead of keeping
them. Checkpointing per block, not per down/up block, keeps the recomputation's own peak to one block: a whole
full-resolution up block recomputed at once holds all of its blocks' activations again at 128^3.
"""

from __future__ import annotations

from typing import Any

import torch
from monai.networks.blocks import SpatialAttentionBlock
from monai.networks.nets.diffusion_model_unet import DiffusionUNetResnetBlock, SpatialTransformer
from torch import nn
from torch.utils.checkpoint import checkpoint

# The blocks that hold the activations: residual blocks, and self- (and cross-) attention blocks.
CHECKPOINTED_BLOCKS = (DiffusionUNetResnetBlock, SpatialTransformer, SpatialAttentionBlock)
_CHECKPOINTED: dict[type, type] = {}


def checkpointed(block: nn.Module) -> None:
    """Make `block` recompute its activations in the backward pass instead of keeping them (in training only).

    The block's class becomes a subclass whose `forward` runs under `torch.utils.checkpoint`, so its
    parameters, state-dict keys and copies (the EMA's deepcopy) stay as they were.
    """
    cls = type(block)
    if cls not in _CHECKPOINTED:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # Under no_grad (validation, sampling) or in eval mode (the EMA copy) recomputation saves nothing.
            if self.training and torch.is_grad_enabled():
                return checkpoint(super(subclass, self).forward, *args, use_reentrant=False, **kwargs)
            return super(subclass, self).forward(*args, **kwargs)

        subclass = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward})
        _CHECKPOINTED[cls] = subclass
    block.__class__ = _CHECKPOINTED[cls]


def checkpoint_unet(network: nn.Module) -> int:
    """Checkpoint every residual and attention block of a MONAI diffusion UNet (or any module holding them); the
    number of blocks checkpointed."""
    blocks = [module for module in network.modules() if isinstance(module, CHECKPOINTED_BLOCKS)]
    for block in blocks:
        checkpointed(block)
    return len(blocks)
