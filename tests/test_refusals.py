"""Every bad value is one `medvol: error:` line with exit code 2, and a refused command leaves no trace."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from datamodules.sources.example_data import write_nifti_folder
from lightning_modules.base import MODEL_KEY, class_path
from medvol.core.build import build
from medvol.core.errors import MedvolError
from medvol.run import fitting, run_data, training
from medvol.run.checkpoint_check import check_checkpoint_family, check_checkpoint_shapes
from medvol.run.override_check import EXTRAS, extra_error, override_error
from medvol.run.refusal import RunDirectoryBefore
from medvol.run.run_check import check_run, check_trainer
from tests.conftest import CONF_DIR, ROOT, compose_cfg, subprocess_env
from tests.payloads import crafted_checkpoint

FAST = ["hardware=cpu", "callbacks.progress_bar=null", "dataset.num_subjects=4", "dataset.size=16",
        "trainer.max_epochs=1"]


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = subprocess_env(OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


def _one_error_line(done: subprocess.CompletedProcess, *expected: str) -> None:
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    errors = [line for line in lines if "medvol: error:" in line]
    assert len(errors) == 1 and all(e in errors[0] for e in expected), lines
    assert "Traceback" not in done.stderr


def _refused_commands(work: Path) -> dict[str, tuple[list[str], str]]:
    """The refused commands of issue 17 (overrides, text of the error line), with the files they need under `work`."""
    classifier = "lightning_modules.discriminative.classifier.ClassifierModel"
    torch.save({"state_dict": {}, "loops": {}, MODEL_KEY: classifier}, work / "foreign.ckpt")
    (work / "corrupt.ckpt").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)
    scans = write_nifti_folder(work / "scans", 3, 12, label=False)
    truncated = scans / "sub-001" / "ct.nii.gz"
    truncated.write_bytes(truncated.read_bytes()[:300])
    crafted_checkpoint(work / "crafted.ckpt", work / "ran", **{MODEL_KEY: "lightning_modules.vqgan.vqgan.VQGAN"})
    return {
        "missing": ([f"ckpt_path={work / 'missing.ckpt'}"], "`ckpt_path`: no file at"),
        "crafted": ([f"ckpt_path={work / 'crafted.ckpt'}"], "asks to load `posix.system` when read"),
        "corrupt": ([f"ckpt_path={work / 'corrupt.ckpt'}"], "is not a readable checkpoint"),
        "foreign": ([f"ckpt_path={work / 'foreign.ckpt'}"],
                    "is a checkpoint of lightning_modules.discriminative.classifier"),
        "max_epochs": (["trainer.max_epochs=-5"], "`trainer.max_epochs`: got -5"),
        "limit_train_batches": (["trainer.limit_train_batches=-1"], "`trainer.limit_train_batches`: got -1"),
        "precision": (["trainer.precision=bf17"], "`trainer.precision`: got 'bf17'"),
        "data_doctor": (["dataset=nifti", f"dataset.root={scans}", "dataset.image_modalities=[ct]"],
                        "the data check found 1 problem(s)"),
    }


@pytest.mark.parametrize(
    "name",
    # Each command costs a Python start-up; one runs in the fast suite, the others with `make test-slow`
    # (test_each_refusal_is_found_before_anything_is_built_or_printed checks all of them in-process).
    ["max_epochs", *(pytest.param(n, marks=pytest.mark.slow)
                     for n in ("missing", "corrupt", "crafted", "foreign", "limit_train_batches", "precision",
                               "data_doctor"))],
)
def test_a_refused_command_prints_its_error_alone_and_leaves_no_run_directory(tmp_path, name):
    work = tmp_path / "work"
    work.mkdir()
    overrides, expected = _refused_commands(work)[name]
    # The synthetic dataset's keys do not exist for the data doctor's NIfTI folder.
    fast = [o for o in FAST if not o.startswith("dataset.")] if name == "data_doctor" else FAST
    done = _cli([*fast, *overrides], tmp_path)
    _one_error_line(done, expected)
    # The error line and at most one hint line: no config print, no progress, no library chatter.
    assert len((done.stdout + done.stderr).splitlines()) <= 2, done.stdout + done.stderr
    runs = tmp_path / "outputs" / "train" / "runs"
    assert not runs.exists() or not any(runs.iterdir())
    assert not (work / "ran").exists()


@pytest.mark.parametrize("name",
                         ["missing", "corrupt", "crafted", "foreign", "max_epochs", "limit_train_batches",
                          "precision", "data_doctor"])
def test_each_refusal_is_found_before_anything_is_built_or_printed(tmp_path, monkeypatch, capsys, caplog, name):
    overrides, expected = _refused_commands(tmp_path)[name]
    cfg = compose_cfg(tmp_path / "run", ["hardware=cpu", *overrides, "print_config=true"], tiny=False)
    built: list[str] = []
    original = run_data.build

    def spy(node, **kwargs):
        built.append(str(node.get("_target_")))
        return original(node, **kwargs)

    # The data are built where they are planned, the callbacks and loggers where the model is fitted.
    monkeypatch.setattr(run_data, "build", spy)
    monkeypatch.setattr(fitting, "build", spy)
    caplog.set_level("INFO")
    with pytest.raises(MedvolError, match=re.escape(expected)):
        training.run(cfg)
    out, err = capsys.readouterr()
    assert out == err == "" and not [r for r in caplog.records if r.levelno < logging.WARNING], caplog.records
    # The checkpoint is judged by its model class before the datamodule or the model is built; the data
    # check needs the datamodule, never the model.
    assert built == ([str(cfg.dataset._target_)] if name == "data_doctor" else [])
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    assert not (tmp_path / "ran").exists()


def _earlier_run(tmp_path: Path) -> Path:
    """A run directory as a finished run leaves it (the refusals below happen before any training)."""
    from medvol.run.run_record import write_run_record

    run_dir = tmp_path / "outputs" / "train" / "runs" / "2026-01-01_00-00-00"
    (run_dir / ".hydra").mkdir(parents=True)
    # The record of the run's settings, as training writes it (the resume continues from it).
    cfg = compose_cfg(run_dir, FAST, tiny=False)
    write_run_record(cfg)
    OmegaConf.save({key: value for key, value in cfg.items() if key != "hydra"}, run_dir / ".hydra" / "config.yaml")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "broken.ckpt").write_bytes(b"not a checkpoint")
    (run_dir / "train.log").write_text("[INFO] the earlier run's record\n")
    return run_dir


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["checkpoints/lats.ckpt", "checkpoints/broken.ckpt"])
def test_a_refused_resume_adds_nothing_to_the_run(tmp_path, checkpoint):
    run_dir = _earlier_run(tmp_path)
    before = _snapshot(run_dir)
    done = _cli([*FAST, f"ckpt_path={run_dir / checkpoint}"], tmp_path)
    _one_error_line(done, "`ckpt_path`", checkpoint.split("/")[1])
    assert _snapshot(run_dir) == before
    assert sorted(p.name for p in run_dir.parent.iterdir()) == [run_dir.name]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_epochs": -5}, "`trainer.max_epochs`: got -5; expected a whole number >= -1"),
        ({"max_steps": -2}, "`trainer.max_steps`"),
        ({"min_epochs": 1.5}, "`trainer.min_epochs`"),
        ({"limit_val_batches": 1.5}, "`trainer.limit_val_batches`: got 1.5"),
        ({"overfit_batches": -0.1}, "`trainer.overfit_batches`"),
        ({"check_val_every_n_epoch": 0}, "`trainer.check_val_every_n_epoch`"),
        ({"val_check_interval": 0.0}, "`trainer.val_check_interval`"),
        ({"log_every_n_steps": -1}, "`trainer.log_every_n_steps`"),
        ({"num_sanity_val_steps": -2}, "`trainer.num_sanity_val_steps`"),
        ({"accumulate_grad_batches": 0}, "`trainer.accumulate_grad_batches`"),
        ({"gradient_clip_val": -1.0}, "`trainer.gradient_clip_val`"),
        ({"gradient_clip_algorithm": "clip"}, "`trainer.gradient_clip_algorithm`"),
        ({"fast_dev_run": -1}, "`trainer.fast_dev_run`"),
        ({"precision": "bf17"}, "`trainer.precision`: got 'bf17'"),
        ({"precision": "16-mixed"}, "on the CPU"),
    ],
)
def test_each_trainer_value_lightning_would_refuse_is_named(values, message):
    good = {"max_epochs": 2, "precision": "32-true", "limit_train_batches": None, "limit_val_batches": 0.5,
            "accumulate_grad_batches": 1, "num_sanity_val_steps": -1, "fast_dev_run": False}
    check_trainer(good, "cpu")
    check_trainer({**good, "precision": "16-mixed", "max_epochs": -1, "limit_test_batches": 3}, "gpu")
    with pytest.raises(MedvolError, match=message.replace("(", r"\(")):
        check_trainer({**good, **values}, "cpu")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dataset=nifti", "`dataset.root` has no value"),
        ("seed=abc", "`seed`: got 'abc'"),
        ("optimized_mode=maximum", "`optimized_mode`: got 'maximum'"),
        ("dataset.num_workers=-1", "`dataset.num_workers`: got -1"),
        ("model.optimizer.lr=-1", "`model.optimizer`: Invalid learning rate: -1"),
        ("model.optimizer.lr=abc", r"`model.optimizer`: .*lr=abc"),
    ],
)
def test_values_pytorch_or_the_loader_would_refuse_are_named(tmp_path, override, message):
    check_run(compose_cfg(tmp_path))
    with pytest.raises(MedvolError, match=message):
        check_run(compose_cfg(tmp_path, [override], tiny=False))


def test_take_back_removes_only_a_directory_made_for_the_refused_command(tmp_path):
    fresh = tmp_path / "runs" / "fresh"
    (fresh / ".hydra").mkdir(parents=True)
    (fresh / "train.log").write_text("")
    before = RunDirectoryBefore.record(str(fresh), ".hydra", str(fresh / "train.log"), resumed=False)
    (fresh / "train.log").write_text("[INFO] Building datamodule\n")
    assert before.take_back() and not fresh.exists()

    # A SLURM requeue comes back to slurm-<job> without ckpt_path: an earlier run, never removed.
    requeued = tmp_path / "runs" / "slurm-42"
    (requeued / "checkpoints").mkdir(parents=True)
    (requeued / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    (requeued / "train.log").write_text("[INFO] first attempt\n")
    before = RunDirectoryBefore.record(str(requeued), ".hydra", str(requeued / "train.log"), resumed=False)
    with (requeued / "train.log").open("a") as log:
        log.write("[INFO] refused attempt\n")
    assert before.take_back()
    assert (requeued / "checkpoints" / "last.ckpt").read_bytes() == b"weights"
    assert (requeued / "train.log").read_text() == "[INFO] first attempt\n"

    # A run from before records, resumed and refused after its record was written: the record goes with the command;
    # a run that held one keeps it.
    (requeued / "run.json").write_text("{}")
    assert before.take_back() and not (requeued / "run.json").exists()
    (requeued / "run.json").write_text("{}")
    kept = RunDirectoryBefore.record(str(requeued), ".hydra", str(requeued / "train.log"), resumed=True)
    assert kept.take_back() and (requeued / "run.json").exists()


def test_take_back_keeps_a_run_once_the_refused_command_has_saved_a_checkpoint(tmp_path):
    # A run that fails after its first checkpoint is a run: resumable, never removed.
    fresh = tmp_path / "runs" / "fresh"
    (fresh / ".hydra").mkdir(parents=True)
    before = RunDirectoryBefore.record(str(fresh), ".hydra", str(fresh / "train.log"), resumed=False)
    (fresh / "train.log").write_text("[INFO] epoch 0\n")
    (fresh / "checkpoints").mkdir()
    (fresh / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    assert not before.take_back()
    assert (fresh / "checkpoints" / "last.ckpt").read_bytes() == b"weights"
    assert (fresh / "train.log").read_text() == "[INFO] epoch 0\n"


class TwoLayers(torch.nn.Module):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.first = torch.nn.Linear(2, width)
        self.second = torch.nn.Linear(width, 1)


def _saved(tmp_path: Path, name: str, drop: str = "", **changes) -> Path:
    """A checkpoint of `TwoLayers` as medvol saves one, with `changes` applied and the key `drop` left out."""
    checkpoint = {"state_dict": TwoLayers().state_dict(), "loops": {}, MODEL_KEY: class_path(TwoLayers()), **changes}
    checkpoint.pop(drop, None)
    torch.save(checkpoint, path := tmp_path / name)
    return path


def check_checkpoint(ckpt_path: str, model: torch.nn.Module) -> None:
    """Both checks, as a run makes them: the family before the model is built, then the shapes."""
    check_checkpoint_shapes(ckpt_path, lambda: model, check_checkpoint_family(ckpt_path, class_path(model)))


def test_each_checkpoint_that_cannot_resume_this_model_is_named(tmp_path):
    model = TwoLayers()
    check_checkpoint(str(_saved(tmp_path, "good.ckpt")), model)
    first_layer = {k: v for k, v in model.state_dict().items() if k.startswith("first.")}
    cases = [
        (_saved(tmp_path, "vqgan.ckpt", **{MODEL_KEY: "lightning_modules.vqgan.vqgan.VQGAN"}),
         "is a checkpoint of lightning_modules.vqgan.vqgan.VQGAN, but the config builds tests.test_refusals.TwoLayers"),
        (_saved(tmp_path, "wider.ckpt", state_dict=TwoLayers(width=5).state_dict()),
         r"has first.weight of shape \(5, 2\) but the model config gives \(3, 2\)"),
        (_saved(tmp_path, "partial.ckpt", state_dict=first_layer),
         r"lacks weights the model needs \(first: second.bias\)"),
        (_saved(tmp_path, "weights_only.ckpt", drop="loops"), "not a Lightning training checkpoint"),
    ]
    for path, message in cases:
        with pytest.raises(MedvolError, match=message):
            check_checkpoint(str(path), model)


def test_a_misspelt_key_or_option_is_one_line_naming_the_override():
    assert override_error(CONF_DIR, "train", ["model.n_codes=64", "debug=fast", "+extra=1"]) is None
    key = override_error(CONF_DIR, "train", ["trainer.max_epochs=2", "modle.lr=1"])
    assert key.startswith("`modle.lr=1`: cannot set this key") and "\n" not in key
    option = override_error(CONF_DIR, "train", ["model=vqgn"])
    assert option.startswith("`model=vqgn`: no such option in the `model` group; expected one of: ")
    assert "vqgan" in option
    # Sweeps and flags are Hydra's to read.
    assert override_error(CONF_DIR, "train", ["-m", "model.optimizer.lr=1e-4,3e-4"]) is None
    # Each entry point names its own command for listing its keys.
    for entry in ("predict", "export"):
        line = override_error(CONF_DIR, entry, ["ckpt_path=x.ckpt", "outptu_dir=out"])
        assert line.startswith("`outptu_dir=out`: cannot set this key") and f"`python {entry}.py --cfg job`" in line


@pytest.mark.slow
def test_a_misspelt_key_on_the_command_line_exits_2(tmp_path):
    _one_error_line(_cli(["modle.lr=1"], tmp_path), "`modle.lr=1`")
    assert not (tmp_path / "outputs").exists()


def test_a_target_that_cannot_be_imported_is_one_line():
    with pytest.raises(MedvolError, match=r"`_target_: torch.optim.Nope`: no such class"):
        build(OmegaConf.create({"_target_": "torch.optim.Nope", "_partial_": True}))
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(MedvolError, match=r"WandbLogger` needs a package that is not installed"):
            build(OmegaConf.create({"_target_": "pytorch_lightning.loggers.WandbLogger", "offline": True}))


@pytest.mark.parametrize("override, hidden, extra", [
    ("hparams_search=optuna", "hydra_plugins.hydra_optuna_sweeper", "sweep"),
    ("hydra/launcher=slurm", "hydra_plugins.hydra_submitit_launcher", "slurm"),
    ("logger=wandb", "wandb", "wandb"),
])
def test_an_option_whose_extra_is_missing_is_one_line_naming_the_extra(monkeypatch, override, hidden, extra):
    """Issue 49 item 13: without the sweep or slurm extra Hydra stopped in its own multi-line error."""
    monkeypatch.setitem(sys.modules, hidden, None)  # as if not installed: importing it fails
    message = extra_error(["-m", override, "model.optimizer.lr=1e-4,3e-4"])
    assert message == (f"`{override}` needs {EXTRAS[tuple(override.split('='))][0]}, which is not installed; "
                       f"install medvol's {extra} extra: pip install -e '.[{extra}]'")
    monkeypatch.delitem(sys.modules, hidden)
    if importlib.util.find_spec(hidden) is not None:
        assert extra_error(["-m", override]) is None


def _suggested_installs(monkeypatch) -> dict[str, str]:
    """Extra -> the line the refusal suggests when that extra's packages are missing."""
    lines = {}
    for (group, option), (_, modules, extra) in EXTRAS.items():
        with monkeypatch.context() as hidden:
            for module in modules:
                hidden.setitem(sys.modules, module, None)
            lines[extra] = extra_error([f"{group}={option}"]).split("extra: ")[1]
    return lines


