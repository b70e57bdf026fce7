"""A run's data planned before any rank starts: the datamodule built and its headers checked, the plan made (or read
back: a resume's `plan.json`), a preflight that waited for the plan run on the planned network, `hardware.fit`'s batch
set, and the datamodule built again on the plan's grid; so the ranks this process starts receive the planned config."""

from __future__ import annotations

import pytorch_lightning as pl
from omegaconf import DictConfig

from medvol.core.build import build
from medvol.run.planning import planned
from medvol.run.preflight import Preflight, preflight
from medvol.run.world import World


def planned_data(cfg: DictConfig, world: World, recorded: bool, checked: Preflight) -> tuple[
        DictConfig, pl.LightningDataModule, list[str]] | None:
    """The run's config with its plan (and `hardware.fit`'s batch), its datamodule and the plan's lines; made before
    a rank starts, so the ranks this process starts receive the planned config. A preflight that waited for the plan
    runs here, before the cache is built; None where a named card's preflight ends the run."""
    datamodule: pl.LightningDataModule = build(cfg.dataset)
    if hasattr(datamodule, "preflight"):
        datamodule.preflight()
    named = bool(cfg.get("preflight"))
    # A named card's preflight plans as that card's run would (nnU-Net's GPU budget and filters) and writes no plan.
    cfg, plan_lines = planned(cfg, datamodule, "gpu" if named else world.accelerator, recorded, write=not named)
    if checked.after_planning:
        checked = preflight(cfg, recorded, planned=True)
        if checked.stop:
            return None
    if checked.batch is not None and checked.batch != cfg.dataset.get("batch_size"):
        cfg = cfg.copy()
        cfg.dataset.batch_size = checked.batch
        plan_lines = [*plan_lines, f"hardware.fit: dataset.batch_size={checked.batch}, the largest that fits"]
    if plan_lines:
        datamodule = build(cfg.dataset)
        # The plan's spacing (from the data, or a resumed run's plan.json) makes new grids: checked from the headers.
        if hasattr(datamodule, "preflight"):
            datamodule.preflight()
    return cfg, datamodule, plan_lines
