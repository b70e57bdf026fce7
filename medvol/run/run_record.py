"""A run's settings, written once as data and read back as data: `<run>/run.json`.

A record holds what the run chose and the values it trained with, never a class and never where to write:

- `choices`: the config group options of the command (`model: segmentation`, `dataset: nnunet`, ...);
- `values`: the resolved config (the plan applied) without Hydra's keys (`_target_`, `_partial_`, `_args_`, ...),
  without `paths` and without any key medvol's config derives from `paths` (where checkpoints, logs and predictions
  go is the reader's to say);
- `own_classes`: the keys where the training command named a class of the user's own (`+callbacks.mine._target_=`);
- `stage`: a cascade stage's number; `overrides`: the command's plain overrides, for people to read.

Reading one (`read_run`) composes medvol's own config (`conf/`) from the recorded choices and the reader's own
command, then sets each recorded value onto it, checked against the key it replaces: a value that adds a key, holds a
Hydra key or `${`, or changes a key's type is refused in one line. So every class built comes from medvol's `conf/`
or the reader's command line, and every file written lies where the reader's config puts it. A run written before
this format (a `run.json` of format 1, an old `.hydra/config.yaml`) is converted by the same reading: its classes must
be the ones medvol's config builds for its choices (else the reader's command must name them again). docs/reliability.md
describes both.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser
from omegaconf.grammar_parser import parse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from medvol.core.errors import MedvolError
from medvol.core.file_data import INTERPOLATION, check_data, read_json, read_yaml
from medvol.run.resolvers import VALUE_RESOLVERS
from medvol.run.settings_bounds import check_run_settings

log = logging.getLogger("medvol")

RECORD_FILE = "run.json"
FORMAT = 2
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# The config groups of conf/train.yaml a run chooses from; Hydra's own (`hydra/launcher`) are not the run's.
GROUPS = ("model", "dataset", "strategy", "trainer", "hardware", "logger", "callbacks", "paths", "debug", "experiment",
          "hparams_search")
OPTION = re.compile(r"^[A-Za-z0-9_]{1,64}$")
# Keys Hydra reads as instructions (what to build, how): never a value a file may give.
HYDRA_KEYS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")
# Not the run's settings: where this machine keeps things, and Hydra's own node.
NOT_RECORDED = ("hydra", "paths")
# What a run's config is made of: the keys a record's values must have.
REQUIRED = ("model", "dataset", "trainer")
# The resolvers an old run's config may use: medvol's value resolvers and OmegaConf's key lookup.
LEGACY_RESOLVERS = VALUE_RESOLVERS | {"oc.select"}
_ABSENT = object()
# Settings a family restores from its checkpoint whole (the first stage's, the earlier stages'): mappings of values.
FREE_RESTORED = ("first_stage_settings", "previous_settings")


class Record(BaseModel):
    """`run.json`: the format, the run's group choices, its values, the keys of its own classes, its stage."""

    model_config = ConfigDict(extra="forbid", strict=True)
    medvol_run_record: Literal[2]
    choices: dict[str, str | None]
    values: dict[str, Any]
    own_classes: list[str] = Field(max_length=64)
    stage: int | None = Field(default=None, ge=1, le=16)
    overrides: list[str] = Field(max_length=1024)


class OldRecord(BaseModel):
    """`run.json` as medvol wrote it before format 2: the resolved config, `_target_`s and paths included."""

    model_config = ConfigDict(extra="forbid", strict=True)
    medvol_run_record: Literal[1]
    config: dict[str, Any]
    relative_paths: list[Any]
    overrides: list[str]


# -- writing ---------------------------------------------------------------------------------------------------------


