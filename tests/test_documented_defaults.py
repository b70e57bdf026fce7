"""Every default the guides state is the one conf/ holds (issue 49): the test reads the statement from the guide and
the value from the composed config; no value is written here.

Statements found: tables with a `default` column (and columns naming an `experiment=`), option tables marking one
`(default)`, and sentences of the shapes `` `key`, default value ``, `` `key=value` (the default) ``,
`` the default (`key: value`) ``, plus the few sentences `STATEMENTS` names by pattern.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from medvol.run.resolvers import run_name
from tests.doc_commands import DOCS, ROOT
from tests.doc_world import composed

# The config a guide's keys belong to: its root config and the overrides that choose its family.
CONTEXT = {
    "docs/predict.md": ("predict", ()),
    "docs/export.md": ("export", ()),
    "docs/vqgan.md": ("train", ("model=vqgan",)),
    "docs/ddpm.md": ("train", ("model=ddpm",)),
    "docs/ldm.md": ("train", ("model=ldm",)),
    "docs/segmentation.md": ("train", ("model=segmentation",)),
    "docs/survival.md": ("train", ("model=survival",)),
    "docs/xray2ct.md": ("train", ("model=xray2ct",)),
}
# Where a bare key of a guide may live, tried in this order.
PREFIXES = ("", "model.", "dataset.transforms.", "dataset.")
# Sentences of other shapes: (guide, pattern whose named groups are the values, group -> key, overrides).
STATEMENTS = [
    ("docs/data.md", r"The defaults are (?P<n>\d+) subjects of (?P<s>\d+)\^3 voxels at (?P<mm>\d+) mm",
     {"n": "dataset.num_subjects", "s": "dataset.size", "mm": "dataset.spacing"}, ()),
    ("docs/data.md", r"`dataset\.cache_budget` is a fraction[^;]*; default `(?P<v>[\d.]+)`",
     {"v": "dataset.cache_budget"}, ()),
    ("docs/data.md", r"`percentiles` \[(?P<v>[\d., ]+)\]", {"v": "dataset.transforms.percentiles"},
     ("dataset=nifti", "dataset.root=x")),
    ("docs/multi_gpu.md", r"an Optuna TPE study of (?P<v>\d+) trials", {"v": "hydra.sweeper.n_trials"},
     ("hparams_search=optuna",)),
    ("docs/ldm.md", r"`model\.decode_quantized`,\s+default `(?P<v>\w+)`", {"v": "model.decode_quantized"},
     ("model=ldm",)),
]
SENTENCES = [
    # `key`, default value / `key` defaults to value / `key=a|b`, default a
    r"`(?P<key>[\w.]+)(?:=[\w|]+)?`,? (?:default|defaults to)\s+`?(?P<value>[^`,;)\s]+)`?",
    # `key=value` (the default) / `key=value`, the default / `key=value` (the CPU default)
    r"`(?P<key>[\w.]+)=(?P<value>[^`]+)`,? \(?the (?:CPU )?default\)?",
    # the default `key: value` / the default, `key: value` / The default window (`key: value`)
    r"[Tt]he default[^`.]{0,12}\(?`(?P<key>[\w.]+): (?P<value>[^`]+)`",
    # `key=` `value` (default)
    r"`(?P<key>[\w.]+)=`\s+`(?P<value>\w+)` \(default\)",
]


def guide(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def config(root: str, overrides: tuple[str, ...]) -> DictConfig:
    return composed(root, list(overrides))


def parse(text: str):
    text = text.strip().strip("`")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def same(stated, actual) -> bool:
    if isinstance(actual, (list, tuple)) or OmegaConf.is_list(actual):
        stated = stated if isinstance(stated, list) else [parse(v) for v in str(stated).strip("[]").split(",")]
        return len(stated) == len(actual) and all(same(s, a) for s, a in zip(stated, actual, strict=True))
    if isinstance(actual, bool) or isinstance(stated, bool):
        return stated == actual
    if isinstance(actual, (int, float)):
        try:
            return abs(float(stated) - float(actual)) <= 1e-12 * max(1.0, abs(float(actual)))
        except (TypeError, ValueError):
            return False
    return str(stated) == str(actual) or (stated is None and actual in ("???", None))


def value_of(cfg: DictConfig, key: str):
    """(the key's resolved value, its value as written) in `cfg`, or None if it has no such key."""
    for prefix in PREFIXES:
        full = prefix + key
        parent, _, leaf = full.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if isinstance(node, DictConfig) and leaf in node:
            written = node._get_node(leaf)._value()  # noqa: SLF001 - the interpolation as written, `${...}`
            return OmegaConf.select(cfg, full, throw_on_missing=False), written
    return None


def group_choice(cfg: DictConfig, group: str) -> str | None:
    return cfg.hydra.runtime.choices.get(group)


def tables(text: str):
    """(header cells, rows of cells, the heading above) of every Markdown table."""
    lines, heading = text.splitlines(), ""
    k = 0
    while k < len(lines):
        if lines[k].startswith("#"):
            heading = lines[k]
        if lines[k].startswith("|") and k + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[k + 1]):
            header = [c.strip() for c in lines[k].strip("|").split("|")]
            rows = []
            k += 2
            while k < len(lines) and lines[k].startswith("|"):
                rows.append([c.strip() for c in lines[k].strip("|").split("|")])
                k += 1
            yield header, rows, heading
            continue
        k += 1


