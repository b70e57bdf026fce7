"""A shared model is data by design (issue 59, routes 1, 2, 4 and 16): a run's record holds choices and values, never
a class or a place to write; reading it composes medvol's own config and sets the values on it, checked.

Route 1's payload is a class reached through module attributes (`medvol.core.atomic_checkpoint.torch._guards.
unittest.main`, which the old dotted-path allowlist let through) whose `argv` discovers a test file shipped in the
run folder: that file, imported, touches a marker. Route 2's is `logging.io.FileIO` in write mode, which truncates
the file it names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from lightning_modules.base import MODEL_KEY
from medvol.core.errors import MedvolError
from medvol.core.literal_text import literal_names
from medvol.run.exporting import export
from medvol.run.predicting import predict
from medvol.run.resume import resumed
from medvol.run.run_record import RECORD_FILE, read_record
from medvol.run.trained_run import open_trained_run
from medvol.run.training import run
from tests.conftest import compose_cfg
from tests.medvol.run.test_predict import predict_cfg, trained_run, write_lps_scans  # noqa: F401 - a fixture
from tests.test_untrusted_run_folders import _export_cfg

SEGMENTATION_CLASS = "lightning_modules.segmentation.segmentation.Segmenter"
ATTRIBUTE_PATH = "medvol.core.atomic_checkpoint.torch._guards.unittest.main"


def shipped_test(run_dir: Path, marker: Path) -> dict:
    """A `test_shipped.py` in the run folder that touches `marker` when imported, and the `unittest.main` node that
    would discover and import it."""
    (run_dir / "test_shipped.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    return {"_target_": ATTRIBUTE_PATH, "module": None, "exit": False,
            "argv": ["x", "discover", "-s", str(run_dir), "-p", "test_shipped.py"]}


@pytest.fixture
def copied(trained_run, tmp_path):  # noqa: F811
    """(a copy of a genuine VQ-GAN run, a marker that code ran, one input scan)."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    scan = write_lps_scans(tmp_path / "scans", 1) / "case00" / "image.nii.gz"
    return run_dir, tmp_path / "ran", scan


def _record(run_dir: Path) -> dict:
    return json.loads((run_dir / RECORD_FILE).read_text())


def _save(run_dir: Path, record: dict) -> None:
    (run_dir / RECORD_FILE).write_text(json.dumps(record))


def _predicts(run_dir: Path, scan: Path) -> None:
    predict(predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"input={scan}",
                        f"output_dir={run_dir.parent / 'out'}"))


def _resolved_config(run_dir: Path) -> dict:
    """The run's config as a format-1 record held it: resolved, `_target_`s included."""
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    return OmegaConf.to_container(OmegaConf.create(config), resolve=True)


def _resume_cfg(run_dir: Path, *extra: str):
    return compose_cfg(run_dir, [f"ckpt_path={run_dir}/checkpoints/last.ckpt", *extra], tiny=False)


def test_a_record_holds_choices_and_values_and_no_class_path_or_folder(copied):
    run_dir, _, _ = copied
    record = _record(run_dir)
    assert record["medvol_run_record"] == 2
    assert record["choices"]["model"] == "vqgan" and record["choices"]["dataset"] == "nifti"
    text = json.dumps(record["values"])
    assert "_target_" not in text and "_partial_" not in text
    # Where the run wrote (checkpoints, logs, predictions) is its reader's to say: no folder of the run is recorded.
    assert str(run_dir.parent) not in text and "paths" not in record["values"]


@pytest.mark.parametrize("where", ["values.model.optimizer", "values.callbacks.evil", "values.model"])
def test_a_record_naming_a_class_reached_through_module_attributes_runs_nothing(copied, where):
    # Route 1: `medvol.core.atomic_checkpoint.torch._guards.unittest.main` passed the allowlist by its first part.
    run_dir, marker, scan = copied
    record = _record(run_dir)
    node = record
    for part in where.split(".")[:-1]:
        node = node[part]
    if where == "values.model":
        node["model"]["_target_"] = ATTRIBUTE_PATH
    else:
        node[where.split(".")[-1]] = shipped_test(run_dir, marker)
    _save(run_dir, record)
    refusal = r"run\.json: `[\w.]*_target_` is a Hydra key; a file read as a run's settings"
    with pytest.raises(MedvolError, match=refusal):
        _predicts(run_dir, scan)
    with pytest.raises(MedvolError, match=r"is a Hydra key"):
        resumed(_resume_cfg(run_dir, "train=false"))
    with pytest.raises(MedvolError, match=r"is a Hydra key"):
        export(_export_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", "format=torchscript",
                           f"output_dir={run_dir.parent / 'export'}"))
    assert not marker.exists() and not (run_dir.parent / "out").exists()


