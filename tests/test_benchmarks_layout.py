"""benchmarks/ as a plan (benchmarks/README.md): the product never imports it, its modules import one another
without a circle, every script is in the plan, and every `benchmarks/...` path the guides name exists.

Imports are read with `ast`, in every function too (a lazy import counts); nothing is imported or run.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
# What runs for a user: everything tracked but the measurements, the tests, the seeds' own scripts and CI.
NOT_PRODUCT = ("benchmarks/", "tests/", "seeds/", ".ci/")
# A path the guides name with benchmarks/ in it, up to the first character that is no path's (`<package>`, a space);
# not `<commit>:benchmarks/...`, a path as it was in that commit (`git show 66b9dd3:benchmarks/ddpm.py`).
NAMED_PATH = re.compile(r"(?<![\w./:-])([\w./-]*?)(benchmarks/[\w./-]*[\w/])")


def tracked_python() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.split() if (ROOT / name).is_file()]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at its top or in a function: `import a.b` gives a.b, `from a import b` a.b and
    a (b may be a module or a name in a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def product_imports_of_benchmarks(files: list[Path], root: Path = ROOT) -> list[str]:
    return sorted(
        f"{path.relative_to(root)} imports {module}"
        for path in files
        for module in imported_modules(path)
        if module == "benchmarks" or module.startswith("benchmarks.")
    )


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def benchmark_import_graph() -> dict[str, set[str]]:
    """benchmarks module -> the benchmarks modules it imports (names that are no module of benchmarks left out)."""
    modules = {module_name(path): path for path in BENCHMARKS.rglob("*.py")}
    return {name: {m for m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` (a -> b -> a), or []."""
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> list[str]:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*trail[trail.index(target):], target]
            if target not in state and (found := visit(target, [*trail, target])):
                return found
        state[node] = "done"
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return []


def test_no_product_code_imports_benchmarks():
    product = [p for p in tracked_python() if not str(p.relative_to(ROOT)).startswith(NOT_PRODUCT)]
    assert any(p.name == "train.py" for p in product) and any("medvol" in p.parts for p in product)
    offending = product_imports_of_benchmarks(product)
    assert not offending, f"product code imports benchmarks/ (a measurement, not part of medvol): {offending}"


def test_an_import_of_benchmarks_in_a_function_is_found(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("def f():\n    from benchmarks.segmentation import nnunet_plans\n    import benchmarks.common\n")
    (tmp_path / "clean.py").write_text("import medvol\nfrom datamodules import sources\n")
    assert product_imports_of_benchmarks([source, tmp_path / "clean.py"], tmp_path) == [
        "module.py imports benchmarks.common", "module.py imports benchmarks.segmentation",
        "module.py imports benchmarks.segmentation.nnunet_plans"]


def test_benchmark_modules_import_each_other_without_a_circle():
    graph = benchmark_import_graph()
    # The edges that the circle of segmentation.py and segmentation_protocol.py was made of are still read.
    assert "benchmarks.segmentation.segmentation_protocol" in graph["benchmarks.segmentation.segmentation"]
    assert "benchmarks.segmentation.head_to_head" in graph["benchmarks.segmentation.segmentation_protocol"]
    assert not circle(graph), f"benchmark modules import each other in a circle: {' -> '.join(circle(graph))}"


def test_a_circle_is_found():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set()}) == []


def test_every_benchmark_script_is_in_the_plan():
    plan = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    scripts = [p for p in BENCHMARKS.glob("*/*.py") if "__main__" in p.read_text(encoding="utf-8")]
    assert len(scripts) > 20
    missing = sorted(str(p.relative_to(BENCHMARKS)) for p in scripts if p.name not in plan)
    assert not missing, f"benchmarks/README.md does not name {missing}"


def test_every_benchmarks_path_the_guides_name_exists():
    # Prose and code alike: a command in a guide runs a script by its path. A path is the repository's, or, in a
    # link written relative to its page, the page folder's (docs/benchmarks/*.md, the figures' pages).
    # Another folder's benchmarks/ (outputs/benchmarks/..., a machine's /tmp/...) is no path of this repository's.
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for prefix, path in NAMED_PATH.findall(line):
                if prefix not in ("", "docs/") and set(prefix.split("/")) - {"..", ""}:
                    continue
                if not ((ROOT / prefix / path).exists() or (page.parent / prefix / path).exists()):
                    missing.append(f"{page.relative_to(ROOT)}:{number}: {prefix}{path}")
    assert not missing, "paths under benchmarks/ that do not exist:\n" + "\n".join(missing)
