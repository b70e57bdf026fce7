"""`python train.py --help` (predict.py's, export.py's) as Hydra prints it, in a fraction of Hydra's time.

Hydra's own `--help` composes the config again for each of the 120-odd config groups it knows (its own included)
to list their options: about 1.3 s of CPU, as long as `import torch` on a loaded machine. Here the config is composed
once, the application's groups are read from `conf/`'s folders (what Hydra lists for them: every folder holding a
YAML file, outside `hydra/`), and Hydra's help template of the config is filled in the same way. Nothing here
imports torch or Lightning.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf, open_dict

# Flags this help answers; with any other flag (`--resolve`, `--hydra-help`, `-m`) Hydra answers.
HELP_FLAGS = ("-h", "--help")


def config_groups(config_dir: Path) -> str:
    """Hydra's `$APP_CONFIG_GROUPS`: one `group: option, option` line per folder of `config_dir` holding YAML files."""
    groups = {}
    for folder in config_dir.rglob("*"):
        group = folder.relative_to(config_dir).as_posix()
        options = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
        if options and group != "hydra" and not group.startswith("hydra/"):
            groups[group] = options
    return "".join(f"{group}: {', '.join(groups[group])}\n" for group in sorted(groups))


def help_text(config_dir: Path, config_name: str, argv: Sequence[str]) -> str | None:
    """The help Hydra would print for `argv`; None where Hydra should answer (other flags, a config that does not
    compose)."""
    flags = [arg for arg in argv if arg.startswith("-")]
    if not flags or any(flag not in HELP_FLAGS for flag in flags):
        return None
    overrides = [arg for arg in argv if not arg.startswith("-")]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir), job_name=config_name):
            cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
        template = string.Template(str(cfg.hydra.help.template))
    except Exception:  # noqa: BLE001 - Hydra reports it, as for any command
        return None
    finally:
        GlobalHydra.instance().clear()
    with open_dict(cfg):
        del cfg["hydra"]
    return template.safe_substitute(APP_CONFIG_GROUPS=config_groups(config_dir), CONFIG=OmegaConf.to_yaml(cfg))
