"""Activation checkpointing for MONAI's `DiffusionModelUNet`, which has none (needed for 128^3 volumes)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # Only while building a graph: under no_grad (validation, sampling) recomputation saves nothing.
    if torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    """Recompute each block's activations in the backward pass instead of storing them.

    The block's own `forward` is wrapped in place, so parameter names (and checkpoints) are
    the same with and without checkpointing.
    """
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward)


def unet_blocks(network: nn.Module) -> list[nn.Module]:
    """The down, middle and up blocks of a MONAI `DiffusionModelUNet` (any module with those attributes)."""
    blocks: list[nn.Module] = [*getattr(network, "down_blocks", [])]
    if getattr(network, "middle_block", None) is not None:
        blocks.append(network.middle_block)
    blocks.extend(getattr(network, "up_blocks", []))
    return blocks
