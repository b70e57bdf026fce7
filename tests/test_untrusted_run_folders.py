"""A shared model is data, round 2 (issue 46): the routes an attacker took on 7a6693b with files alone (a run folder,
a checkpoint), each through the entry point it took, refused in one line with nothing run and nothing written; and a
genuine run folder predicting and resuming as before.

Each attack asks, if it worked, to unpickle `evil.pt` in full (`torch.load(weights_only=False)`), whose unpickling
runs `touch <marker>`: a marker file means code ran.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml

from medvol.core.errors import MedvolError
from medvol.core.file_data import MAX_VALUES
from medvol.run.exporting import export
from medvol.run.predicting import predict
from medvol.run.run_record import RECORD_FILE
from medvol.run.training import run
from tests.conftest import ROOT, compose_cfg, subprocess_env
from tests.medvol.run.test_predict import predict_cfg, trained_run, write_lps_scans  # noqa: F401 - a fixture
from tests.payloads import RunsACommand

EXPORT_CONF = ROOT / "conf"


@pytest.fixture
def attack(trained_run, tmp_path):  # noqa: F811
    """(a copy of a genuine run folder, the payload file, the marker, one input scan)."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    torch.save(RunsACommand(tmp_path / "ran"), payload := tmp_path / "evil.pt")
    scan = write_lps_scans(tmp_path / "scans", 1) / "case00" / "image.nii.gz"
    return run_dir, payload, tmp_path / "ran", scan


def _load_target(payload: Path) -> dict:
    return {"_target_": "torch.load", "f": str(payload), "weights_only": False}


def _oc_create(payload: Path) -> str:
    return "${oc.create:{_target_:torch.load,f:'" + str(payload) + "',weights_only:false}}"


def _predicts(run_dir: Path, scan: Path, out: Path) -> None:
    predict(predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"input={scan}", f"output_dir={out}"))


def _export_cfg(*overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(EXPORT_CONF), job_name="export"):
        cfg = compose(config_name="export", overrides=list(overrides))
    GlobalHydra.instance().clear()
    return cfg


def _legacy(run_dir: Path) -> dict:
    """The run as a medvol before run records left it (its record removed); its config, to edit."""
    (run_dir / RECORD_FILE).unlink()
    return yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())


def _save_legacy(run_dir: Path, config: dict) -> None:
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))


def _record(run_dir: Path) -> dict:
    return json.loads((run_dir / RECORD_FILE).read_text())


def _save_record(run_dir: Path, record: dict) -> None:
    (run_dir / RECORD_FILE).write_text(json.dumps(record))


def test_an_old_config_whose_hydra_node_holds_a_target_another_key_refers_to_is_refused_by_predict(attack):
    run_dir, payload, marker, scan = attack
    config = _legacy(run_dir)
    config["hydra"] = {"payload": _load_target(payload)}
    config["model"]["evil"] = "${hydra.payload}"
    _save_legacy(run_dir, config)
    with pytest.raises(MedvolError, match=r"config\.yaml: the run's config does not resolve \(.*hydra"):
        _predicts(run_dir, scan, run_dir.parent / "out")
    assert not marker.exists() and not (run_dir.parent / "out").exists()


def test_an_old_config_that_creates_a_target_by_oc_create_is_refused_by_export(attack):
    run_dir, payload, marker, _ = attack
    config = _legacy(run_dir)
    config["model"]["evil"] = _oc_create(payload)
    _save_legacy(run_dir, config)
    cfg = _export_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", "format=torchscript",
                      f"output_dir={run_dir.parent / 'export'}")
    with pytest.raises(MedvolError, match=r"`model\.evil` calls the resolver `oc\.create`"):
        export(cfg)
    assert not marker.exists() and not (run_dir.parent / "export").exists()


def test_an_old_config_with_an_escaped_interpolation_is_refused_once_resolved(attack):
    # `\${...}` resolves to the text `${...}`, which a second pass (a merge, an instantiate) would evaluate.
    run_dir, payload, marker, scan = attack
    config = _legacy(run_dir)
    config["model"]["evil"] = "\\" + _oc_create(payload)
    _save_legacy(run_dir, config)
    with pytest.raises(MedvolError, match=r"`model\.evil` holds an interpolation"):
        _predicts(run_dir, scan, run_dir.parent / "out")
    assert not marker.exists()


def test_an_old_config_of_a_billion_laughs_is_refused_before_it_is_copied(attack):
    run_dir, _, _, scan = attack
    (run_dir / RECORD_FILE).unlink()
    # 2^21 values here (the bound's work shows when it is removed); 40 levels would be 2^40 and never end.
    lines = ["a0: &a0 [x, x]"] + [f"a{k}: &a{k} [*a{k - 1}, *a{k - 1}]" for k in range(1, 21)] + ["model: *a20"]
    (run_dir / ".hydra" / "config.yaml").write_text("\n".join(lines) + "\n")
    with pytest.raises(MedvolError, match=rf"holds more than {MAX_VALUES:,} values"):
        _predicts(run_dir, scan, run_dir.parent / "out")


