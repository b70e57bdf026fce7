"""The tests run wherever medvol's own dependencies and pytest are: a package of an extra (the dev extra's
references, lifelines, scikit-learn, scikit-survival, SimpleITK, nilearn, pandas; export's onnx) is taken by the
tests that use it through `pytest.importorskip`, so a machine without it skips those tests alone. The 2026-11-27
GPU round's image had no scikit-survival, and a module that imported it at its top failed to collect."""

from __future__ import annotations

import ast
import importlib.metadata
import re

from tests.conftest import ROOT

# The dev extra's runner and linter: without them no test runs at all.
RUNNER = {"pytest", "pytest-timeout", "ruff"}


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extra_packages() -> set[str]:
    """The distributions of pyproject.toml's extras that are not among its dependencies, less the runner."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest's own dependency reads TOML there
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {normalised(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}

    extras = set().union(*(names(r) for r in project["optional-dependencies"].values()))
    return extras - names(project["dependencies"]) - RUNNER


def imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, top-level module) of every import statement in a file, in functions too."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_every_test_file_takes_the_extras_packages_through_importorskip():
    optional = extra_packages()
    assert {"lifelines", "scikit-learn", "scikit-survival", "simpleitk", "nilearn", "pandas", "onnx"} <= optional
    distributions = importlib.metadata.packages_distributions()
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for line, module in imports(ast.parse(path.read_text(), filename=str(path))):
            packages = {normalised(d) for d in distributions.get(module, [])}
            if packages & optional:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not offenders, "import these with pytest.importorskip in the tests that use them:\n" + "\n".join(offenders)
