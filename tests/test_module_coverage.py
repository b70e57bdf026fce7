"""Every module of the application is imported by at least one test file that exercises it.

A module reached only through whole training runs is tested by accident: when it breaks, the
failure shows up far from it, or not at all. This check lists the application's modules and the
modules the test files import (parsed with `ast`, nothing is imported), and names the gap.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("medvol", "lightning_modules", "datamodules", "callbacks")

# Modules no test imports yet, while other work in progress covers them; empty since issue 30 gave the last eight
# tests of their own. A name may be added only with the work that will cover it (the test below fails while a covered
# module is still listed, so this set only shrinks).
NOT_YET_COVERED: set[str] = set()


def application_modules() -> set[str]:
    """Dotted names of every module of the application packages, `__init__` files left out."""
    files = (path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
    return {".".join(path.relative_to(ROOT).with_suffix("").parts) for path in files if path.name != "__init__.py"}


def imported_names(path: Path) -> set[str]:
    """Every dotted name a file imports, with `from a.b import c` giving both `a.b` and `a.b.c`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules_the_tests_import() -> set[str]:
    """The application modules some test file under tests/ imports."""
    imported = set().union(*(imported_names(path) for path in (ROOT / "tests").rglob("*.py")))
    return application_modules() & imported


def test_the_import_parser_sees_plain_dotted_and_from_imports(tmp_path):
    source = tmp_path / "test_sample.py"
    source.write_text("import a.b\nfrom c.d import e, f\nfrom . import g\n\ndef t():\n    import h\n")
    assert imported_names(source) == {"a.b", "c.d", "c.d.e", "c.d.f", "h"}


def test_every_application_module_is_imported_by_a_test_file():
    untested = application_modules() - modules_the_tests_import() - NOT_YET_COVERED
    assert not untested, f"no test file imports these modules; write tests that exercise them: {sorted(untested)}"


def test_the_not_yet_covered_list_names_only_modules_that_exist_and_are_still_untested():
    stale = NOT_YET_COVERED - application_modules()
    covered = NOT_YET_COVERED & modules_the_tests_import()
    assert not stale, f"NOT_YET_COVERED names modules that no longer exist: {sorted(stale)}"
    assert not covered, f"these modules are imported by tests now; remove them from NOT_YET_COVERED: {sorted(covered)}"