def command_overrides() -> list[str]:
    """The overrides of this Hydra job's command line (none outside a Hydra job)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def command_choices() -> dict[str, str | None]:
    """The group options this Hydra job composed (`model: segmentation`, ...); none outside a Hydra job."""
    if not HydraConfig.initialized():
        return {}
    chosen = HydraConfig.get().runtime.choices
    return {group: (None if chosen.get(group) is None else str(chosen.get(group))) for group in GROUPS
            if group in chosen}


def _parsed(override: str) -> Any:
    return OverridesParser.create().parse_override(override)


def _class_keys(override: str) -> list[str]:
    """The keys at which an override names a class (`k._target_=X`, `k={_target_: X}`)."""
    try:
        parsed = _parsed(override)
    except Exception:  # noqa: BLE001 - Hydra's grammar errors: such an override named nothing Hydra composed
        return []
    key = parsed.key_or_group
    if key.endswith("._target_") or key == "_target_":
        return [key[: -len("._target_")] if "." in key else "<root>"]
    value = parsed.value()
    return [key] if isinstance(value, dict) and "_target_" in str(value) else []


def _derived_from_paths(value: Any) -> bool:
    return isinstance(value, str) and "${paths." in value


def recorded_values(resolved: Any, written: Any) -> Any:
    """`resolved` without Hydra's keys and without the values `written` (the same tree as written) derives from
    `paths`."""
    if isinstance(resolved, dict):
        kept = {}
        for name, value in resolved.items():
            as_written = written.get(name) if isinstance(written, dict) else None
            if name in HYDRA_KEYS or _derived_from_paths(as_written):
                continue
            kept[name] = recorded_values(value, as_written)
        return kept
    if isinstance(resolved, list):
        return [recorded_values(v, written[i] if isinstance(written, list) and i < len(written) else None)
                for i, v in enumerate(resolved)]
    return resolved


def record_of(config: dict[str, Any], written: dict[str, Any], choices: Mapping[str, str | None],
              overrides: Sequence[str], stage: int | None = None) -> dict[str, Any]:
    """The record of a resolved config (a plain tree without its `hydra` node), `written` the same config with its
    interpolations as written."""
    own = sorted({key for override in overrides for key in _class_keys(override)})
    values = recorded_values({k: v for k, v in config.items() if k not in NOT_RECORDED}, written)
    return {
        "medvol_run_record": FORMAT, "choices": dict(choices), "values": values, "own_classes": own, "stage": stage,
        "overrides": [o for o in overrides if INTERPOLATION not in o and not _class_keys(o)],
    }


def write_run_record(cfg: DictConfig) -> Path:
    """Write `cfg` (without `hydra`) as `<paths.output_dir>/run.json` unless the run has one already (a resume keeps
    the record of its first start); return the file. A cascade's stage (`<root>/stage<k>`, beside the root's record)
    records its number: its reader composes the stage from the cascade's settings."""
    folder = Path(str(cfg.paths.output_dir))
    path = folder / RECORD_FILE
    if path.is_file():
        return path
    numbered = re.fullmatch(r"stage(\d+)", folder.name)
    in_cascade = numbered and "cascade" not in cfg and (folder.parent / RECORD_FILE).is_file()
    stage = int(numbered.group(1)) if in_cascade and numbered else None
    job = OmegaConf.create({key: cfg[key] for key in cfg if key != "hydra"})
    tree = OmegaConf.to_container(job, resolve=True)
    written = OmegaConf.to_container(job, resolve=False)
    assert isinstance(tree, dict) and isinstance(written, dict)
    record = record_of(tree, written, command_choices(), command_overrides(), stage)
    from medvol.run.fold_records import write_json

    write_json(path, record)
    return path


# -- reading ---------------------------------------------------------------------------------------------------------


def _refused(path: Path, err: ValidationError) -> MedvolError:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "<root>"
    return MedvolError(f"{path}: `{where}` {first['msg'].lower()}; expected a run record written by medvol")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_choices(choices: Mapping[str, Any], source: Path) -> dict[str, str]:
    """The recorded group choices that name an option of medvol's own `conf/`; else one line."""
    checked = {}
    for group, option in choices.items():
        if group not in GROUPS:
            raise MedvolError(f"{source}: `choices.{str(group)[:40]}` is no config group; expected some of {GROUPS}")
        if option is None:
            continue
        if not isinstance(option, str) or not OPTION.match(option) or option not in _options(group):
            raise MedvolError(
                f"{source}: `choices.{group}` is {str(option)[:60]!r}; expected one of {', '.join(_options(group))}"
            )
        checked[group] = option
    return checked


def compose_train(overrides: Sequence[str], paths: Mapping[str, str], source: Path) -> DictConfig:
    """medvol's `train` config composed with `overrides`, without Hydra's node, `paths` the reader's."""
    try:
        if GlobalHydra.instance().is_initialized():
            cfg = compose(config_name="train", overrides=list(overrides))
        else:
            with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="train"):
                cfg = compose(config_name="train", overrides=list(overrides))
    except MedvolError:
        raise
    except Exception as err:  # noqa: BLE001 - Hydra's composition errors, each a reason the choices do not compose
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise MedvolError(f"{source}: the run's choices {list(overrides)} do not compose here ({reason})") from None
    with open_dict(cfg):
        cfg.pop("hydra", None)
        cfg.paths = dict(paths)
    return cfg