def test_an_old_record_or_config_naming_such_a_class_is_converted_only_to_medvols_own(copied):
    # The same payload in a format-1 record and in an old run's `.hydra/config.yaml`: a class that is not the one
    # medvol's config builds at that key is the user's own, and must be named again by the reading command.
    run_dir, marker, scan = copied
    config = _resolved_config(run_dir)
    config["model"]["optimizer"] = shipped_test(run_dir, marker)
    old = {"medvol_run_record": 1, "config": config, "relative_paths": [], "overrides": []}
    _save(run_dir, old)
    refusal = r"the run built `model\.optimizer` from a class of your own; name it again on this command"
    with pytest.raises(MedvolError, match=refusal):
        _predicts(run_dir, scan)
    with pytest.raises(MedvolError, match=refusal):
        resumed(_resume_cfg(run_dir, "train=false"))
    (run_dir / RECORD_FILE).unlink()
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(MedvolError, match=refusal):
        _predicts(run_dir, scan)
    # A callback of a class not medvol's: a resume builds callbacks, so it is refused there too.
    config["model"].pop("optimizer")
    config["callbacks"]["evil"] = shipped_test(run_dir, marker)
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(MedvolError, match=r"the run built `callbacks\.evil` from a class of your own"):
        resumed(_resume_cfg(run_dir, "train=false"))
    assert not marker.exists() and not (run_dir.parent / "out").exists()


def test_a_genuine_old_record_converts_to_the_same_settings_as_the_new_one(copied):
    run_dir, _, _ = copied
    new = read_record(run_dir)
    config = _resolved_config(run_dir)
    _save(run_dir, {"medvol_run_record": 1, "config": config, "relative_paths": [], "overrides": []})
    old = read_record(run_dir)
    assert old is not None and new is not None
    assert old.choices["model"] == new.choices["model"] and old.choices["dataset"] == new.choices["dataset"]
    assert old.own_classes == [] and old.values["model"] == new.values["model"]


def test_a_checkpoint_restoring_a_class_in_place_of_a_number_truncates_nothing(tmp_path):
    # Route 2: `hyper_parameters.num_classes` alone, in a file that loads with weights_only=True.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    cfg = compose_cfg(tmp_path / "run", ["model=segmentation", "model.num_classes=3", "model.in_channels=1",
                                         "dataset.image_modalities=[t1]"])
    ckpt = tmp_path / "segmentation.ckpt"
    payload = {"_target_": "medvol.core.atomic_checkpoint.logging.io.FileIO", "file": str(victim), "mode": "w"}
    torch.save({MODEL_KEY: SEGMENTATION_CLASS, "state_dict": {}, "loops": {},
                "hyper_parameters": {"num_classes": payload, "in_channels": 1}}, ckpt)
    refusal = r"segmentation\.ckpt: `hyper_parameters\.num_classes\._target_` is a Hydra key"
    with pytest.raises(MedvolError, match=refusal):
        open_trained_run(str(ckpt), config=cfg).module(torch.device("cpu"))
    torch.save({MODEL_KEY: SEGMENTATION_CLASS, "state_dict": {}, "loops": {},
                "hyper_parameters": {"num_classes": [3], "in_channels": 1}}, ckpt)
    with pytest.raises(MedvolError, match=r"`hyper_parameters\.num_classes` is list \(\[3\]\) where the run's "
                                          r"`model\.num_classes` is number"):
        open_trained_run(str(ckpt), config=cfg).module(torch.device("cpu"))
    assert victim.read_text() == "precious"


