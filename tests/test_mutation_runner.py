"""The mutation runner: its list is data, and only a test failing on an assertion catches a mutation."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _runner():
    spec = importlib.util.spec_from_file_location("mutation_runner", ROOT / "benchmarks" / "trust" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


RUNNER = _runner()


def _project(tmp_path: Path, test_body: str) -> Path:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_it.py").write_text(test_body)
    return tmp_path


@pytest.mark.parametrize(
    ("test_body", "outcome"),
    [
        ("def test_it():\n    assert 1 + 1 == 2\n", "passed"),
        ("def test_it():\n    assert 1 + 1 == 3\n", "failed"),
        ("import a_module_that_is_not_there\n\ndef test_it():\n    assert True\n", "broken"),
        ("import pytest\n\n@pytest.fixture\ndef bad():\n    raise RuntimeError\n\n"
         "def test_it(bad):\n    assert True\n", "broken"),
    ],
    ids=["passes", "assertion-fails", "import-error", "fixture-error"],
)
def test_only_a_failed_assertion_counts_as_caught(tmp_path, test_body, outcome):
    verdict = RUNNER.pytest(_project(tmp_path, test_body), ["tests/test_it.py"])
    assert verdict.outcome == outcome, verdict


def test_every_mutation_names_its_text_once_and_tests_that_exist():
    mutations = RUNNER.load_mutations()
    assert len(mutations) >= 122
    for m in mutations:
        assert (ROOT / m.file).read_text().count(m.original) == 1, m.name
        for selection in m.tests:
            assert (ROOT / selection.split("::")[0]).is_file(), (m.name, selection)


def test_an_entry_with_a_misspelt_key_is_refused_with_its_file_and_entry(tmp_path):
    (tmp_path / "bad.yaml").write_text(
        "- name: x\n  file: f.py\n  original: a\n  replacement: b\n  test: [tests/t.py]\n  what: w\n"
    )
    with pytest.raises(SystemExit, match=r"bad.yaml: entry 1 \(x\): missing \['tests'\], unknown \['test'\]"):
        RUNNER.load_mutations(tmp_path)