def _shown(key: list[Any]) -> str:
    return ".".join(str(part) for part in key) or "<root>"


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple, ListConfig)):
        return "list"
    return "mapping"


def _refuse_hydra_keys(value: Any, key: list[Any], source: Path) -> None:
    """Refuse a Hydra key (`_target_`, ...) anywhere in `value`: a file gives values, never what to build."""
    stack = [(value, key)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            for name, member in item.items():
                if name in HYDRA_KEYS:
                    raise MedvolError(
                        f"{source}: `{_shown([*where, name])}` is a Hydra key; a file read as a run's settings gives "
                        "values only, and the classes come from medvol's config and your command line: refused"
                    )
                stack.append((member, [*where, name]))
        elif isinstance(item, list):
            stack.extend((member, [*where, index]) for index, member in enumerate(item))


def _written(node: DictConfig, name: Any) -> Any:
    child = node._get_node(name)
    return child._value() if child is not None else None


def _path_like(text: str) -> bool:
    return text.startswith(("/", "~", "\\")) or ".." in re.split(r"[/\\]", text)


def _takes_paths(current: Any) -> bool:
    """Whether medvol's config takes a path at a key whose composed value is `current`: a user's path (`???`, null,
    an empty list) or one of its own."""
    if current is _ABSENT or current is None or current == []:
        return True
    if isinstance(current, str):
        return _path_like(current)
    if isinstance(current, (list, ListConfig)):
        return any(isinstance(item, str) and _path_like(item) for item in current)
    return False


def _refuse_paths(value: Any, current: Any, where: list[Any], source: Path) -> None:
    """Refuse a recorded text that leaves a folder (absolute, `~`, a `..` part) where medvol's config has a name, not
    a path: a checkpoint's file name or a logger's folder name never leads out of the run."""
    if _takes_paths(current):
        return
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and _path_like(item):
            raise MedvolError(
                f"{source}: `{_shown(where)}` is {item[:60]!r}, a path out of its folder where medvol's config has a "
                f"name ({str(current)[:60]!r}); a run's record never says where to write: refused"
            )


def overlay(node: DictConfig, values: Mapping[str, Any], key: list[Any], source: Path,
            deferred: list[tuple[DictConfig, Any, Any, list[Any]]], open_keys: Collection[str] = ()) -> None:
    """Set `values` (read from `source`) onto the composed `node`, each checked against the key it replaces: a new key,
    a Hydra key or another type is refused; a key the config derives from `paths` keeps the reader's value; a key it
    writes as another interpolation is `deferred` (`settle_derived`). `open_keys`: the nodes of classes the reader
    names itself, whose settings are the user's own."""
    for name, value in values.items():
        where = [*key, name]
        if name in HYDRA_KEYS:
            _refuse_hydra_keys({name: value}, key, source)
        _refuse_hydra_keys(value, where, source)
        if name not in node.keys():  # `in node` is false for a `???` key
            if len(node) != 0 and _shown(key) not in open_keys:
                raise MedvolError(
                    f"{source}: `{_shown(where)}` is no setting of medvol's config for the run's choices; a run's "
                    "record sets values of the keys medvol's config has, never new ones: refused"
                )
            with open_dict(node):
                node[name] = value
            continue
        written = _written(node, name)
        if _derived_from_paths(written):
            continue
        if isinstance(written, str) and INTERPOLATION in written:
            deferred.append((node, name, value, where))
            continue
        current = None if OmegaConf.is_missing(node, name) else node[name]
        if isinstance(current, DictConfig) and isinstance(value, dict):
            overlay(current, value, where, source, deferred, open_keys)
            continue
        _refuse_paths(value, current, where, source)
        if value is not None and current is not None and _kind(value) != _kind(current):
            raise MedvolError(
                f"{source}: `{_shown(where)}` is {_kind(value)} ({str(value)[:60]}) where medvol's config has "
                f"{_kind(current)}; a run's record keeps each key's type: refused"
            )
        with open_dict(node):
            node[name] = value


def settle_derived(deferred: list[tuple[DictConfig, Any, Any, list[Any]]], source: Path) -> None:
    """A key medvol's config derives from others keeps its interpolation where it gives the recorded value (so a
    cascade's stage, merged in later, still derives it); the recorded value replaces it where it does not (a plan set
    it)."""
    for node, name, value, where in deferred:
        try:
            now = node[name]
            now = OmegaConf.to_container(now, resolve=True) if OmegaConf.is_config(now) else now
        except Exception:  # noqa: BLE001 - an interpolation that cannot resolve here gives no value: the record's does
            now = _ABSENT
        _refuse_paths(value, now, where, source)
        if now != value:
            with open_dict(node):
                node[name] = value


def _target_at(cfg: DictConfig, key: str) -> Any:
    node = cfg if key == "<root>" else OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
    return node.get("_target_") if isinstance(node, DictConfig) else None


def _drop(cfg: DictConfig, key: str) -> None:
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    if isinstance(node, DictConfig) and name in node:
        with open_dict(node):
            node[name] = None


def _pop(values: dict[str, Any], key: str) -> None:
    parent, _, name = key.rpartition(".")
    node: Any = values
    for part in parent.split(".") if parent else []:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(name, None)


def _key(override: str) -> str:
    return _parsed(override).key_or_group.lstrip("+~")


def _stage_base(cfg: DictConfig, stage: int, folder: Path, source: Path) -> DictConfig:
    from medvol.run.cascade import with_stage_settings

    settings = (cfg.get("cascade") or {}).get(f"stage{stage}")
    if settings is None:
        raise MedvolError(f"{source}: `stage` is {stage}, a stage the run's cascade does not configure")
    staged = with_stage_settings(cfg, settings)
    with open_dict(staged):
        del staged["cascade"]
        staged.paths.output_dir = str(folder)
    return staged


def with_run_plan(cfg: DictConfig, folder: Path) -> DictConfig:
    from medvol.run.planning import with_run_plan as planned

    return planned(cfg, folder)


def settled(record: Record, paths: Mapping[str, str], source: Path, command: Sequence[str] = (),
            named: Collection[str] = (), builds_all: bool = False, folder: Path | None = None) -> DictConfig:
    """The run's config: medvol's own composed from the record's choices (and the reader's `command` overrides, which
    win), with the record's values set onto it (`overlay`). `named`: keys where the reader names a class itself;
    `builds_all`: the reader builds the whole run (a resume), so a class of the user's own at any key must be
    named again. `folder`: the run's (or stage's) folder, whose plan.json it trained with (the reader's output folder
    where not given: a test of another run's checkpoint writes elsewhere)."""
    check_data(record.values, source)
    choices = check_choices(record.choices, source)
    typed = {_key(o) for o in command}
    recorded = compose_train([f"{group}={option}" for group, option in choices.items()], paths, source)
    kept = [f"{group}={option}" for group, option in choices.items() if group not in typed]
    chosen = compose_train([*kept, *command], paths, source) if command else recorded
    folder = folder if folder is not None else Path(paths["output_dir"])
    if record.stage is not None:
        recorded, chosen = (_stage_base(c, record.stage, folder, source) for c in (recorded, chosen))
    # The run's plan (plan.json, read by its schema) applied as training applied it: the keys and classes it adds
    # (nnU-Net's transforms, a poly schedule) are medvol's code's, and the record's values then set on them.
    recorded, chosen = (with_run_plan(c, folder) for c in (recorded, chosen))
    missing = [key for key in REQUIRED if not isinstance(record.values.get(key), dict)]
    if missing:
        raise MedvolError(f"{source}: the run's values have no `{missing[0]}` section; expected a run record by medvol")
    values = copy.deepcopy(record.values)
    result = copy.deepcopy(chosen)
    named_again = []
    for key in record.own_classes:
        if str(key) in named or _target_at(chosen, key) not in (None, _target_at(recorded, key)):
            named_again.append(str(key))
            continue
        if builds_all or str(key).split(".")[0] in ("model", "dataset", "<root>"):
            raise MedvolError(
                f"{source}: the run built `{key}` from a class of your own; name it again on this command "
                f"({key}._target_=...): a record never says which class to build"
            )
        # A class this reader never builds (a callback, for predict): its values are of no use here.
        _pop(values, str(key))
        _drop(result, str(key))
    deferred: list[tuple[DictConfig, Any, Any, list[Any]]] = []
    overlay(result, values, [], source, deferred, named_again)
    settle_derived(deferred, source)
    # What this command changes wins over the record: what it types, and what follows from it.
    if command:
        for change_key, value in _changes(_plain(chosen), _plain(recorded), []):
            _set(result, change_key, value)
        for typed_key in typed - set(GROUPS):
            # A group the command names again acts through the comparison above: only what its option changes.
            value = OmegaConf.select(chosen, typed_key, default=_ABSENT, throw_on_resolution_failure=False)
            if value is not _ABSENT and not typed_key.startswith(NOT_RECORDED):
                OmegaConf.update(result, typed_key, value, force_add=True, merge=False)
    check_run_settings(record.values, source, result.model.get("_target_"))
    return result


def _plain(cfg: DictConfig) -> dict[str, Any]:
    tree = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(tree, dict)
    return tree


def _changes(after: Any, before: Any, key: list[str]) -> list[tuple[list[str], Any]]:
    """(key, value) for every value of `after` that differs from `before`; value `...` where `after` drops the key."""
    if isinstance(after, dict) and isinstance(before, dict):
        found = [c for name in after for c in _changes(after[name], before.get(name, ...), [*key, str(name)])]
        return found + [([*key, str(name)], ...) for name in before if name not in after]
    return [] if after == before else [(key, after)]


def _set(cfg: DictConfig, key: list[str], value: Any) -> None:
    if key[0] in NOT_RECORDED:
        return
    with open_dict(cfg):
        node = cfg
        for part in key[:-1]:
            if not isinstance(node.get(part), DictConfig):
                node[part] = {}
            node = node[part]
        if value is ...:
            node.pop(key[-1], None)
        else:
            node[key[-1]] = value


def check_restored(restored: Mapping[str, Any], model: DictConfig, source: Path) -> None:
    """Refuse what a checkpoint's hyper-parameters restore (`MedvolModule.restoring_settings`) where it holds a Hydra
    key or changes the type of the run's `model` key it replaces: a checkpoint gives values, never a class."""
    check_data(dict(restored), source)
    for name, value in restored.items():
        where = ["hyper_parameters", name]
        _refuse_hydra_keys(value, where, source)
        current = model.get(name) if name in model and not OmegaConf.is_missing(model, name) else None
        current = OmegaConf.to_container(current, resolve=True) if OmegaConf.is_config(current) else current
        if value is not None and current is not None and _kind(value) != _kind(current):
            raise MedvolError(
                f"{source}: `{_shown(where)}` is {_kind(value)} ({str(value)[:60]}) where the run's `model.{name}` is "
                f"{_kind(current)}; a checkpoint restores values of the run's types: refused"
            )
        if current is None and _kind(value) == "mapping" and name not in FREE_RESTORED:
            raise MedvolError(
                f"{source}: `{_shown(where)}` is a mapping where the run's `model.{name}` is unset; expected a value"
            )


def checked_record(value: Any, source: Path) -> Record:
    """`value` (read from `source`) as a record: plain data and the envelope's schema."""
    check_data(value, source)
    if isinstance(value, dict) and value.get("medvol_run_record") == 1:
        try:
            old = OldRecord.model_validate(value)
        except ValidationError as err:
            raise _refused(source, err) from None
        return converted(old.config, old.overrides, source, source.parent)
    try:
        record = Record.model_validate(value)
    except ValidationError as err:
        raise _refused(source, err) from None
    for override in record.overrides:
        check_override(override, source)
    return record


def read_record(folder: Path) -> Record | None:
    """The record of the run (or cascade stage) in `folder`, checked; None where it has none."""
    path = folder / RECORD_FILE
    if not path.is_file():
        return None
    return checked_record(read_json(path, "a run record (run.json)"), path)


def check_override(override: str, source: Path) -> None:
    """Refuse an override recorded in a file that is more than `key=value` or `group=option` of plain values."""
    problem = None
    if INTERPOLATION in override:
        problem = "holds an interpolation"
    else:
        try:
            parsed = _parsed(override)
        except Exception:  # noqa: BLE001 - Hydra's grammar errors: any means the line is not a plain override
            problem = "is not an override Hydra reads"
        else:
            if parsed.is_sweep_override() or parsed.is_hydra_override() or parsed.key_or_group.startswith("hydra"):
                problem = "is a sweep or sets Hydra itself"
    if problem:
        raise MedvolError(f"{source}: the recorded override {override[:80]!r} {problem}; expected key=value")


# -- runs written before format 2 -----------------------------------------------------------------------------------


def _option_building(group: str, target: Any) -> str | None:
    """The option of `conf/<group>` whose file builds `target` at its root, where exactly one does."""
    found = []
    for option in _options(group):
        try:
            tree = read_yaml(CONF_DIR / group / f"{option}.yaml", "a config group file", interpolations=True)
        except MedvolError:
            continue
        if isinstance(tree, dict) and tree.get("_target_") == target:
            found.append(option)
    return found[0] if len(found) == 1 else None


def _old_choices(config: Mapping[str, Any], overrides: Sequence[str], source: Path) -> dict[str, str | None]:
    """The group choices of a run written before they were recorded: its command's group overrides, and for the model
    and dataset the option whose file builds the class its config names."""
    choices: dict[str, str | None] = {}
    for override in overrides:
        check_override(override, source)
        parsed = _parsed(override)
        key = parsed.key_or_group
        if key in GROUPS and isinstance(parsed.value(), str) and OPTION.match(parsed.value()):
            choices[key] = parsed.value()
    for group in ("model", "dataset"):
        node = config.get(group)
        if group not in choices and isinstance(node, dict) and isinstance(node.get("_target_"), str):
            option = _option_building(group, node["_target_"])
            if option is not None:
                choices[group] = option
    return choices


def _class_paths(node: Any, key: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        here = [(key or "<root>", node["_target_"])] if "_target_" in node else []
        return here + [found for name, value in node.items()
                       for found in _class_paths(value, f"{key}.{name}" if key else str(name))]
    if isinstance(node, list):
        return [found for index, value in enumerate(node) for found in _class_paths(value, f"{key}[{index}]")]
    return []


def converted(config: dict[str, Any], overrides: Sequence[str], source: Path, folder: Path) -> Record:
    """The format-2 record of a run written before it (its resolved config, `_target_`s included): its classes that
    medvol's config builds for its choices are medvol's; any other is a class of the user's own."""
    check_data(config, source)
    choices = _old_choices(config, overrides, source)
    check_choices(choices, source)
    paths = {name: str(value) for name, value in (config.get("paths") or {}).items()} if isinstance(
        config.get("paths"), dict) else {}
    composed = compose_train([f"{g}={o}" for g, o in choices.items() if o], {**paths, "output_dir": "."}, source)
    composed = with_run_plan(composed, folder)
    own = []
    for key, target in _class_paths({k: v for k, v in config.items() if k not in NOT_RECORDED}):
        if "[" in key:
            raise MedvolError(f"{source}: `{key}` names a class inside a list; expected a run's config by medvol")
        if not isinstance(target, str) or _target_at(composed, key) != target:
            own.append(key)
    written = _plain(composed)
    values = recorded_values({k: v for k, v in config.items() if k not in NOT_RECORDED}, written)
    return Record(medvol_run_record=FORMAT, choices=choices, values=values, own_classes=own, stage=None,
                  overrides=[o for o in overrides if not _class_keys(o)])


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


def legacy_record(config_file: Path, run_dir: Path, paths: dict[str, str]) -> Record:
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
    assert isinstance(resolved, dict)
    _refuse_binders(resolved, config_file)
    planned = OmegaConf.to_container(with_run_plan(OmegaConf.create(resolved), run_dir), resolve=True)
    assert isinstance(planned, dict)
    overrides_file = config_file.parent / "overrides.yaml"
    overrides = read_yaml(overrides_file, "a run's overrides") if overrides_file.is_file() else []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise MedvolError(f"{overrides_file}: is not a list of overrides")
    return converted(planned, overrides, config_file, run_dir)


def _refuse_binders(tree: Any, source: Path, key: str = "") -> None:
    """An old config's `_args_` (Hydra builds its members and hands them on): never medvol's."""
    if isinstance(tree, dict):
        if "_args_" in tree:
            raise MedvolError(f"{source}: `{key or '<root>'}._args_` is a Hydra key medvol's config never writes")
        for name, value in tree.items():
            _refuse_binders(value, source, f"{key}.{name}" if key else str(name))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            _refuse_binders(value, source, f"{key}[{index}]")
