"""A misspelt key or group option in a command, or an option whose optional packages are not installed, is one
`medvol: error:` line, like every other bad value.

Hydra reports these itself, in several lines and with exit code 1, before medvol runs. The
command's overrides are composed once here first; only a single run's plain `key=value` and
`group=option` overrides are checked (flags such as `-m`, `--help`, `--cfg` and sweep values
are left to Hydra). Options that need one of medvol's extras are checked for every command, sweeps included.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

# Group options that need an extra of pyproject.toml: (group, option) -> (what needs it, its modules, the extra).
EXTRAS = {
    ("hparams_search", "optuna"): ("the Optuna sweeper", ("hydra_plugins.hydra_optuna_sweeper", "optuna"), "sweep"),
    ("hydra/sweeper", "optuna"): ("the Optuna sweeper", ("hydra_plugins.hydra_optuna_sweeper", "optuna"), "sweep"),
    ("hydra/launcher", "slurm"): (
        "the SLURM launcher", ("hydra_plugins.hydra_submitit_launcher", "submitit"), "slurm"
    ),
    ("hydra/launcher", "submitit_slurm"): (
        "the SLURM launcher", ("hydra_plugins.hydra_submitit_launcher", "submitit"), "slurm"
    ),
    ("hydra/launcher", "submitit_local"): (
        "the submitit launcher", ("hydra_plugins.hydra_submitit_launcher", "submitit"), "slurm"
    ),
    ("logger", "wandb"): ("the Weights & Biases logger", ("wandb",), "wandb"),
}


def installed(module: str) -> bool:
    """Whether `module` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def extra_error(argv: Sequence[str]) -> str | None:
    """None unless the command chooses an option whose extra is not installed; then one line naming the extra."""
    for arg in argv:
        group, _, option = arg.lstrip("+~").partition("=")
        need = EXTRAS.get((group, option))
        if need is not None and not all(installed(m) for m in need[1]):
            what, _, extra = need
            return (
                f"`{arg}` needs {what}, which is not installed; install medvol's {extra} extra: "
                f"pip install -e '.[{extra}]'"
            )
    return None


def override_error(config_dir: Path, config_name: str, argv: Sequence[str]) -> str | None:
    """None if the command's overrides compose, else one line saying which override is wrong and why."""
    if any(arg.startswith("-") for arg in argv):
        return None
    overrides = [arg for arg in argv if not arg.lstrip("+~").startswith("hydra")]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir), job_name="train"):
            compose(config_name=config_name, overrides=overrides)
    except MissingConfigException as err:
        group = (err.missing_cfg_file or "").split("/")[0]
        chosen = next((o for o in overrides if o.split("=")[0].lstrip("+~") == group), group)
        options = ", ".join(err.options or [])
        return f"`{chosen}`: no such option in the `{group}` group; expected one of: {options}"
    except ConfigCompositionException as err:
        quoted = re.search(r"'([^']+)'", str(err))
        key = quoted.group(1) if quoted else str(err).splitlines()[0]
        chosen = next((o for o in overrides if o.split("=")[0].lstrip("+~") == key), key)
        reason = str(err.__cause__ or "").splitlines()
        detail = f" ({reason[0]})" if reason else ""
        return (
            f"`{chosen}`: cannot set this key{detail}; `python {config_name}.py --cfg job` lists the keys, "
            "`+key=value` adds one"
        )
    except OverrideParseException as err:
        return (
            f"cannot read the overrides {' '.join(overrides)!r} ({str(err).splitlines()[0]}); "
            "expected key=value or group=option"
        )
    except Exception:  # noqa: BLE001 - anything else is reported by Hydra as usual, when it composes for the run
        return None
    finally:
        GlobalHydra.instance().clear()
    return None
