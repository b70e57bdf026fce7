"""A compact model summary: parameters per top-level block, only the columns that say something."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelSummary
from rich.console import Console
from rich.table import Table


def block_rows(module: torch.nn.Module) -> list[tuple[str, str, int, int, int]]:
    """(name, type, parameters, trainable parameters, buffer values) per top-level child holding any."""
    rows = []
    for name, child in module.named_children():
        params = sum(p.numel() for p in child.parameters())
        trainable = sum(p.numel() for p in child.parameters() if p.requires_grad)
        buffers = sum(b.numel() for b in child.buffers())
        if params or buffers:
            rows.append((name, type(child).__name__, params, trainable, buffers))
    return rows


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


class BlockSummary(ModelSummary):
    """Replaces Lightning's layer table (30+ rows, a FLOPs column of zeros on most models) by one row per block.

    Columns for trainable parameters and buffers appear only where some parameters are frozen
    or some block holds buffers (e.g. an EMA codebook).
    """

    def __init__(self) -> None:
        super().__init__(max_depth=1)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        rows = block_rows(pl_module)
        frozen = any(trainable != params for _, _, params, trainable, _ in rows)
        buffered = any(buffers for *_, buffers in rows)
        table = Table(title=f"{type(pl_module).__name__}: parameters per block", title_justify="left")
        for column in [
            "block",
            "type",
            "parameters",
            *(["trainable"] if frozen else []),
            *(["buffers"] if buffered else []),
        ]:
            table.add_column(column, justify="left" if column in ("block", "type") else "right")
        for name, kind, params, trainable, buffers in rows:
            extra = ([_count(trainable)] if frozen else []) + ([_count(buffers)] if buffered else [])
            table.add_row(name, kind, _count(params), *extra)
        total = sum(r[2] for r in rows)
        extra = ([_count(sum(r[3] for r in rows))] if frozen else []) + (
            [_count(sum(r[4] for r in rows))] if buffered else []
        )
        table.add_row("total", "", _count(total), *extra, style="bold")
        Console().print(table)
