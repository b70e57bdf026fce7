"""A run's settings, written once as data and read back as data: `<run>/run.json`.

When a run starts training (and a cascade when it starts its stages), rank 0 writes the config it trains with: the
plan applied, every interpolation resolved, every `_target_` a class path, the paths inside the run stored relative
to it. Every reader (predict.py, export.py, a resume, a fold sweep's `run_dir=`, a cascade stage) loads that record,
checks it as data (`medvol.core.file_data.check_data`: bounded, no `${`; the `_target_` allowlist of
`medvol.core.config_targets`; the envelope's schema) and builds from it as it stands: nothing is re-planned or
resolved, so nothing a shared run folder says is evaluated.

A run written before the record (a `.hydra/config.yaml` and a `plan.json` only) is converted on reading by one path,
`legacy_record`: its config's interpolations may use only medvol's own value resolvers and references to other keys
(`LEGACY_RESOLVERS`; `${hydra:...}` only where paths.output_dir asks for the run's folder), its `hydra` node is
dropped unread, it is resolved, the resolved tree is checked as a record is, and its plan (`plan.json`, checked by
its schema) is applied as training applied it. docs/reliability.md describes both.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser
from omegaconf.grammar_parser import parse
from pydantic import BaseModel, ConfigDict, ValidationError

from medvol.core.config_targets import check_file_targets
from medvol.core.errors import MedvolError
from medvol.core.file_data import INTERPOLATION, check_data, read_json, read_yaml
from medvol.run.resolvers import VALUE_RESOLVERS

log = logging.getLogger("medvol")

RECORD_FILE = "run.json"
FORMAT = 1
# What a run's config is made of: the keys a record's config must have.
REQUIRED = ("model", "dataset", "trainer")
# The resolvers an old run's config may use: medvol's value resolvers and OmegaConf's key lookup.
LEGACY_RESOLVERS = VALUE_RESOLVERS | {"oc.select"}


class RelativePath(BaseModel):
    """A config value that is a path inside one of the run's folders: the key, the folder's name, and the rest."""

    model_config = ConfigDict(extra="forbid", strict=True)
    key: list[str | int]
    base: str
    rest: str


class Record(BaseModel):
    """`run.json`: the format, the run's resolved config, its paths inside its folders, and the command's overrides."""

    model_config = ConfigDict(extra="forbid", strict=True)
    medvol_run_record: Literal[1]
    config: dict[str, Any]
    relative_paths: list[RelativePath]
    overrides: list[str]


_DERIVED = re.compile(r"^\$\{paths\.(\w+)\}(/[^$]*)?$")


def _relative_paths(tree: Any, key: list[Any]) -> list[dict[str, Any]]:
    """Every value of the unresolved `tree` that is a path under one of `paths` (`${paths.output_dir}/split.json`), as
    {key, base, rest}: where the run's folders are is the reader's to say."""
    if isinstance(tree, dict):
        return [found for name, value in tree.items() for found in _relative_paths(value, [*key, name])]
    if isinstance(tree, list):
        return [found for index, value in enumerate(tree) for found in _relative_paths(value, [*key, index])]
    derived = _DERIVED.match(tree) if isinstance(tree, str) else None
    if derived is None:
        return []
    return [{"key": key, "base": derived.group(1), "rest": (derived.group(2) or "/").lstrip("/") or "."}]


def record_of(config: dict[str, Any], written: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """The record of a resolved config (a plain tree without its `hydra` node), `written` the same config with its
    interpolations as written."""
    relative = _relative_paths({k: v for k, v in written.items() if k not in ("paths", "hydra")}, [])
    return {"medvol_run_record": FORMAT, "config": config, "relative_paths": relative, "overrides": list(overrides)}


def command_overrides() -> list[str]:
    """The overrides of this Hydra job's command line (none outside a Hydra job)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def write_run_record(cfg: DictConfig) -> Path:
    """Write `cfg` (resolved, without `hydra`) as `<paths.output_dir>/run.json` unless the run has one already (a
    resume keeps the record of its first start); return the file."""
    folder = Path(str(cfg.paths.output_dir))
    path = folder / RECORD_FILE
    if path.is_file():
        return path
    job = OmegaConf.create({key: cfg[key] for key in cfg if key != "hydra"})
    tree = OmegaConf.to_container(job, resolve=True)
    written = OmegaConf.to_container(job, resolve=False)
    assert isinstance(tree, dict) and isinstance(written, dict)
    record = record_of(tree, written, command_overrides())
    from medvol.run.fold_records import write_json

    write_json(path, record)
    return path


def _refused(path: Path, err: ValidationError) -> MedvolError:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "<root>"
    return MedvolError(f"{path}: `{where}` {first['msg'].lower()}; expected a run record written by medvol")


def checked_record(value: Any, source: Path, own: Mapping[str, str] | None = None) -> Record:
    """`value` (read from `source`) as a record: the envelope's schema, plain data, and every `_target_` allowed
    (or the reader's own at that key: `medvol.core.config_targets.own_targets`)."""
    check_data(value, source)
    try:
        record = Record.model_validate(value)
    except ValidationError as err:
        raise _refused(source, err) from None
    missing = [key for key in REQUIRED if not isinstance(record.config.get(key), dict)]
    if missing:
        raise MedvolError(f"{source}: the run's config has no `{missing[0]}` section; expected a run record by medvol")
    check_file_targets(record.config, source, own)
    for override in record.overrides:
        check_override(override, source)
    return record


