"""A misspelt key, a wrong group option or `--help` is answered before torch or Lightning is imported (issue 63,
item 6): one `medvol: error:` line with exit status 2 and a "did you mean", and no run folder, whichever check refuses.

How long the answer takes is measured in benchmarks/trust/refusal_lines.py (docs/benchmarks/trust.md), not here: these
tests check what makes it short, that the heavy packages were never imported when the answer came.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from medvol.run.command_help import config_groups, help_text
from medvol.run.override_check import override_error
from tests.conftest import CONF_DIR, ROOT, subprocess_env

# Runs an entry point as `python <script> args` does, then says on its last stderr line which heavy packages it had
# imported by the time it answered.
WATCHED = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
    code = 0
except SystemExit as done:
    code = done.code
heavy = sorted(m for m in ("torch", "pytorch_lightning", "lightning", "monai") if m in sys.modules)
print("imported:", ",".join(heavy) or "none", file=sys.stderr)
sys.exit(code)
"""


def _watched(script: str, args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, str, list[str]]:
    """The finished command, what heavy packages it imported, and its output lines but that report."""
    done = subprocess.run([sys.executable, "-c", WATCHED, str(ROOT / script), *args], cwd=cwd,
                          env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    report = next(line for line in reversed(lines) if line.startswith("imported: "))
    lines.remove(report)
    return done, report.removeprefix("imported: "), lines


def test_a_misspelt_key_is_one_line_naming_the_key_before_torch_and_leaves_no_folder(tmp_path):
    done, imported, lines = _watched("train.py", ["trainer.max_epoch=3"], tmp_path)
    assert done.returncode == 2, lines
    assert len(lines) == 1 and lines[0].startswith("medvol: error: `trainer.max_epoch=3`"), lines
    assert "did you mean `trainer.max_epochs`?" in lines[0], lines
    # Trainer takes no `max_epoch`: the refusal does not suggest adding it.
    assert "+trainer.max_epoch" not in lines[0]
    assert imported == "none"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script, args, expected", [
    ("train.py", ["model=vqgna"], "did you mean `model=vqgan`?"),
    ("train.py", ["-m", "model=vqgna", "model.optimizer.lr=1e-4,3e-4"], "did you mean `model=vqgan`?"),
    ("predict.py", ["ckpt_path=x.ckpt", "outptu_dir=out"], "did you mean `output_dir`?"),
    ("export.py", ["ckpt_path=x.ckpt", "fromat=bundle"], "did you mean `format`?"),
    ("check_data.py", ["dataset=bratz"], "did you mean `dataset=brats`?"),
])
def test_each_entry_point_answers_a_typo_before_torch(tmp_path, script, args, expected):
    done, imported, lines = _watched(script, args, tmp_path)
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("medvol: error: "), lines
    assert expected in lines[0], lines
    assert imported == "none"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script, expected", [
    ("train.py", "medvol: train 3D medical imaging models"),
    ("predict.py", "medvol predict: a trained model's outputs"),
    ("export.py", "ckpt_path: null"),
    ("check_data.py", "python check_data.py dataset=brats"),
])
def test_help_is_answered_before_torch(tmp_path, script, expected):
    done, imported, lines = _watched(script, ["--help"], tmp_path)
    assert done.returncode == 0 and expected in "\n".join(lines), lines
    assert imported == "none"
    assert list(tmp_path.iterdir()) == []


def test_the_suggestions_name_the_closest_key_or_option():
    assert "did you mean `paths.log_dir`?" in override_error(CONF_DIR, "train", ["paths.lgo_dir=/x"])
    assert "did you mean `model.optimizer.lr`?" in override_error(CONF_DIR, "train", ["model.optimizer.rl=1e-3"])
    assert "did you mean `model=segmentation`?" in override_error(CONF_DIR, "train", ["model=segmentaton"])
    assert "did you mean `model`?" in override_error(CONF_DIR, "train", ["modle=vqgan"])


def test_adding_a_key_is_suggested_only_where_the_node_builds_a_class():
    # `trainer` builds pytorch_lightning.Trainer, which takes arguments the config leaves out.
    added = override_error(CONF_DIR, "train", ["trainer.enable_progress_bar=false"])
    assert "`+trainer.enable_progress_bar=false`" in added and "pytorch_lightning.Trainer" in added
    # A plain settings node, a value and a key under no node: nothing reads an added key there.
    for override in ("paths.lgo_dir=/x", "seed.value=1", "modle.lr=1"):
        assert "+" not in override_error(CONF_DIR, "train", [override]).split("`: ", 1)[1], override


@pytest.mark.slow
def test_adding_an_argument_the_class_does_not_take_is_one_line_and_leaves_no_folder(tmp_path):
    """The old refusal's own hint, `+trainer.max_epoch=3`, ended in Lightning's TypeError, exit 1 and a run folder
    holding only .hydra/ and train.log."""
    done, _, lines = _watched("train.py", ["+trainer.max_epoch=3"], tmp_path)
    assert done.returncode == 2, lines
    assert len(lines) == 1 and lines[0].startswith("medvol: error: `+trainer.max_epoch=3`"), lines
    assert "did you mean `trainer.max_epochs`?" in lines[0]
    assert list(tmp_path.iterdir()) == []


# Hydra's own help, for comparison: the entry point run with medvol's help switched off.
HYDRAS_HELP = """
import runpy, sys
import medvol.run.command_help
medvol.run.command_help.help_text = lambda *args: None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("script, args", [
    ("train.py", ["--help"]),
    ("train.py", ["model=segmentation", "dataset=brats", "-h"]),
    ("predict.py", ["--help"]),
    ("export.py", ["--help"]),
])
def test_help_is_the_text_hydra_prints(tmp_path, script, args):
    env = subprocess_env(OMP_NUM_THREADS="1")
    ours = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    hydras = subprocess.run([sys.executable, "-c", HYDRAS_HELP, str(ROOT / script), *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=240)
    assert ours.returncode == hydras.returncode == 0, ours.stderr + hydras.stderr
    assert ours.stdout == hydras.stdout and "== Configuration groups ==" in ours.stdout


def test_help_lists_the_applications_groups_and_leaves_other_flags_to_hydra(tmp_path):
    groups = config_groups(CONF_DIR).splitlines()
    assert "model: classifier, ddpm, ldm, segmentation, survival, vqgan, xray2ct" in groups
    assert not any(line.startswith("hydra") for line in groups)
    (tmp_path / "model" / "nested").mkdir(parents=True)
    (tmp_path / "model" / "nested" / "b.yaml").touch()
    (tmp_path / "model" / "a.yaml").touch()
    (tmp_path / "empty").mkdir()
    assert config_groups(tmp_path) == "model: a\nmodel/nested: b\n"
    for argv in (["--help", "--resolve"], ["--hydra-help"], ["model=vqgan"], ["--help", "model=vqgna"]):
        assert help_text(CONF_DIR, "train", argv) is None, argv


def test_a_class_of_the_users_own_added_on_the_command_line_is_no_argument_of_it():
    # `+callbacks.mine._target_=...` names the class itself: Hydra's key, not a constructor argument (the slow
    # two-rank tests add their own callbacks this way).
    from medvol.run.override_check import added_argument_error

    assert added_argument_error(ROOT / "conf", "train", ["+callbacks.mine._target_=tests.ddp_support.RankRecorder",
                                                          "+callbacks.mine.directory=/tmp/x"]) is None