def test_every_extra_named_is_one_pyproject_declares(monkeypatch):
    declared = importlib.metadata.metadata("medvol").get_all("Provides-Extra")
    for extra, line in _suggested_installs(monkeypatch).items():
        assert extra in declared and shlex.split(line) == ["pip", "install", "-e", f".[{extra}]"], (extra, declared)


@pytest.mark.slow
def test_each_suggested_install_line_pastes_into_bash(monkeypatch):
    """Each refusal's line, pasted into bash in the repository: pip (a dry run, offline, so only for the extras whose
    packages are here already) finds the extra."""
    env = {**subprocess_env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    present = {extra for _, modules, extra in EXTRAS.values() if all(importlib.util.find_spec(m) for m in modules)}
    for extra, line in _suggested_installs(monkeypatch).items():
        if extra in present:
            done = subprocess.run(["bash", "-c", f"{line} --dry-run --no-index --no-build-isolation"], cwd=ROOT,
                                  capture_output=True, text=True, timeout=240, env=env)
            assert done.returncode == 0, done.stderr[-2000:]
            assert "does not provide the extra" not in done.stdout + done.stderr, (extra, done.stderr)


@pytest.mark.slow
def test_a_sweep_without_the_sweep_extra_stops_with_the_one_line(tmp_path):
    """train.py as typed in docs/multi_gpu.md, with the Optuna sweeper hidden as if not installed."""
    hide = ("import runpy, sys; sys.modules['hydra_plugins.hydra_optuna_sweeper'] = None; "
            f"sys.argv = ['train.py', '-m', 'hparams_search=optuna']; runpy.run_path({str(ROOT / 'train.py')!r}, "
            "run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", hide], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=240)
    _one_error_line(done, "pip install -e '.[sweep]'")