def read_record(folder: Path, own: Mapping[str, str] | None = None) -> Record | None:
    """The record of the run (or cascade stage) in `folder`, checked; None where it has none."""
    path = folder / RECORD_FILE
    if not path.is_file():
        return None
    return checked_record(read_json(path, "a run record (run.json)"), path, own)


def _set(tree: Any, key: list[str | int], value: Any, source: Path) -> None:
    node = tree
    try:
        for part in key[:-1]:
            node = node[part]
        if isinstance(node, dict) and isinstance(key[-1], str) or isinstance(node, list) and isinstance(key[-1], int):
            node[key[-1]] = value
            return
    except (KeyError, IndexError, TypeError):
        pass
    raise MedvolError(f"{source}: `relative_paths` names {key}, which the run's config does not hold")


def settings(record: Record, paths: dict[str, str], source: Path) -> DictConfig:
    """The record's config with `paths` as this reader's (output_dir: the run's folder now) and every value derived
    from them moved with them."""
    bases = paths
    config = record.config
    for moved in record.relative_paths:
        rest = posixpath.normpath(moved.rest)
        if moved.base not in bases or os.path.isabs(rest) or rest.split("/")[0] == "..":
            raise MedvolError(
                f"{source}: `relative_paths` puts {moved.key} at {moved.base!r}/{moved.rest!r}; expected a path inside "
                f"one of the run's folders ({', '.join(sorted(bases))})"
            )
        _set(config, moved.key, bases[moved.base] if rest == "." else str(Path(bases[moved.base]) / rest), source)
    config["paths"] = dict(paths)
    return OmegaConf.create(config)


def check_override(override: str, source: Path) -> None:
    """Refuse an override recorded in a file that is more than `key=value` or `group=option` of plain values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    problem = None
    if INTERPOLATION in override:
        problem = "holds an interpolation"
    else:
        try:
            parsed = OverridesParser.create().parse_override(override)
        except Exception:  # noqa: BLE001 - Hydra's grammar errors: any means the line is not a plain override
            problem = "is not an override Hydra reads"
        else:
            if parsed.is_sweep_override() or parsed.is_hydra_override() or parsed.key_or_group.startswith("hydra"):
                problem = "is a sweep or sets Hydra itself"
    if problem:
        raise MedvolError(f"{source}: the recorded override {override[:80]!r} {problem}; expected key=value")


def _resolver_names(text: str) -> list[str]:
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext):
            found.append(node.resolverName().getText())
        for index in range(node.getChildCount() if hasattr(node, "getChildCount") else 0):
            walk(node.getChild(index))

    walk(parse(text))
    return found


def _check_legacy_interpolations(tree: Any, source: Path, key: str = "") -> None:
    if isinstance(tree, dict):
        for name, value in tree.items():
            _check_legacy_interpolations(value, source, f"{key}.{name}" if key else str(name))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            _check_legacy_interpolations(value, source, f"{key}[{index}]")
    elif isinstance(tree, str) and INTERPOLATION in tree:
        try:
            names = _resolver_names(tree)
        except Exception:  # noqa: BLE001 - OmegaConf's grammar errors
            raise MedvolError(f"{source}: `{key}` is not a value OmegaConf reads ({tree[:60]!r})") from None
        refused = [name for name in names if name not in LEGACY_RESOLVERS]
        if refused:
            raise MedvolError(
                f"{source}: `{key}` calls the resolver `{refused[0]}` ({tree[:60]!r}); a run's config read from a file "
                f"may only use {', '.join(sorted(LEGACY_RESOLVERS))} and references to its own keys"
            )


def legacy_record(
    config_file: Path, run_dir: Path, paths: dict[str, str], own: Mapping[str, str] | None = None
) -> Record:
    """The record of a run written before `run.json` (its `config_file` and `<run_dir>/plan.json`), converted with the
    same checks as a record; `paths`: the reader's."""
    from medvol.run.planning import with_run_plan

    tree = read_yaml(config_file, "a run's config", interpolations=True)
    if not isinstance(tree, dict):
        raise MedvolError(f"{config_file}: is not a run's config (a mapping of settings)")
    # Hydra's record of how the job ran: medvol builds nothing from it, and nothing may refer to it.
    tree.pop("hydra", None)
    tree["paths"] = {**(tree.get("paths") if isinstance(tree.get("paths"), dict) else {}), **paths}
    _check_legacy_interpolations(tree, config_file)
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except Exception as err:  # noqa: BLE001 - every resolution error means the same: the file is refused
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise MedvolError(f"{config_file}: the run's config does not resolve ({reason})") from None
    check_data(resolved, config_file)
    check_file_targets(resolved, config_file, own)
    planned = OmegaConf.to_container(with_run_plan(OmegaConf.create(resolved), run_dir), resolve=True)
    assert isinstance(planned, dict)
    overrides_file = config_file.parent / "overrides.yaml"
    overrides = read_yaml(overrides_file, "a run's overrides") if overrides_file.is_file() else []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise MedvolError(f"{overrides_file}: is not a list of overrides")
    return checked_record(record_of(planned, tree, overrides), config_file, own)