def test_a_resume_writes_only_inside_the_run_whatever_its_record_says(copied, tmp_path):
    # Route 4: the checkpoint, summary, prediction and log folders set to absolute paths outside the run.
    run_dir, _, _ = copied
    outside = tmp_path / "outside"
    outside.mkdir()
    record = _record(run_dir)
    values = record["values"]
    values["trainer"]["default_root_dir"] = str(outside)
    values["callbacks"]["model_checkpoint"]["dirpath"] = str(outside / "ckpt")
    values["callbacks"]["run_summary"]["output_dir"] = str(outside)
    values["callbacks"]["nifti_predictions"]["output_dir"] = str(outside / "predictions")
    values["dataset"]["split_file"] = str(outside / "split.json")
    _save(run_dir, record)
    cfg, _ = resumed(_resume_cfg(run_dir, "trainer.max_epochs=2"))
    assert cfg.callbacks.run_summary.output_dir == str(run_dir)
    assert cfg.callbacks.model_checkpoint.dirpath == str(run_dir / "checkpoints")
    run(_resume_cfg(run_dir, "trainer.max_epochs=2"))
    assert list(outside.iterdir()) == []
    assert list((run_dir / "checkpoints").glob("epoch001-*.ckpt"))


def test_a_dataset_name_that_would_interpolate_never_reaches_a_config():
    # Route 16's structural half: the dataset's reader refuses `${` too (tests/test_untrusted_readers.py).
    assert literal_names(["edema", "tumour core"], "dataset.json") == ["edema", "tumour core"]
    with pytest.raises(MedvolError, match=r"dataset\.json: the name '\$\{oc\.create:.*' holds `\$\{`"):
        literal_names(["edema", "${oc.create:{_target_:os.system}}"], "dataset.json")


@pytest.mark.parametrize("name", ["../../../escaped", "/tmp/escaped", "~/escaped"])
def test_a_record_may_not_turn_a_file_name_into_a_path_out_of_the_run(copied, name):
    # Found attacking the new design: a checkpoint's file name template is no path, but Lightning joins it to the
    # checkpoint folder, so `../../x` or an absolute name would write outside the run.
    run_dir, _, scan = copied
    record = _record(run_dir)
    record["values"]["callbacks"]["model_checkpoint"]["filename"] = name
    _save(run_dir, record)
    with pytest.raises(MedvolError, match=r"`callbacks\.model_checkpoint\.filename` is .*, a path out of its folder "
                                          r"where medvol's config has a name"):
        resumed(_resume_cfg(run_dir, "trainer.max_epochs=2"))
    record["values"]["callbacks"]["model_checkpoint"]["filename"] = "fine-{epoch}"
    record["values"]["dataset"]["root"] = "/data/elsewhere/../scans"
    _save(run_dir, record)
    cfg, _ = resumed(_resume_cfg(run_dir, "trainer.max_epochs=2"))
    # A path where medvol's config takes one (the data's folder, to read) stays the record's.
    assert cfg.callbacks.model_checkpoint.filename == "fine-{epoch}" and cfg.dataset.root == "/data/elsewhere/../scans"


def test_a_record_asking_for_thousands_of_cpu_ranks_is_refused_before_one_starts(copied):
    # Found attacking the new design: a resume runs the recorded trainer, and on the CPU each device is a process.
    run_dir, _, _ = copied
    record = _record(run_dir)
    record["values"]["trainer"]["devices"] = 10_000
    _save(run_dir, record)
    with pytest.raises(MedvolError, match=r"`trainer\.devices=10000` asks for 10000 processes on the CPU; this "
                                          r"machine has \d+ cores"):
        run(_resume_cfg(run_dir, "trainer.max_epochs=2"))
    assert not list((run_dir / "checkpoints").glob("epoch001-*"))


def test_a_command_naming_the_runs_own_model_again_keeps_the_runs_model_settings(copied):
    # docs/ddpm.md's `python train.py model=ddpm ckpt_path=<run>/... train=false test=true`: the group the command
    # names again is the run's, so the run's settings (a tiny network) stay; only what the command types changes.
    run_dir, _, _ = copied
    n_hiddens = _record(run_dir)["values"]["model"]["n_hiddens"]
    cfg, _ = resumed(_resume_cfg(run_dir, "model=vqgan", "train=false", "test=true"))
    assert cfg.model.n_hiddens == n_hiddens != 16 and cfg.train is False and cfg.test is True