def table_statements(path: Path):
    """(where, key, stated value, root, overrides) from the default columns of a guide's tables."""
    root, overrides = CONTEXT.get(guide(path), ("train", ()))
    if "conf/model/vqgan.yaml" in path.read_text():
        root, overrides = "train", ("model=vqgan",)
    for header, rows, _ in tables(path.read_text()):
        columns = [(i, overrides) for i, h in enumerate(header) if h.lower() == "default"]
        columns += [(i, (*overrides, f"experiment={m.group(1)}")) for i, h in enumerate(header)
                    for m in [re.search(r"`experiment=(\w+)`", h)] if m]
        for column, context in columns:
            for row in rows:
                keys = re.findall(r"`([\w.]+)`", row[0])
                cell = re.sub(r"`\$\{[^`]*\}`:?", "", row[column])
                cell = re.sub(r"\([^)]*\)", "", cell).strip()
                if not keys or not cell or "=" in row[0]:
                    continue
                single = re.match(r"\[[^\]]*\]|\S+", cell).group(0)  # a list, or the first word
                values = re.split(r"\s*/\s*|,\s+", cell) if len(keys) > 1 else [single]
                # One value for several keys: each has it (`authors`, `copyright` | null).
                values = values * len(keys) if len(values) == 1 else values
                assert len(values) == len(keys), f"{guide(path)}: cannot pair {keys} with {row[column]!r}"
                for key, value in zip(keys, values, strict=True):
                    yield f"{guide(path)} table row {row[0]}", key, value, root, context


def option_statements(path: Path):
    """(where, group, option) for every `option` (default) row of a table of a group's options."""
    for header, rows, heading in tables(path.read_text()):
        group = re.search(r"\(`([\w/]+)=`\)", heading)
        key = re.fullmatch(r"`([\w.]+)`", header[0])
        for row in rows:
            m = re.fullmatch(r"`(\w+)` \(default\)", row[0])
            if m:
                assert group or key, f"{guide(path)}: {row[0]} names no group (heading `(group=)` or header `key`)"
                yield f"{guide(path)} table {heading or header[0]}", (group or key).group(1), m.group(1)


def sentence_statements(path: Path):
    text = path.read_text()
    root, overrides = CONTEXT.get(guide(path), ("train", ()))
    for pattern in SENTENCES:
        for m in re.finditer(pattern, text):
            if re.fullmatch(r"[A-Z][A-Z0-9_]*", m.group("key")):
                continue  # an environment variable's default (`NNUNET_PYTHON`), not a key of conf/
            line = text[: m.start()].count("\n") + 1
            yield f"{guide(path)}:{line} {m.group(0)!r}", m.group("key"), m.group("value"), root, overrides