@pytest.mark.parametrize(("edit", "refusal"), [
    (lambda r, p: r["values"]["model"].update(n_codes=_oc_create(p)),
     r"`values\.model\.n_codes` holds an interpolation"),
    (lambda r, p: r["values"]["model"].update(optimizer=_load_target(p)),
     r"`model\.optimizer\._target_` is a Hydra key"),
    (lambda r, p: r["values"]["callbacks"].update(
        evil={"_target_": "pytorch_lightning.callbacks.LambdaCallback", "on_fit_start": _load_target(p)}),
     r"`callbacks\.evil\._target_` is a Hydra key"),
    (lambda r, p: r["values"]["model"].update(evil=1), r"`model\.evil` is no setting of medvol's config"),
    (lambda r, p: r["values"]["model"].update(n_codes=[1, 2]), r"`model\.n_codes` is list .* where medvol's config has "
     r"number"),
    (lambda r, p: r["choices"].update(model="../../evil"), r"`choices\.model` is '\.\./\.\./evil'; expected one of"),
    (lambda r, p: r.update(format_extra=True), r"run\.json: `format_extra` extra inputs are not permitted"),
], ids=["interpolation", "target-by-value", "lambda-callback", "new-key", "type-change", "choice-outside-conf",
        "unknown-key"])
def test_a_crafted_run_record_is_refused_by_predict(attack, edit, refusal):
    run_dir, payload, marker, scan = attack
    record = _record(run_dir)
    edit(record, payload)
    _save_record(run_dir, record)
    with pytest.raises(MedvolError, match=refusal):
        _predicts(run_dir, scan, run_dir.parent / "out")
    assert not marker.exists() and not (run_dir.parent / "out").exists()


def test_a_plan_with_a_target_among_its_values_is_refused_wherever_it_is_read(attack):
    # On 7a6693b plan.json was merged into the model after the config's check (predict, run_dir= and resume).
    run_dir, payload, marker, scan = attack
    plan = {"features": [_load_target(payload)], "spacing": [1.0, 1.0, 1.0]}
    (run_dir / "plan.json").write_text(json.dumps(plan))
    refusal = r"plan\.json: `\w+(\.\d+)?` .*; expected a plan written by medvol"
    with pytest.raises(MedvolError, match=refusal):
        _predicts(run_dir, scan, run_dir.parent / "out")
    (run_dir / RECORD_FILE).unlink()
    with pytest.raises(MedvolError, match=refusal):
        _predicts(run_dir, scan, run_dir.parent / "out")
    assert not marker.exists() and not (run_dir.parent / "out").exists()


def test_a_checkpoint_whose_class_names_create_a_target_is_refused_by_predict_and_export(attack):
    # A checkpoint alone, readable by the weights-only unpickler, in an untouched genuine run folder.
    run_dir, payload, marker, scan = attack
    last = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    checkpoint["hyper_parameters"]["class_names"] = _oc_create(payload)
    torch.save(checkpoint, last)
    refusal = r"^`ckpt_path`: .*last\.ckpt: `hyper_parameters\.class_names` holds an interpolation"
    with pytest.raises(MedvolError, match=refusal):
        _predicts(run_dir, scan, run_dir.parent / "out")
    with pytest.raises(MedvolError, match=refusal):
        export(_export_cfg(f"ckpt_path={last}", "format=torchscript", f"output_dir={run_dir.parent / 'export'}"))
    assert not marker.exists() and not (run_dir.parent / "out").exists() and not (run_dir.parent / "export").exists()


@pytest.mark.parametrize("levels", [21, 40])
def test_a_checkpoint_whose_hyper_parameters_share_one_list_many_times_is_refused(attack, levels):
    # 40 levels of [x, x] pickle as 40 small lists through the memo; copied as a tree (OmegaConf.create) they are
    # 2^40 values, and the copy never ends. 21 levels (2^21 values) shows the bound's work where it is removed.
    run_dir, _, _, scan = attack
    last = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    shared: list = [0]
    for _ in range(levels):
        shared = [shared, shared]
    checkpoint["hyper_parameters"]["class_names"] = shared
    torch.save(checkpoint, last)
    with pytest.raises(MedvolError, match=rf"last\.ckpt: holds more than {MAX_VALUES:,} values"):
        _predicts(run_dir, scan, run_dir.parent / "out")


