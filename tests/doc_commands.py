"""The shell commands of README.md and docs/**/*.md, as a reader sees them: every code block (fenced, or indented by
four spaces), its language, its lines joined across trailing backslashes, and the `doc-test` markers before it.

A marker is an HTML comment on the lines just above a block (a reader of the rendered page does not see it):

    <!-- doc-test: skip <reason> -->            the whole block is not run, for that reason
    <!-- doc-test: skip "<regex>": <reason> --> the block's commands in which <regex> is found are not run
    <!-- doc-test: skip-file <reason> -->       (anywhere in a file) none of the file's blocks is run

A reason starts with one of `REASONS`' words. Every marker must match a command, so none outlives what it marked.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# Why a command is not run. `gpu`: it needs a CUDA GPU (or several); `slurm`: a SLURM cluster; `nodes`: a second
# machine; `network`: it installs packages or downloads; `server`: it serves until stopped; `recursion`: it runs
# the test suite this test is part of; `benchmark`: a measurement of minutes to hours, whose command is in
# BENCHMARKS.md's pages with the figures it gave; `size`: a full-size run no CPU test can afford even with the size keys
# appended; `tested`: another test (named) runs this very command.
REASONS = ("gpu", "slurm", "nodes", "network", "server", "recursion", "benchmark", "size", "tested")
MARKER = re.compile(r"<!--\s*doc-test:\s*(skip-file|skip)\s+(?:\"([^\"]+)\":\s*)?(.+?)\s*-->")
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
# A line is a command when its first word (after `NAME=value` assignments) is one of these.
COMMAND_WORDS = (
    "python", "python3", ".venv/bin/python", ".venv/bin/pip", "pip", "make", "torchrun", "srun", "bash",
    "tensorboard", "pytest", "git", "for", "taskset", "OMP_NUM_THREADS=1", "PYTHONPATH=$PWD",
)
ENTRY_POINTS = ("train.py", "predict.py", "export.py", "check_data.py")


@dataclass
class Marker:
    kind: str  # skip or skip-file
    text: str | None  # a regular expression found in the commands it applies to; None: all of them
    reason: str
    line: int


@dataclass
class Command:
    """One logical command line of a block: its text (continuations joined, the comment cut off), where it is."""

    text: str
    line: int
    comment: str = ""

    def words(self) -> list[str]:
        return shlex.split(self.text)

    def program(self) -> tuple[list[str], list[str]]:
        """(`NAME=value` assignments, the rest of the words)."""
        words = self.words()
        k = 0
        while k < len(words) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[k]):
            k += 1
        return words[:k], words[k:]

    def entry_point(self) -> tuple[str, list[str]] | None:
        """(script, its arguments) where the command runs one of medvol's entry points, else None. `make train
        ARGS="..."` runs train.py with those arguments; `torchrun ... train.py ...` and `srun python train.py` too."""
        _, words = self.program()
        if words[:2] == ["make", "train"]:
            args = next((w.split("=", 1)[1] for w in words[2:] if w.startswith("ARGS=")), "")
            return "train.py", shlex.split(args)
        for k, word in enumerate(words):
            if Path(word).name in ENTRY_POINTS and (k == 0 or "python" in words[k - 1] or words[0] == "torchrun"):
                return Path(word).name, words[k + 1:]
        return None


@dataclass
class Block:
    path: Path
    line: int  # of the first line of the code
    fenced: bool
    language: str
    lines: list[str]
    markers: list[Marker] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def is_shell(self) -> bool:
        if self.fenced and self.language:
            return self.language in SHELL_LANGUAGES
        return bool(self.commands())

    def other_lines(self) -> list[str]:
        """The lines of an unlabelled block that are neither commands nor comments (output, a table, a tree)."""
        commands = {c.line for c in self.commands()}
        return [text for k, text in enumerate(self.lines) if text.strip() and not text.lstrip().startswith("#")
                and self.line + k not in commands and not self.lines[k - 1].rstrip().endswith("\\")]

    def commands(self) -> list[Command]:
        """The command lines: continuations joined, comment lines and blank lines left out, trailing comments cut.
        In a shell fence every other line is a command; in an unlabelled block only the lines that start with a
        command word."""
        every = self.fenced and self.language in SHELL_LANGUAGES
        found: list[Command] = []
        pending, start = "", 0
        for k, raw in enumerate(self.lines):
            line = raw.rstrip()
            if not pending:
                start = self.line + k
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
            text, comment = split_comment(line)
            if text.endswith("\\"):
                pending += text[:-1].rstrip() + " "
                continue
            if not pending and not every and not is_command(text):
                continue
            found.append(Command((pending + text).strip(), start, comment))
            pending = ""
        return found

    def skipped(self, command: Command) -> Marker | None:
        """The marker that keeps `command` from running, if any."""
        return next((m for m in self.markers if m.text is None or re.search(m.text, command.text)), None)


def is_command(text: str) -> bool:
    words = text.split()
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]) and words[0] not in COMMAND_WORDS:
        words = words[1:]
    return bool(words) and (words[0] in COMMAND_WORDS or words[0].split("=")[0] in ("OMP_NUM_THREADS", "PYTHONPATH"))


def split_comment(line: str) -> tuple[str, str]:
    """(the command, its trailing `# comment`): a `#` outside quotes after whitespace starts a shell comment."""
    quote = None
    for k, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and k > 0 and line[k - 1] in " \t":
            return line[:k].rstrip(), line[k + 1:].strip()
    return line, ""


def collect(path: Path) -> list[Block]:
    """The code blocks of one Markdown file with the markers above them (and the file's `skip-file` markers)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    k = 0
    while k < len(lines):
        line = lines[k]
        fence = re.match(r"^(\s*)(```+|~~~+)\s*([\w-]*)", line)
        if fence:
            indent, ticks, language = fence.groups()
            end = k + 1
            while end < len(lines) and not lines[end].strip().startswith(ticks):
                end += 1
            body = [text[len(indent):] if text.startswith(indent) else text.lstrip() for text in lines[k + 1:end]]
            blocks.append(Block(path, k + 2, True, language, body, markers_above(lines, k)))
            k = end + 1
            continue
        previous_blank = k == 0 or not lines[k - 1].strip()
        if previous_blank and re.match(r"^ {4,}\S", line):
            end = k
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            while not lines[end - 1].strip():
                end -= 1
            width = min(len(text) - len(text.lstrip()) for text in lines[k:end] if text.strip())
            blocks.append(Block(path, k + 1, False, "", [text[width:] for text in lines[k:end]],
                                markers_above(lines, k)))
            k = end
            continue
        k += 1
    # A marker shown as an example inside a code block marks nothing.
    inside = {block.line + j for block in blocks for j in range(-1, len(block.lines) + 1)}
    file_markers = [Marker(m.group(1), None, m.group(3), k + 1) for k, line in enumerate(lines)
                    for m in [MARKER.search(line)] if m and m.group(1) == "skip-file" and k + 1 not in inside]
    for block in blocks:
        block.markers.extend(file_markers)
    return blocks


def markers_above(lines: list[str], k: int) -> list[Marker]:
    """The `doc-test` markers on the lines just above line `k` (blank lines between them allowed)."""
    found = []
    j = k - 1
    while j >= 0 and (not lines[j].strip() or MARKER.search(lines[j])):
        m = MARKER.search(lines[j])
        if m:
            found.append(Marker(m.group(1), m.group(2), m.group(3), j + 1))
        j -= 1
    return found[::-1]


def all_blocks() -> list[Block]:
    return [block for path in DOCS for block in collect(path)]
