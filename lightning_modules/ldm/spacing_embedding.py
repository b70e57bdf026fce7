"""Spacing conditioning as MAISI does it: a learned embedding of the voxel spacing joins the time embedding.

MAISI's `DiffusionModelUNetMaisi` concatenates an MLP embedding of the (x, y, z) spacing to the time
embedding that every residual block projects onto its channels; a sum of projections is a projection of
the sum, so adding the embedding to the time embedding conditions every block alike. MONAI's
`DiffusionModelUNet` adds its class embedding to the time embedding (`emb = emb + class_embedding(class_labels)`)
before any block: with its class embedding replaced by the spacing MLP and the spacing given as the class
labels, the spacing reaches every residual block of every level, attention or not. (A single cross-attention
token, this module's predecessor, reached only the attention levels, and there as a softmax over one key: a
constant vector per sample.)
"""

from __future__ import annotations

from monai.networks.nets import DiffusionModelUNet
from torch import nn

SPACING_DIMS = 3


class SpacingEmbedding(nn.Sequential):
    """(B, 3) voxel sizes in mm -> (B, dim): Linear, SiLU, Linear (MAISI's embedding module)."""

    def __init__(self, dim: int) -> None:
        super().__init__(nn.Linear(SPACING_DIMS, dim), nn.SiLU(), nn.Linear(dim, dim))


def with_spacing_embedding(unet: DiffusionModelUNet) -> DiffusionModelUNet:
    """`unet` (built with `num_class_embeds`) with its class embedding replaced by a `SpacingEmbedding` of the time
    embedding's width: call it with `class_labels=<(B, 3) spacing>`."""
    embedding = getattr(unet, "class_embedding", None)
    if not isinstance(embedding, nn.Embedding):
        raise TypeError("spacing conditioning needs a DiffusionModelUNet built with `num_class_embeds`")
    unet.class_embedding = SpacingEmbedding(embedding.embedding_dim)
    return unet
