"""How many processes a run uses, who starts them, and the strategy they share.

Three ways to get several ranks, all with the same config:

- medvol starts them (`trainer.devices=N`, one node): see `medvol.run.launch`;
- torchrun or another launcher that sets `LOCAL_RANK`/`RANK`/`WORLD_SIZE`;
- SLURM's `srun` (Lightning's SLURM environment reads `SLURM_PROCID` and friends).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from medvol.core.build import build
from medvol.core.errors import MedvolError

# Lightning's DataParallel strategy is gone; these names get a pointer to DDP instead of a KeyError.
_DATA_PARALLEL_NAMES = {"dp", "data_parallel", "dataparallel"}
_GPU_ACCELERATORS = {"gpu", "cuda"}


@dataclass(frozen=True)
class World:
    """The processes of a run: `devices` per node on `num_nodes` nodes."""

    accelerator: str
    devices: int
    num_nodes: int

    @property
    def size(self) -> int:
        return self.devices * self.num_nodes


def _count_devices(devices: Any, accelerator: str, visible_gpus: int) -> int:
    """Lightning's `devices` value (int, `auto`, `-1`, `"0,1"`, list of ids) as a count."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if text == "auto":
        return max(visible_gpus, 1) if accelerator == "gpu" else 1
    if "," in text:
        return len([part for part in text.split(",") if part.strip()])
    try:
        count = int(text)
    except ValueError as err:
        raise MedvolError(f"`trainer.devices`: got {devices!r}; expected a count, `auto`, -1 or a list of ids") from err
    if count == -1:
        return max(visible_gpus, 1) if accelerator == "gpu" else 1
    if count < 1:
        raise MedvolError(f"`trainer.devices` must be >= 1, `auto` or -1, got {devices!r}")
    return count


# CPU ranks a core may carry: the tests run two ranks on one core; a count past this only exhausts the machine.
CPU_RANKS_PER_CORE = 4


def plan_world(trainer: DictConfig) -> World:
    """The accelerator and process counts the trainer settings ask for, checked against the machine.

    `accelerator: auto` with `devices: auto` takes every visible GPU, or one CPU process when
    there is none; an explicit GPU request on a machine without enough GPUs stops here.
    """
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    requested = str(trainer.get("accelerator", "auto")).lower()
    if requested == "auto":
        accelerator = "gpu" if visible else "cpu"
    elif requested in _GPU_ACCELERATORS:
        accelerator = "gpu"
        if not visible:
            raise MedvolError(
                f"`trainer.accelerator={requested}` but no CUDA GPU is visible; use `hardware=cpu` "
                "or `trainer.accelerator=auto` to fall back to the CPU"
            )
    else:
        accelerator = requested
    devices = _count_devices(trainer.get("devices", 1), accelerator, visible)
    if accelerator == "gpu" and devices > visible:
        raise MedvolError(
            f"`trainer.devices={trainer.get('devices')}` asks for {devices} GPUs but {visible} are visible "
            "(check CUDA_VISIBLE_DEVICES); lower `trainer.devices` or use `trainer.devices=auto`"
        )
    cores = os.cpu_count() or 1
    if accelerator == "cpu" and devices > CPU_RANKS_PER_CORE * cores:
        # Each rank is a process importing torch (~0.5 GiB): a count no CPU run uses, given by a typo or a record.
        raise MedvolError(
            f"`trainer.devices={trainer.get('devices')}` asks for {devices} processes on the CPU; this machine has "
            f"{cores} cores (at most {CPU_RANKS_PER_CORE} ranks a core); lower `trainer.devices`"
        )
    num_nodes = int(trainer.get("num_nodes", 1) or 1)
    if num_nodes < 1:
        raise MedvolError(f"`trainer.num_nodes` must be >= 1, got {num_nodes}")
    return World(accelerator, devices, num_nodes)


def launched_externally() -> bool:
    """True when torchrun, SLURM's srun or medvol's own launcher has already created this rank."""
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return True
    interactive = os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive")
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and not interactive


