"""medvol's OmegaConf resolvers: where a run writes, and values derived from the machine or config.

A fresh run gets `<log_dir>/<name>/runs/<stamp>`, a sweep `<log_dir>/<name>/multiruns/<stamp>/<job>`, where `<name>` is
the model family (`vqgan`, `segmentation`, ...) or the name a preset gives (`task_name`: an experiment's, `debug`) and
`<job>` the job's number and overrides; a resume (`ckpt_path=<run>/checkpoints/x.ckpt`) continues in `<run>`, and
Hydra's record of the resumed invocation goes to a new `.hydra/resume-<stamp>` folder so the original `.hydra/` files
are never overwritten.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from medvol.core.literal_text import literal_names
from medvol.run.world import agreed_stamp

STAMP_ENV = "MEDVOL_RUN_STAMP"
# conf/train.yaml's `task_name`: a run named by no preset, whose folder the model family names.
DEFAULT_TASK = "train"
UNSAFE_IN_FOLDER_NAME = re.compile(r"[^A-Za-z0-9._,=+-]")
# Far below a file system's 255 bytes: a job's folder holds checkpoints named after their epoch and score.
MAX_FOLDER_NAME = 96
_stamp: str | None = None


def run_stamp() -> str:
    """A stamp fixed for the life of the process and shared by all ranks of a run.

    Processes started by this one inherit it through `MEDVOL_RUN_STAMP`; ranks started by
    srun or torchrun agree on one through `medvol.run.world.agreed_stamp`.
    """
    global _stamp
    if _stamp is None:
        _stamp = os.environ.get(STAMP_ENV) or agreed_stamp(datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
        os.environ[STAMP_ENV] = _stamp
    return _stamp


def run_dir_of_checkpoint(ckpt_path: str | None) -> Path | None:
    """The run directory a checkpoint belongs to (`<run>/checkpoints/<file>`, or a cascade's
    `<run>/stage<k>/checkpoints/<file>`), or None."""
    if not ckpt_path:
        return None
    path = Path(str(ckpt_path)).expanduser().resolve()
    # A missing file (a typo) is no resume: the command is refused without touching that run.
    if not path.is_file() or path.parent.name != "checkpoints":
        return None
    run = path.parent.parent
    if (run / ".hydra").is_dir():
        return run
    if re.fullmatch(r"stage\d+", run.name) and (run.parent / ".hydra").is_dir():
        return run.parent
    return None


def folder_name(text: Any) -> str:
    """`text` as one folder name: every character but letters, digits and `. _ , = + -` (a path separator, a space, a
    bracket, a quote, a shell's `*`) becomes `_`, and at most `MAX_FOLDER_NAME` characters are kept."""
    return UNSAFE_IN_FOLDER_NAME.sub("_", str(text))[:MAX_FOLDER_NAME] or "_"


def run_name(task_name: str, family: str) -> str:
    """The folder above a run's `runs/` and `multiruns/`: the model family (`hydra.runtime.choices.model`), or the name
    a preset gives in `task_name` (an experiment's, `debug`); the default `task_name` names nothing."""
    return folder_name(family if str(task_name) == DEFAULT_TASK else task_name)


def sweep_name(task_name: str, family: str, overrides: Any) -> str:
    """`run_name` for a sweep (`overrides`: the command's); a sweep over the model group (`model=a,b`) is named by its
    families (`a+b`).

    Registered with a cache: Hydra gives every job the values its launching process resolved (`OmegaConf.copy_cache`,
    also in a SLURM job), so each job, whichever family it trains, writes into the one sweep folder.
    """
    parser = OverridesParser.create()
    for text in overrides or ():
        try:
            override = parser.parse_override(str(text))
        except Exception:  # noqa: BLE001 - Hydra's grammar errors: Hydra refuses such a command itself
            continue
        if override.key_or_group == "model" and override.is_sweep_override():
            try:
                return run_name(task_name, "+".join(override.sweep_string_iterator()))
            except Exception:  # noqa: BLE001 - a sweep Hydra expands only with the group's options (glob)
                return run_name(task_name, "models")
    return run_name(task_name, family)


def job_folder(num: Any, override_dirname: str) -> str:
    """A sweep job's folder: its number, then its overrides (`hydra.job.override_dirname`, less the keys
    conf/hydra/default.yaml leaves out), as one safe folder name (`folder_name`)."""
    return folder_name(f"{num}_{override_dirname}" if override_dirname else num)


def resolve_run_dir(ckpt_path: str | None, fresh_dir: str) -> str:
    resumed = run_dir_of_checkpoint(ckpt_path)
    return str(resumed) if resumed is not None else fresh_dir


def resolve_output_subdir(ckpt_path: str | None) -> str:
    if run_dir_of_checkpoint(ckpt_path) is not None:
        return f".hydra/resume-{run_stamp()}"
    return ".hydra"


def auto_precision() -> str:
    """bf16-mixed on a GPU that supports it, 16-mixed on an older GPU, full precision on the CPU."""
    import torch

    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


def working_dir() -> str:
    """The command's working directory; resolvable before Hydra's runtime exists (a `-m` sweep's directory)."""
    return os.getcwd()


def gpu_available() -> bool:
    """Whether a CUDA GPU is visible (pinned host memory only helps copies to one)."""
    import torch

    return torch.cuda.is_available()


def synthetic_modalities(role: str, task: str | None) -> list[str]:
    """The synthetic dataset's default channels for `role` (image or cond): a T1 -> T2 pair for translation."""
    if task == "translation":
        return ["t2"] if role == "image" else ["t1"]
    return ["t1"] if role == "image" else []


def batch_per_device(total: int, devices: int, nodes: int = 1) -> int:
    """A total batch split over every device of the job, e.g. 48 over 4 GPUs -> 12 per GPU."""
    from medvol.core.errors import MedvolError

    ranks = int(devices) * int(nodes)
    if ranks < 1 or int(total) % ranks:
        raise MedvolError(
            f"`dataset.batch_size`: a total batch of {total} does not split evenly over {ranks} devices "
            "(trainer.devices x trainer.num_nodes); choose a total divisible by the device count"
        )
    return int(total) // ranks


def label_regions(names: list[str] | None) -> dict[str, list[int]] | None:
    """`dataset.label_regions` (BraTS region names, e.g. [WT, TC, ET]) as the model's `regions`: name -> label values.

    The dataset delivers one binary channel per region, in this order; the segmentation model's
    `regions` follows it, so the two cannot disagree (see docs/segmentation.md).
    """
    from datamodules.sources.brats import REGIONS
    from medvol.core.errors import MedvolError

    if not names:
        return None
    unknown = [str(n) for n in names if str(n) not in REGIONS]
    if unknown:
        raise MedvolError(f"`dataset.label_regions`: unknown region {unknown[0]!r}; expected some of {list(REGIONS)}")
    return {str(name): list(REGIONS[str(name)]) for name in names}


def nnunet_channels(root: str) -> list[str]:
    """The channel files of an nnU-Net raw dataset's (or Decathlon task's) cases, from its dataset.json."""
    from datamodules.sources.nnunet_raw import dataset_channels, read_dataset_json

    folder = Path(str(root)).expanduser()
    return literal_names(dataset_channels(read_dataset_json(folder), folder), f"{folder / 'dataset.json'}")


def background_value(transforms: Any, channels: int) -> list[float]:
    """Per image channel, the value background voxels have in model units: the dataset's transforms say (the low
    end of the output range, 0 without scaling or for an MR z-score); the synthetic phantoms' -1 without transforms."""
    from datamodules.pipeline.transforms import TransformSettings, plain

    if transforms is None:
        return [-1.0] * int(channels)
    return TransformSettings.from_config(plain(transforms)).background(int(channels))


def field_of_view(size: Any, spacing: Any) -> list[float] | None:
    """The millimetres a grid of `size` voxels (an int or three) at `spacing` mm (a number or three) spans per axis;
    None when either is unknown (a dataset at each scan's own spacing)."""
    if size is None or spacing is None:
        return None
    sizes = [size] * 3 if isinstance(size, (int, float)) else list(size)
    steps = [spacing] * 3 if isinstance(spacing, (int, float)) else list(spacing)
    return [float(n) * float(d) for n, d in zip(sizes, steps, strict=True)]


def positive(value: Any) -> bool:
    """Whether `value` is a number above 0 (null: no)."""
    return value is not None and float(value) > 0


# The resolvers that compute a value from their arguments (and at most read a dataset's own description), as opposed
# to the ones that place a Hydra job's output (`run_stamp`, `run_dir`, `output_subdir`, `run_name`, `sweep_name`,
# `job_folder`): the only ones an old run's
# config read from a file may use (`medvol.run.run_record.legacy_record`).
VALUE_RESOLVERS = frozenset({
    "auto_precision", "gpu_available", "cwd", "len", "synthetic_modalities", "batch_per_device", "label_regions",
    "background_value", "field_of_view", "nnunet_channels", "positive",
})


def register_resolvers() -> None:
    """Register medvol's resolvers once; safe to call repeatedly."""
    for name, fn in {
        "run_stamp": run_stamp,
        "run_dir": resolve_run_dir,
        "output_subdir": resolve_output_subdir,
        "run_name": run_name,
        "job_folder": job_folder,
        "auto_precision": auto_precision,
        "gpu_available": gpu_available,
        "cwd": working_dir,
        "len": len,
        "synthetic_modalities": synthetic_modalities,
        "batch_per_device": batch_per_device,
        "label_regions": label_regions,
        "background_value": background_value,
        "field_of_view": field_of_view,
        "nnunet_channels": nnunet_channels,
        "positive": positive,
    }.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
    if not OmegaConf.has_resolver("sweep_name"):
        OmegaConf.register_new_resolver("sweep_name", sweep_name, use_cache=True)


register_resolvers()
