"""What a run prints before its first step: a few lines that say what it is, in place of the whole config."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from medvol.run.world import World


def split_sizes(datamodule: Any) -> dict[str, int]:
    """Subjects per split (`train`, `val`, `test`) of a datamodule that splits its subjects, else none.

    The split is assigned here as `setup` would assign it (and recorded once, as there): it is the same split.
    """
    if not hasattr(datamodule, "assign_split"):
        return {}
    datamodule.assign_split()
    split = getattr(datamodule, "split", None) or {}
    order = {name: i for i, name in enumerate(("train", "val", "test"))}
    return {name: len(split[name]) for name in sorted(split, key=lambda name: order.get(name, len(order)))}


def start_summary(
    cfg: DictConfig, world: World, sizes: dict[str, int], plan_lines: list[str]
) -> list[str]:
    """The run in a few lines: model family, data and its split, the plan, epochs, precision and devices, the metric
    it is judged by, where it writes (and what it resumes)."""
    family = str(cfg.model._target_)
    seed = f", seed {cfg.seed}" if cfg.get("seed") is not None else ""
    lines = [f"model    {family.rsplit('.', 1)[-1]} <{family}>{seed}"]
    data = f"data     {str(cfg.dataset._target_).rsplit('.', 1)[-1]}"
    if sizes:
        data += f": {sum(sizes.values())} subjects, " + ", ".join(f"{name} {n}" for name, n in sizes.items())
    if cfg.dataset.get("fold") is not None:
        data += f" (fold {cfg.dataset.fold} of {cfg.dataset.get('num_folds')})"
    lines.append(data)
    lines += plan_lines
    epochs = cfg.trainer.get("max_epochs")
    devices = f"{world.devices} {world.accelerator} device{'s' if world.devices > 1 else ''}"
    if world.num_nodes > 1:
        devices += f" x {world.num_nodes} nodes"
    strategy = cfg.get("strategy") or {}
    lines.append(
        f"trainer  {epochs} epoch{'s' if epochs != 1 else ''}, precision {cfg.trainer.get('precision')}, "
        f"{devices}, strategy {strategy.get('name') or str(strategy.get('_target_', 'auto')).rsplit('.', 1)[-1]}"
    )
    if cfg.get("optimized_metric"):
        lines.append(f"monitor  {cfg.optimized_metric} ({cfg.get('optimized_mode', 'max')})")
    lines.append(f"output   {cfg.paths.output_dir}")
    if cfg.get("ckpt_path"):
        lines.append(f"resume   {cfg.ckpt_path}")
    lines.append("config   print_config=true prints it whole; the run's record: .hydra/config.yaml, run.json")
    return lines
