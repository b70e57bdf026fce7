"""Mutation check: break the code on purpose, one named mutation at a time, and see which tests notice.

    .venv/bin/python benchmarks/trust/mutations.py                 # every mutation, then the table
    .venv/bin/python benchmarks/trust/mutations.py --only straight-through doctor-inf
    .venv/bin/python benchmarks/trust/mutations.py --list

The mutations are data: `benchmarks/trust/mutations/<package>.yaml`, each a list of entries with the
keys `name`, `file`, `original` (text that occurs exactly once in `file`), `replacement`, `tests`
(pytest selections that should catch it) and `what` (one line on what it breaks).

Each mutation replaces its text in a temporary copy of the repository (the working tree is never
touched) and runs only its tests, slow ones included. It is caught only when a test fails on an
assertion: pytest exits with 1 and reports at least one failed test. An import or collection
error, an error in a fixture or a timeout proves nothing about the tests, so such a mutation is
reported as broken, not caught. First the same tests run on the unmutated copy: a test that
already fails there proves nothing, and the script stops.
Minutes, not seconds: run it before a release, not in CI.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, child_env  # noqa: E402

# A mutation that makes a DDP test hang is caught by the test's own timeouts long before this.
RUN_TIMEOUT = 900
MUTATIONS_DIR = ROOT / "benchmarks" / "trust" / "mutations"
FIELDS = ("name", "file", "original", "replacement", "tests", "what")
# pytest's exit code when tests ran and some failed; 2-5 are interruptions, internal, usage or no-test errors.
TESTS_FAILED = 1


@dataclass(frozen=True)
class Mutation:
    """Replace `original` (must occur exactly once in `file`) by `replacement`; `tests` should then fail."""

    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    what: str


def load_mutations(folder: Path = MUTATIONS_DIR) -> list[Mutation]:
    """Every mutation of the YAML lists in `folder` (one file per package), in file then list order."""
    mutations: list[Mutation] = []
    for path in sorted(folder.glob("*.yaml")):
        for index, entry in enumerate(yaml.safe_load(path.read_text()) or []):
            missing = set(FIELDS) - set(entry)
            unknown = set(entry) - set(FIELDS)
            if missing or unknown:
                raise SystemExit(
                    f"{path.name}: entry {index + 1} ({entry.get('name', '?')}): "
                    f"missing {sorted(missing)}, unknown {sorted(unknown)}; expected the keys {list(FIELDS)}"
                )
            mutations.append(Mutation(**{**entry, "tests": tuple(entry["tests"])}))
    repeated = [name for name, count in Counter(m.name for m in mutations).items() if count > 1]
    if repeated:
        raise SystemExit(f"mutation names used twice in {folder}: {repeated}")
    return mutations


def copy_repository(destination: Path) -> None:
    """The tracked and untracked (not ignored) files of the working tree, without the venv or caches."""
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


@dataclass(frozen=True)
class Verdict:
    """How a selection of tests ended: `passed`, `failed` (a test failed on an assertion) or `broken`."""

    outcome: str
    seconds: float
    first_line: str


def pytest(copy: Path, tests: Sequence[str]) -> Verdict:
    """Run `tests` (slow ones too) in `copy` and say how they ended, with the first failure's line."""
    env = child_env(copy, threads=1)
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-m", "", "-p", "no:cacheprovider", *tests]
    start = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        return Verdict("broken", time.perf_counter() - start, f"timed out after {RUN_TIMEOUT} s")
    seconds = time.perf_counter() - start
    lines = result.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAILED")]
    errors = [line for line in lines if line.startswith("ERROR")]
    if result.returncode == 0:
        return Verdict("passed", seconds, "")
    (copy / "last-failure.txt").write_text(result.stdout + result.stderr)
    if result.returncode == TESTS_FAILED and failed:
        return Verdict("failed", seconds, failed[0][:200])
    tail = (errors or [line for line in lines if line.strip()] or [result.stderr.strip()[-200:]])
    return Verdict("broken", seconds, f"exit {result.returncode}: {tail[0][:180]}")