def test_every_default_a_guide_states_is_the_configs():
    checked, wrong = 0, []
    for path in DOCS:
        if path.name == "BENCHMARKS.md" or path.parent.name == "benchmarks":
            continue  # measurements: a value there is what a run gave, not a default
        for where, key, value, root, overrides in [*table_statements(path), *sentence_statements(path)]:
            cfg = config(root, tuple(overrides))
            if "." not in key and key in cfg.hydra.runtime.choices:
                actual = group_choice(cfg, key)
                written = actual
            else:
                found = value_of(cfg, key)
                assert found is not None, f"{where}: `{key}` is no key of {root}.yaml with {list(overrides)}"
                actual, written = found
            stated = parse(value)
            if not (same(stated, actual) or same(stated, written)):
                wrong.append(f"{where}: says {value!r}, conf/ has {written!r}")
            checked += 1
        for where, group, option in option_statements(path):
            cfg = config("train", ())
            actual = group_choice(cfg, group) if "." not in group else value_of(cfg, group)[1]
            if actual != option:
                wrong.append(f"{where}: says `{option}` is the default, conf/ has {actual!r}")
            checked += 1
    for name, pattern, keys, overrides in STATEMENTS:
        m = re.search(pattern, (ROOT / name).read_text())
        assert m, f"{name}: the statement {pattern!r} is gone; update STATEMENTS"
        cfg = config("train", tuple(overrides))
        for group, key in keys.items():
            stated = [parse(v) for v in m.group(group).split(",")] if "," in m.group(group) else parse(m.group(group))
            actual, written = value_of(cfg, key)
            if not same(stated, actual):
                wrong.append(f"{name}: {m.group(0)!r} says {m.group(group)!r}, conf/ has {written!r} for {key}")
            checked += 1
    assert not wrong, "\n".join(wrong)
    # The statements the guides hold today: a pattern that stopped matching would check nothing.
    assert checked >= 60, checked


@pytest.mark.parametrize(("stated", "actual", "agrees"), [
    (0.25, 0.25, True), ("3e-4", 0.0003, True), (True, True, True), (None, None, True), ("RAS", "RAS", True),
    (16, 17, False), ([4, 4, 4], [4, 4, 4], True), ("onnx", "bundle", False),
])
def test_a_stated_value_is_compared_as_a_number_a_flag_or_text(stated, actual, agrees):
    assert same(stated, actual) is agrees


def documented_run_folders() -> list[tuple[str, str]]:
    """(where, folder pattern) of the guides' general statements of where runs and sweeps go: the run trees' first
    line, and `Sweeps write ...` / `writes one sweep directory, ...`."""
    found = []
    for name in ("README.md", "docs/monitoring.md", "docs/multi_gpu.md"):
        text = (ROOT / name).read_text()
        found += [(f"{name} run tree", m.group(1)) for m in re.finditer(r"```\n(outputs/\S+/)\n", text)]
        found += [(f"{name}: {m.group(0)[:40]}", m.group(1)) for m in re.finditer(
            r"(?:[Ss]weeps(?: \([^)]*\))? write|writes one sweep directory,)\s+`(outputs/[^`]+)`", text)]
    return found


def test_the_run_and_sweep_folders_the_guides_give_are_where_every_preset_writes(tmp_path, monkeypatch):
    """Issue 49 item 10: README.md and monitoring.md gave `outputs/train/runs` for every run; a preset writes
    under its own `task_name` (`outputs/ldm_cpu/runs/...`). Issue 63: any other run under its model family
    (`outputs/segmentation/runs/...`)."""
    monkeypatch.chdir(tmp_path)
    folders = documented_run_folders()
    assert len(folders) >= 5, folders
    stamp = r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d"
    experiments = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    for overrides in [(), ("model=segmentation",), ("debug=fast",), *((f"experiment={e}",) for e in experiments)]:
        cfg = config("train", overrides)
        for where, pattern in folders:
            kind = "multiruns" if "multiruns" in pattern else "runs"
            made = Path(str(cfg.hydra.run.dir if kind == "runs" else cfg.hydra.sweep.dir)).relative_to(tmp_path)
            folder = run_name(cfg.task_name, cfg.hydra.runtime.choices.model)
            documented = re.escape(pattern.rstrip("/")).replace(re.escape("<family>"), folder)
            documented = re.sub(r"\\<[^>]*\\>|<[^>]*>", lambda _: stamp, documented)
            documented = documented.split(stamp)[0] + stamp
            assert re.fullmatch(documented, str(made)), f"{where} says {pattern}; {overrides or 'train'} writes {made}"
