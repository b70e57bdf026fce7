"""Every shell command of README.md and docs/**/*.md works as typed (issue 49).

The fast part reads every code block: each is a shell block or holds no command, each marker (`tests/doc_commands.py`)
names a known reason and still marks a command, and every command of medvol's entry points parses and composes as
Hydra would read it, GPU and SLURM ones included. The slow part runs each guide's commands in order, in a working
folder of its own, at toy size (`tests/doc_world.py`): a command that fails fails the suite.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from tests.doc_commands import REASONS, ROOT, Block, all_blocks, is_command
from tests.doc_world import DATA, TOKENS, WORLDS, Sandbox, composed

BLOCKS = all_blocks()
SHELL = [b for b in BLOCKS if b.is_shell()]


def guide(block: Block) -> str:
    return str(block.path.relative_to(ROOT))


def runnable(block: Block) -> list:
    return [c for c in block.commands() if block.skipped(c) is None]


def test_every_code_block_is_a_shell_block_or_holds_no_command():
    """A command in a block the test would not run (an untagged or `text` fence, a block mixing commands and
    output) could drift unseen."""
    for block in BLOCKS:
        if block.fenced and block.language and not block.is_shell():
            assert block.language in ("python", "yaml", "text"), block.name
            continue
        if block.is_shell() and not block.fenced:
            others = block.other_lines()
            assert not others, f"{block.name}: a block of commands holds other lines: {others}"
        if not block.is_shell():
            assert not [line for line in block.lines if is_command(line.strip())], block.name
        if block.fenced and not block.language:
            assert not block.commands(), f"{block.name}: a fence of commands needs ```bash"


def test_every_marker_names_a_known_reason_and_marks_a_command():
    for block in BLOCKS:
        for marker in block.markers:
            assert marker.reason.split()[0].rstrip(":") in REASONS, (block.name, marker.reason)
            assert len(marker.reason.split()) > 1, f"{block.name}: say why, not only {marker.reason!r}"
            if marker.kind == "skip":
                assert block.is_shell(), f"{block.name}: a marker above a block that is not run"
                assert any(block.skipped(c) is marker for c in block.commands()) or marker.text is None, \
                    f"{block.name}: the marker for {marker.text!r} matches no command"


def entry_commands(blocks: list[Block]) -> list[tuple[Block, object]]:
    return [(b, c) for b in blocks for c in b.commands()
            if c.entry_point() and not any(m.kind == "skip-file" for m in b.markers)]


def test_every_documented_command_of_an_entry_point_parses_and_a_marked_one_composes():
    """The overrides of every train.py, predict.py, export.py and check_data.py command are read as Hydra reads them,
    after the shell's quoting; those not run here (a GPU's, a cluster's) also compose with their root config, so a
    misspelt key in them shows (the slow part runs the others)."""
    parser = OverridesParser.create()
    failures = []
    for block, command in entry_commands(SHELL):
        script, args = command.entry_point()
        # A `<lookup>` is the reader's to fill in (a run's folder): any name stands for it here.
        overrides = [re.sub(r"<[a-z][a-z-]*>", "x", a) for a in args if not a.startswith("-")]
        root = {"train.py": "train", "check_data.py": "train"}.get(script, script.removesuffix(".py"))
        try:
            parser.parse_overrides(overrides)
            if block.skipped(command):
                composed(root, overrides)
        except Exception as err:  # noqa: BLE001 - every failure is listed below
            failures.append(f"{block.name}: {command.text}\n    {type(err).__name__}: {str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures)


def test_every_runnable_command_has_what_it_names():
    """Each token, absolute path and input a runnable command names is provided by tests/doc_world.py."""
    missing = []
    for block in SHELL:
        world = WORLDS.get(guide(block), {})
        for command in runnable(block):
            for token in TOKENS:
                if re.search(r"(?<=[=\s])" + token + r"(?=[\s/]|$)", command.text) and token not in world:
                    missing.append(f"{block.name}: `{token}` in {command.text}")
            for path in re.findall(r"(?<=[=\s'\"])(/data/[^\s'\"]*|/models/[^\s'\"]*)", command.text):
                if not any(path.rstrip("/") == p or path.startswith(p + "/") for p in DATA):
                    missing.append(f"{block.name}: {path} in {command.text}")
    assert not missing, "\n".join(missing)


def test_the_count_of_blocks_commands_and_markers(capsys):
    """The inventory the issue asks for (printed with `-s`): blocks, commands, run, marked and why."""
    commands = [(b, c) for b in SHELL for c in b.commands()]
    marked = [(b, c, b.skipped(c)) for b, c in commands if b.skipped(c)]
    reasons: dict[str, int] = {}
    for _, _, marker in marked:
        word = marker.reason.split()[0].rstrip(":")
        reasons[word] = reasons.get(word, 0) + 1
    with capsys.disabled():
        print(f"\n{len(BLOCKS)} code blocks, {len(SHELL)} of shell commands, {len(commands)} commands: "
              f"{len(commands) - len(marked)} run, {len(marked)} marked {dict(sorted(reasons.items()))}")
    assert len(commands) - len(marked) > 0


SANDBOXES: dict[str, Sandbox] = {}


@pytest.fixture(scope="session")
def doc_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("documented")


def sandbox_of(block: Block, cache: Path) -> Sandbox:
    name = guide(block)
    if name not in SANDBOXES:
        SANDBOXES[name] = Sandbox(name, cache / "guides" / re.sub(r"\W", "_", name), cache)
    return SANDBOXES[name]


def run_command(block: Block, command, cache: Path) -> str | None:
    """Run one command of a guide, after the guide's earlier commands (as a reader would); its failure, if any."""
    sandbox = sandbox_of(block, cache)
    for earlier_block in [b for b in SHELL if b.path == block.path and b.line <= block.line]:
        for earlier in runnable(earlier_block):
            if earlier_block is block and earlier.line >= command.line:
                break
            key = f"{earlier_block.name}:{earlier.line}"
            if key not in sandbox.ran:
                sandbox.ran.add(key)
                sandbox.run(earlier)
    sandbox.ran.add(f"{block.name}:{command.line}")
    done = sandbox.run(command)
    if done.returncode == 0:
        return None
    return f"{block.name}:{command.line}: `{command.text}` exit {done.returncode}\n{done.stdout[-2500:]}\n" \
        f"{done.stderr[-2500:]}"


def command_params() -> list:
    params = []
    for block in SHELL:
        for command in runnable(block):
            params.append(pytest.param(block, command, id=f"{guide(block)}:{command.line}", marks=pytest.mark.slow))
    return params


@pytest.mark.parametrize(("block", "command"), command_params())
def test_the_documented_commands_run_as_typed(block: Block, command, doc_cache: Path):
    failure = run_command(block, command, doc_cache)
    assert failure is None, failure
