"""`.ci/check-tree` refuses a tree that works only where it was committed (issue 17: a tracked `.venv`
link to another worktree broke every fresh clone while CI, on the committing machine, passed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / ".ci" / "check-tree"

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a git checkout"
)


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


def check(repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / ".ci" / "check-tree")], cwd=repo, capture_output=True, text=True)


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A clone of this repository's committed tree, with the working copy's check script."""
    repo = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(repo)], check=True)
    shutil.copy2(CHECK, repo / ".ci" / "check-tree")
    return repo


def test_a_clean_clone_passes(clone: Path):
    result = check(clone)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_a_committed_venv_link_to_another_worktree_is_refused_in_one_line(clone: Path, tmp_path: Path):
    other = tmp_path / "wt-integrate" / ".venv"
    other.mkdir(parents=True)
    (clone / ".venv").symlink_to(other)
    git(clone, "add", "-f", ".venv")
    git(clone, "commit", "-qm", "the mistake that broke every fresh clone")
    result = check(clone)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert any("'.venv'" in line and "symbolic link" in line and str(other) in line for line in lines), lines
    # It is also an ignored path: the second rule names it too, each finding on a line of its own.
    assert any("'.venv'" in line and ".gitignore ignores" in line for line in lines), lines
    assert all(line.startswith("check-tree: error: ") for line in lines)


def test_a_relative_link_climbing_out_of_the_repository_is_refused(clone: Path):
    (clone / "data").symlink_to("../../scans")
    git(clone, "add", "data")
    git(clone, "commit", "-qm", "link out")
    result = check(clone)
    assert result.returncode == 1
    assert "'data', a symbolic link to '../../scans' outside the repository" in result.stdout


def test_a_link_inside_the_repository_is_allowed(clone: Path):
    (clone / "docs" / "readme-link.md").symlink_to("../README.md")
    git(clone, "add", "docs/readme-link.md")
    git(clone, "commit", "-qm", "link inside")
    assert check(clone).returncode == 0


def test_a_committed_ignored_file_is_refused(clone: Path):
    (clone / "outputs").mkdir()
    (clone / "outputs" / "run.ckpt").write_text("weights")
    git(clone, "add", "-f", "outputs/run.ckpt")
    git(clone, "commit", "-qm", "ignored file")
    result = check(clone)
    assert result.returncode == 1
    assert "'outputs/run.ckpt', which .gitignore ignores" in result.stdout


def test_ci_runs_the_check_before_the_tests():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "bash .ci/check-tree" in lines
    assert lines.index("bash .ci/check-tree") < lines.index("make test")