def global_rank() -> int:
    """This process's rank as set by its launcher (0 before any launcher has run)."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def launched_world_size() -> int | None:
    """How many ranks torchrun or srun started (None when this process was not started by one)."""
    if not launched_externally():
        return None
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_NTASKS" in os.environ:
        return int(os.environ["SLURM_NTASKS"])
    return None


def check_launch(world: World) -> None:
    """Ranks started by a launcher must be the ranks the config asks for; otherwise each would train alone."""
    started = launched_world_size()
    if started is not None and started != world.size:
        raise MedvolError(
            f"the launcher started {started} processes but the config asks for {world.size} "
            f"(`trainer.devices={world.devices}` x `trainer.num_nodes={world.num_nodes}`); make them match "
            "torchrun's --nproc_per_node x --nnodes or srun's --ntasks-per-node x --nodes"
        )


def _strategy_name(cfg: DictConfig | None) -> str:
    if cfg is None:
        return "auto"
    if "_target_" in cfg:
        return str(cfg._target_).rsplit(".", 1)[-1]
    return str(cfg.get("name", "auto"))


def check_strategy(cfg: DictConfig | None, world: World) -> None:
    """Refuse strategies that cannot work, with one line saying what to use instead."""
    name = _strategy_name(cfg).lower()
    if name in _DATA_PARALLEL_NAMES or name == "dataparallelstrategy":
        raise MedvolError(
            "`strategy=dp`: DataParallel is not offered; use `strategy=ddp trainer.devices=N` "
            "(one process per GPU, same config; see docs/multi_gpu.md)"
        )
    if name == "fsdpstrategy" and world.accelerator != "gpu":
        raise MedvolError("`strategy=fsdp` shards the model over GPUs and needs them; use `strategy=ddp` on the CPU")
    if world.num_nodes > 1 and not launched_externally():
        raise MedvolError(
            f"`trainer.num_nodes={world.num_nodes}` needs one launch per node: start the run with "
            "`srun` (SLURM) or `torchrun --nnodes ...` on every node (see docs/multi_gpu.md)"
        )


def starts_own_ranks(cfg: DictConfig | None, world: World) -> bool:
    """True when Lightning would re-run `sys.argv` for ranks 1..N-1, which medvol does itself instead.

    Lightning's script launcher re-executes the command line, so under a Hydra multirun every
    rank would re-run the whole sweep. `start_method: spawn/fork` strategies start their ranks
    in-process and need no help.
    """
    if world.devices < 2 or world.num_nodes > 1 or launched_externally():
        return False
    if cfg is None or "_target_" not in cfg:
        return True
    return str(cfg.get("start_method", "popen")) == "popen"


def build_strategy(cfg: DictConfig | None, world: World, manual_optimization: bool) -> Any:
    """The Lightning strategy for the config.

    `auto` on several devices becomes plain DDP. Manual optimization (the GANs) leaves the
    parameters of the other optimizer out of each backward pass, which DDP only accepts with
    `find_unused_parameters=True`, so DDP gets it for those models without being asked.
    """
    from pytorch_lightning.strategies import DDPStrategy

    if cfg is None or "_target_" not in cfg:
        if world.size < 2:
            return str(cfg.get("name", "auto")) if cfg is not None else "auto"
        return DDPStrategy(find_unused_parameters=manual_optimization)
    is_ddp = issubclass(hydra.utils.get_class(str(cfg._target_)), DDPStrategy)
    if is_ddp and manual_optimization and not cfg.get("find_unused_parameters", False):
        return build(cfg, find_unused_parameters=True)
    return build(cfg)


def agreed_stamp(local: str) -> str:
    """The run stamp all ranks of one launch share, so they write into one run directory.

    Under `srun` every rank sees the same SLURM job (and step) id, which also survives a
    requeue, so a preempted job comes back to its own directory. Under torchrun the ranks
    ask the launcher's key-value store, where the first rank's stamp wins. Otherwise the
    process's own stamp is used (medvol's own ranks inherit it through the environment).
    """
    job = os.environ.get("SLURM_JOB_ID")
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '0')}"
    step = os.environ.get("SLURM_STEP_ID")
    if job and step is not None and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return f"slurm-{job}" if step == "0" else f"slurm-{job}.{step}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ:
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
        )
        agreed = store.compare_set("medvol/run_stamp", "", local)
        return agreed.decode() if isinstance(agreed, bytes) else str(agreed)
    return local


def requeued_checkpoint(output_dir: str) -> str | None:
    """After a SLURM requeue, the run's `checkpoints/last.ckpt` to resume from.

    Lightning saves `hpc_ckpt_<n>.ckpt` into the run directory on SIGUSR1 and resumes from
    it by itself; when the job was requeued without one (killed before the signal, or
    requeued by hand), the last epoch checkpoint is the next best place to continue.
    """
    if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) < 1:
        return None
    run_dir = Path(output_dir)
    if any(run_dir.glob("hpc_ckpt_*.ckpt")):
        return None
    last = run_dir / "checkpoints" / "last.ckpt"
    return str(last) if last.is_file() else None