def check_imports_from(copy: Path) -> None:
    """The tests must import the copy's (mutated) modules, not the editable install of the working tree."""
    env = child_env(copy)
    probe = (
        "import medvol, lightning_modules, datamodules; print(medvol.__file__, lightning_modules.__file__, "
        "datamodules.__file__)"
    )
    files = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=env, capture_output=True, text=True, check=True)
    if any(not Path(f).resolve().is_relative_to(copy.resolve()) for f in files.stdout.split()):
        raise SystemExit(f"the copy does not shadow the installed packages: {files.stdout.strip()}")


def apply(copy: Path, mutation: Mutation) -> str:
    """Mutate the copy's file; return its original text."""
    path = copy / mutation.file
    text = path.read_text()
    count = text.count(mutation.original)
    if count != 1:
        raise SystemExit(
            f"{mutation.name}: the original text occurs {count} times in {mutation.file}; update the mutation"
        )
    path.write_text(text.replace(mutation.original, mutation.replacement))
    return text


def run_baseline(copy: Path, chosen: Sequence[Mutation]) -> bool:
    """The mutations' tests on the unmutated copy; False (after printing why) when any of them fails."""
    tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
    verdict = pytest(copy, tests)
    print(f"baseline: {len(tests)} test selections on the unmutated copy {verdict.outcome} ({verdict.seconds:.0f} s)")
    if verdict.outcome == "passed":
        return True
    print(f"  {verdict.first_line}")
    report = copy / "last-failure.txt"
    print(report.read_text()[-6000:] if report.is_file() else "")
    return False


def print_table(rows: Sequence[tuple[Mutation, Verdict]]) -> None:
    """The Markdown table of the run and its one-line tally."""
    print("\n| mutation | what it breaks | caught by (first failing test) | s |\n|---|---|---|---|")
    for m, verdict in rows:
        if verdict.outcome == "failed":
            # "FAILED tests/x.py::name - AssertionError..." -> "x.py::name"
            by = f"`{verdict.first_line.split(' ', 1)[1].split(' - ')[0].removeprefix('tests/')}`"
        elif verdict.outcome == "broken":
            by = f"**broken** ({verdict.first_line})"
        else:
            by = "**not caught** by " + ", ".join(f"`{t.removeprefix('tests/')}`" for t in m.tests)
        print(f"| `{m.name}` | {m.what} | {by} | {verdict.seconds:.0f} |")
    caught = sum(verdict.outcome == "failed" for _, verdict in rows)
    for outcome, label in (("passed", "not caught"), ("broken", "broken (no assertion failed)")):
        names = [m.name for m, verdict in rows if verdict.outcome == outcome]
        if names:
            print(f"{label}: {', '.join(names)}")
    print(f"\n{caught} of {len(rows)} mutations caught")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    args = parser.parse_args(argv)
    mutations = load_mutations()
    chosen = [m for m in mutations if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in mutations}
    if unknown:
        parser.error(f"unknown mutation(s): {sorted(unknown)}")
    if args.list:
        for m in chosen:
            print(f"{m.name:<28} {m.file:<45} {m.what}")
        return 0

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="medvol-mutations-") as tmp:
        copy = Path(tmp)
        copy_repository(copy)
        check_imports_from(copy)
        for m in chosen:  # every original text is found before any test runs
            (copy / m.file).write_text(apply(copy, m))
        if not args.no_baseline and not run_baseline(copy, chosen):
            return 1
        rows = []
        for m in chosen:
            original = apply(copy, m)
            verdict = pytest(copy, m.tests)
            (copy / m.file).write_text(original)
            rows.append((m, verdict))
            # The failing test's line shows it failed for the mutation, not for an unrelated reason.
            status = {"failed": "caught", "passed": "NOT CAUGHT", "broken": "BROKEN"}[verdict.outcome]
            print(f"{m.name}: {status} ({verdict.seconds:.0f} s) {verdict.first_line}", flush=True)

    print_table(rows)
    print(f"{time.perf_counter() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
