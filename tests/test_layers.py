"""The layers hold: imports point down only and never run in a circle (DESIGN.md, "Where new things go").

    train.py, predict.py, check_data.py, export.py, medvol.run    the run layer
      -> lightning_modules, datamodules, callbacks         the rooms (never each other)
      -> medvol.core, medvol.volumes                       the ground

Every `import` in every module counts, also those inside functions: a lazy import is still a
dependency. Only the standard library's `ast` is used.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("medvol", "lightning_modules", "datamodules", "callbacks")
ENTRY_POINTS = ("train", "predict", "check_data", "export")
ROOMS = ("lightning_modules", "datamodules", "callbacks")
GROUND = ("medvol", "medvol.core", "medvol.volumes")


def layer(module: str) -> tuple[int, str]:
    """(height, name) of a module's layer: 0 the ground, 1 a room (named), 2 the run layer."""
    top = module.split(".")[0]
    if module in ENTRY_POINTS or module == "medvol.run" or module.startswith("medvol.run."):
        return 2, "the run layer"
    if top in ROOMS:
        return 1, top
    if any(module == g or module.startswith(g + ".") for g in GROUND[1:]) or module == "medvol":
        return 0, "the ground"
    raise AssertionError(f"{module} belongs to no layer; add its package to tests/test_layers.py")


def project_modules(root: Path) -> dict[str, Path]:
    modules = {name: root / f"{name}.py" for name in ENTRY_POINTS if (root / f"{name}.py").exists()}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_modules(path: Path, module: str, known: Iterable[str]) -> set[str]:
    """The project modules `path` imports anywhere in its body (`from a import b` counts `a.b` when that is a
    module)."""
    known = set(known)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            # `import a.b.c` of a module we do not know may still name one of our packages.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for importer, targets in sorted(graph.items()):
        height, name = layer(importer)
        for target in sorted(targets):
            target_height, target_name = layer(target)
            if target_height > height:
                problems.append(f"{importer} ({name}) imports {target} ({target_name}), a layer above it")
            elif height == target_height == 1 and name != target_name:
                problems.append(f"{importer} ({name}) imports {target} ({target_name}), another room")
    return problems


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle once, as the path that closes it (a -> b -> a), found by depth-first search."""
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                circles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return circles


def test_imports_point_down_only():
    problems = upward_imports(import_graph(ROOT))
    assert not problems, "\n".join(problems)


def test_no_import_circle():
    circles = import_circles(import_graph(ROOT))
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_every_package_says_what_lives_there_and_what_it_may_import():
    for package in ("medvol", "medvol.run", "medvol.core", "medvol.volumes"):
        init = ROOT / package.replace(".", "/") / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc, f"{init} needs a docstring saying what lives there and what it may import"


# The checks above must fail on a tree that breaks the rules: a planted one, shaped like the project.


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").touch()
    return root


def test_a_ground_module_importing_the_run_layer_is_named(tmp_path: Path):
    root = plant(tmp_path, {
        "medvol/core/__init__.py": "",
        "medvol/core/errors.py": "def f():\n    from medvol.run.training import run\n",
        "medvol/run/__init__.py": "",
        "medvol/run/training.py": "from medvol.core.errors import f\n",
    })
    problems = upward_imports(import_graph(root))
    assert problems == ["medvol.core.errors (the ground) imports medvol.run.training (the run layer), a layer above it"]


def test_a_room_importing_another_room_or_the_run_layer_is_named(tmp_path: Path):
    root = plant(tmp_path, {
        "callbacks/images.py": "from datamodules.sources import synthetic\n",
        "datamodules/sources/__init__.py": "",
        "datamodules/sources/synthetic.py": "import medvol.run.resolvers\n",
        "medvol/run/__init__.py": "",
        "medvol/run/resolvers.py": "",
    })
    problems = upward_imports(import_graph(root))
    assert problems == [
        "callbacks.images (callbacks) imports datamodules.sources.synthetic (datamodules), another room",
        "datamodules.sources.synthetic (datamodules) imports medvol.run.resolvers (the run layer), a layer above it",
    ]


def test_a_circle_through_a_lazy_import_is_found(tmp_path: Path):
    root = plant(tmp_path, {
        "medvol/run/__init__.py": "",
        "medvol/run/launch.py": "import os\n",
        "medvol/run/training.py": "from medvol.run.launch import local_ranks\n",
    })
    assert import_circles(import_graph(root)) == []
    (root / "medvol/run/launch.py").write_text("def main():\n    from medvol.run.training import run\n")
    assert import_circles(import_graph(root)) == [["medvol.run.launch", "medvol.run.training", "medvol.run.launch"]]


def test_relative_imports_are_resolved(tmp_path: Path):
    root = plant(tmp_path, {
        "medvol/volumes/__init__.py": "",
        "medvol/volumes/writer.py": "from ..run import training\n",
        "medvol/run/__init__.py": "",
        "medvol/run/training.py": "",
    })
    assert import_graph(root)["medvol.volumes.writer"] == {"medvol.run.training"}
