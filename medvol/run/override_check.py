"""A misspelt key or group option in a command, or an option whose optional packages are not installed, is one
`medvol: error:` line, like every other bad value.

Hydra reports these itself, in several lines and with exit code 1, before medvol runs. The
command's overrides are composed once here first, with Hydra's compose API and nothing of medvol that imports torch
or Lightning, so a typo is answered in well under the time `import torch` takes: the `key=value` and `group=option`
overrides are checked, with the closest key or option (`difflib`) as a suggestion; Hydra's flags (`-m`, `--help`,
`--cfg`) and sweep values are left to Hydra. Options that need one of medvol's extras are checked for every command,
sweeps included. A `+key=value` that gives a class an argument it does not take is checked once the classes may be
imported (`added_argument_error`), still before Hydra makes a run folder.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from difflib import get_close_matches
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf

from medvol.core.errors import MedvolError

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


# Hydra's flags that compose another config or replay a run: such a command is Hydra's to read.
_OTHER_CONFIG = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun",
                 "-sc", "--shell-completion")
# Hydra's flags whose value is the next word of the command, not an override.
_VALUE_FLAGS = {"-c": None, "--cfg": None, "-p": None, "--package": None,
                "-i": ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"),
                "--info": ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")}
HELP_FLAGS = ("-h", "--help", "--hydra-help")
_ABSENT = object()


def asks_for_help(argv: Sequence[str]) -> bool:
    """Whether Hydra answers the command with a help text and runs nothing."""
    return any(arg in HELP_FLAGS for arg in argv)


def command_overrides(argv: Sequence[str]) -> list[str] | None:
    """The `key=value` and `group=option` words of a command, Hydra's flags and sweep values left out; None where a
    flag makes Hydra compose another config."""
    overrides: list[str] = []
    words = iter(argv)
    for arg in words:
        flag = arg.split("=", 1)[0]
        if flag in _OTHER_CONFIG:
            return None
        if arg in _VALUE_FLAGS:
            choices = _VALUE_FLAGS[arg]
            value = next(words, None)
            if value is not None and choices is not None and value not in choices:
                overrides.append(value)
            continue
        if not arg.startswith("-") and not arg.lstrip("+~").startswith("hydra"):
            overrides.append(arg)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:
        return overrides  # composing them gives the one-line error
    # Each value of a sweep (`lr=1e-4,3e-4`, `range(...)`) is composed by Hydra for its own job.
    return [o.input_line for o in parsed if not o.is_sweep_override()]


def _composed(config_dir: Path, config_name: str, overrides: Sequence[str]) -> DictConfig | None:
    """The config `overrides` compose, unresolved; None where they do not compose."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir), job_name=config_name):
            return compose(config_name=config_name, overrides=list(overrides))
    except Exception:  # noqa: BLE001 - a config that does not compose has no keys to suggest
        return None
    finally:
        GlobalHydra.instance().clear()