def test_a_resume_refuses_recorded_overrides_that_would_set_hydra_or_interpolate(trained_run, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    for override, refusal in [
        ("hydra.searchpath=[file:///tmp]", r"is a sweep or sets Hydra itself"),
        ("model.evil=${oc.env:HOME}", r"holds an interpolation"),
    ]:
        record = _record(run_dir)
        record["overrides"].append(override)
        _save_record(run_dir, record)
        cfg = compose_cfg(run_dir, [f"ckpt_path={run_dir}/checkpoints/last.ckpt", "trainer.max_epochs=2"], tiny=False)
        with pytest.raises(MedvolError, match=refusal):
            run(cfg)
        record["overrides"].pop()
        _save_record(run_dir, record)


def test_a_genuine_run_predicts_the_same_voxels_from_its_record_and_as_an_old_run(trained_run, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    scan = write_lps_scans(tmp_path / "scans", 1) / "case00" / "image.nii.gz"
    _predicts(run_dir, scan, tmp_path / "from_record")
    (run_dir / RECORD_FILE).unlink()
    _predicts(run_dir, scan, tmp_path / "as_old_run")
    names = sorted(p.name for p in (tmp_path / "from_record").glob("*.nii.gz"))
    assert names and names == sorted(p.name for p in (tmp_path / "as_old_run").glob("*.nii.gz"))
    for name in names:
        a, b = (nib.load(str(tmp_path / folder / name)) for folder in ("from_record", "as_old_run"))
        assert np.array_equal(a.get_fdata(), b.get_fdata()) and np.array_equal(a.affine, b.affine), name


def test_a_resume_given_only_the_checkpoint_continues_the_run_as_it_was_configured(tmp_path):
    # docs/reliability.md's resume: the run's own overrides, not retyped; the command's `trainer.max_epochs` wins.
    common = ["seed=11", "trainer.deterministic=true", "logger=csv", "model.n_codes=16"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(compose_cfg(straight, [*common, "trainer.max_epochs=2"]))
    run(compose_cfg(resumed, [*common, "trainer.max_epochs=1"]))
    (resumed / ".hydra").mkdir()
    last = resumed / "checkpoints" / "last.ckpt"
    # Nothing of the first command is repeated: without the record this would build the default, larger VQ-GAN.
    run(compose_cfg(resumed, [f"ckpt_path={last}", "trainer.max_epochs=2"], tiny=False))
    a = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(last, weights_only=True)
    assert (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"]) and b["epoch"] == 1
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["predict", "export"])
def test_the_scripts_print_one_line_and_exit_2_for_a_crafted_checkpoint(attack, entry):
    run_dir, payload, marker, scan = attack
    last = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    checkpoint["hyper_parameters"]["class_names"] = _oc_create(payload)
    torch.save(checkpoint, last)
    out = run_dir.parent / "out"
    args = [f"input={scan}", "device=cpu"] if entry == "predict" else ["format=torchscript"]
    done = subprocess.run(
        [sys.executable, str(ROOT / f"{entry}.py"), f"ckpt_path={last}", f"output_dir={out}", *args],
        cwd=run_dir.parent, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240,
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "holds an interpolation" in lines[0], lines
    assert not marker.exists() and not out.exists()


def test_a_fold_record_may_not_send_predict_to_a_checkpoint_outside_its_run(tmp_path):
    sweep = tmp_path / "sweep"
    record = {"fold": 0, "checkpoint": "../../elsewhere/last.ckpt", "subjects": ["a"],
              "labels": {"num_classes": 2, "regions": None, "class_names": ["lesion"], "threshold": None}}
    (sweep / "0" / "validation").mkdir(parents=True)
    (sweep / "0" / "validation" / "fold.json").write_text(json.dumps(record))
    with pytest.raises(MedvolError, match=r"fold\.json: `checkpoint` \.\./\.\./elsewhere/last\.ckpt lies outside"):
        predict(predict_cfg(f"run_dir={sweep}", f"input={tmp_path}", f"output_dir={tmp_path / 'out'}"))
    record["subjects"] = ["../../x"]
    (sweep / "0" / "validation" / "fold.json").write_text(json.dumps(record))
    with pytest.raises(MedvolError, match=r"fold\.json: `subjects\.0` string should match pattern"):
        predict(predict_cfg(f"run_dir={sweep}", f"input={tmp_path}", f"output_dir={tmp_path / 'out'}"))


def test_a_record_may_name_a_class_of_the_users_own_only_where_the_command_names_it_again(trained_run, tmp_path):  # noqa: F811
    # A run trained with a callback of the user's own (`+callbacks.mine._target_=...` on its command line) records
    # the key, never the class: a resume must name a class there again, and the command's class is the one built.
    from medvol.run.resume import resumed

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    mine = "tests.ddp_support.RankRecorder"
    record = _record(run_dir)
    record["own_classes"] = ["callbacks.mine"]
    _save_record(run_dir, record)
    resume = [f"ckpt_path={run_dir}/checkpoints/last.ckpt", "train=false"]
    with pytest.raises(MedvolError, match=r"run\.json: the run built `callbacks\.mine` from a class of your own; name "
                                          r"it again on this command"):
        resumed(compose_cfg(run_dir, resume, tiny=False))
    cfg, source = resumed(compose_cfg(run_dir, [*resume, f"+callbacks.mine._target_={mine}"], tiny=False))
    assert source == run_dir / RECORD_FILE and cfg.callbacks.mine._target_ == mine
