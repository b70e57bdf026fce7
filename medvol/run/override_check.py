"""A misspelt key or group option in a command is one `medvol: error:` line, like every other bad value.

Hydra reports these itself, in several lines and with exit code 1, before medvol runs. The
command's overrides are composed once here first; only a single run's plain `key=value` and
`group=option` overrides are checked (flags such as `-m`, `--help`, `--cfg` and sweep values
are left to Hydra).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException


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