def _dotted_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Every key of `node` and of the nodes below it (not into lists), dotted, without resolving a value."""
    keys = []
    for key in node.keys():
        name = f"{prefix}{key}"
        keys.append(name)
        value = node._get_node(key)
        if isinstance(value, DictConfig) and not value._is_missing() and not value._is_none() \
                and not value._is_interpolation():
            keys += _dotted_keys(value, f"{name}.")
    return keys


def _key_problem(cfg: DictConfig | None, override: str, key: str, config_name: str) -> str:
    """Why `key` cannot be set, with the closest existing key and, where the node it names builds a class (which may
    take arguments the config leaves out) and nothing in that node is close to it, how to add it."""
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if cfg is not None and parent else cfg
    siblings = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    # 0.75: one slip in a short name (`max_epoch`, `fromat`) is close; two names sharing only `_` and a few letters
    # (`enable_progress_bar`, `default_root_dir`) are not.
    close = [f"{parent}.{match}" if parent else match for match in get_close_matches(name, siblings, 1, 0.75)]
    close = close or (get_close_matches(key, _dotted_keys(cfg), 1, 0.75) if cfg is not None else [])
    if not parent:
        where = f"there is no key `{key}`"
    elif siblings:
        where = f"`{parent}` has no key `{name}`"
    else:
        where = f"`{parent}` holds a value, not keys" if node is not None else f"there is no `{parent}`"
    message = f"`{override}`: cannot set this key ({where}); "
    if close:
        message += f"did you mean `{close[0]}`? "
    # A plain settings node or a value takes nothing more, and a name close to a key of the node is a misspelling.
    if siblings and "_target_" in node and not (close and close[0].rpartition(".")[0] == parent):
        message += f"`+{override.lstrip('+~')}` passes {node._get_node('_target_')} an argument the config leaves out; "
    return f"{message}`python {config_name}.py --cfg job` lists the keys"


def override_error(config_dir: Path, config_name: str, argv: Sequence[str]) -> str | None:
    """None if the command's overrides compose, else one line saying which override is wrong, why, and the closest
    key or option. Imports neither torch nor Lightning: a typo is answered before they load."""
    overrides = command_overrides(argv)
    if overrides is None:
        return None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir), job_name=config_name):
            compose(config_name=config_name, overrides=overrides)
    except MissingConfigException as err:
        group, _, option = (err.missing_cfg_file or "").rpartition("/")
        chosen = next((o for o in overrides if o.split("=")[0].lstrip("+~") == group), group)
        options = list(err.options or [])
        close = get_close_matches(option, options, n=1)
        suggestion = f"; did you mean `{group}={close[0]}`?" if close else ""
        return f"`{chosen}`: no such option in the `{group}` group; expected one of: {', '.join(options)}{suggestion}"
    except ConfigCompositionException as err:
        quoted = re.search(r"'([^']+)'", str(err))
        key = quoted.group(1) if quoted else str(err).splitlines()[0]
        chosen = next((o for o in overrides if o.split("=")[0].lstrip("+~") == key), key)
        others = [o for o in overrides if o != chosen]
        cfg = _composed(config_dir, config_name, others) or _composed(config_dir, config_name, [])
        if cfg is not None and OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT:
            return _key_problem(cfg, chosen, key, config_name)
        reason = str(err.__cause__ or "").splitlines()
        detail = f" ({reason[0]})" if reason else ""
        return f"`{chosen}`: cannot set this key{detail}; `python {config_name}.py --cfg job` lists the keys"
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


# Keys Hydra reads itself, never passed to a constructor.
HYDRA_KEYS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")


def added_argument_error(config_dir: Path, config_name: str, argv: Sequence[str]) -> str | None:
    """None unless a `+key=value` of the command adds to a node that builds a class an argument that class does not
    take (Lightning's TypeError, a traceback, once the run has started); then one line with the closest argument.

    Imports the classes named, so it runs after `override_error`, and only reads anything for a command that adds.
    """
    overrides = command_overrides(argv) or []
    added = [o for o in overrides if o.startswith("+")]
    cfg = _composed(config_dir, config_name, overrides) if added else None
    if cfg is None:
        return None
    # Here, not above: the classes bring torch and Lightning, which a typo must be answered without.
    from medvol.core.build import target_class
    from medvol.run.run_check import constructor_settings

    for override in added:
        key = override.lstrip("+").split("=", 1)[0]
        parent, _, name = key.rpartition(".")
        # Hydra's own keys (`+callbacks.mine._target_=...` names the class itself) are no constructor arguments.
        if name in HYDRA_KEYS:
            continue
        node = OmegaConf.select(cfg, parent, default=None) if parent else None
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        target = str(node._get_node("_target_"))
        cls = target_class(target)
        accepted = constructor_settings(cls) if isinstance(cls, type) else None
        if accepted is None or name in accepted:
            continue
        close = get_close_matches(name, sorted(accepted), n=1)
        suggestion = f"; did you mean `{parent}.{close[0]}`?" if close else ""
        return f"`{override}`: {target} takes no argument `{name}`{suggestion}"
    return None


def answer_at_once(
    config_dir: Path, config_name: str, argv: Sequence[str], also: Callable[[Sequence[str]], None] | None = None
) -> None:
    """What an entry point does before Hydra starts: print `--help` (Hydra's text, composed once:
    `medvol.run.command_help`), or refuse a misspelt key or option, a missing extra, or a `+key` its class does not
    take (and what `also` refuses, e.g. a resume of a linked run) in one `medvol: error:` line with exit 2; return
    where the command may run."""
    from medvol.run.command_help import help_text

    text = help_text(config_dir, config_name, argv)
    if text is not None:
        print(text)
        sys.exit(0)
    problem = extra_error(argv) or override_error(config_dir, config_name, argv)
    if not problem and not asks_for_help(argv):
        import medvol.run.resolvers  # noqa: F401 - registers the resolvers the run configs use before Hydra composes

        try:
            problem = added_argument_error(config_dir, config_name, argv)
            if also is not None and not problem:
                also(argv)
        except MedvolError as err:
            problem = str(err)
    if problem:
        print(f"medvol: error: {problem}", file=sys.stderr)
        sys.exit(2)
