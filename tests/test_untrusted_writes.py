"""A shared model is data, round 3 (issue 59), routes 5 to 7: nothing is written outside the output folder, and
nothing through a link.

Route 5: a run folder whose files and folders are symbolic links to files outside it; a resume must refuse it in one
line (exit 2 through train.py) with every outside file as it was, and each writer refuses a link on its own.
Routes 6 and 7: subject ids with separators (`../../../escaped`) in an nnU-Net `dataset.json` or a
`dataset.list_file`; the dataset refuses them where it reads them (one line naming the file and the id), and every
writer that makes a file name of a subject id sanitises it first.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from benchmarks.segmentation.nnunet_plans import write_raw
from callbacks.run_summary import RunSummary
from datamodules.sources.nifti import NiftiDataModule
from datamodules.sources.nnunet_raw import NnunetDataModule
from medvol.core.console import log_file
from medvol.core.errors import MedvolError
from medvol.core.run_files import open_in, refuse_links
from medvol.core.subject_names import SubjectFiles, check_subject_id
from medvol.core.tensorboard_logger import MedvolTensorBoardLogger
from medvol.run.cross_validation import label_map_file
from medvol.run.fold_records import write_json
from medvol.run.training import run
from medvol.volumes.prediction_writer import PredictionWriter
from tests.conftest import ROOT, compose_cfg, subprocess_env
from tests.medvol.run.test_predict import trained_run  # noqa: F401 - a fixture

ESCAPING = "../../../escaped"


def outside_files(folder: Path, names: list[str]) -> dict[Path, bytes]:
    """Files outside the run, each with content of its own, for links to point at."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {folder / name: f"outside file {name}\n".encode() for name in names}
    for path, content in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return files


def untouched(folder: Path, files: dict[Path, bytes]) -> bool:
    """Whether `folder` holds exactly `files`, each as it was."""
    found = sorted(p for p in folder.rglob("*") if p.is_file())
    return found == sorted(files) and all(p.read_bytes() == c for p, c in files.items())


def one_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, lines[-20:]
    assert lines[0].startswith("medvol: error: ")
    return lines[0]


def train_py(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides], cwd=cwd, capture_output=True, text=True,
        env=subprocess_env(OMP_NUM_THREADS="1"), timeout=300,
    )


# Route 5: a run folder holding links.

def linked_run(trained_run: Path, tmp_path: Path) -> tuple[Path, Path, dict[Path, bytes]]:  # noqa: F811
    """A genuine run whose train.log, summary.json, metrics table and tensorboard/ are links to outside files."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    outside = tmp_path / "outside"
    files = outside_files(outside, ["train.log", "summary.json", "metrics.csv", "tensorboard/hparams.yaml"])
    for name in ("train.log", "summary.json"):
        (run_dir / name).unlink(missing_ok=True)
        (run_dir / name).symlink_to(outside / name)
    (run_dir / "validation").mkdir(exist_ok=True)
    (run_dir / "validation" / "metrics.csv").symlink_to(outside / "metrics.csv")
    shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
    (run_dir / "tensorboard").symlink_to(outside / "tensorboard", target_is_directory=True)
    return run_dir, outside, files


@pytest.mark.slow
def test_a_resume_of_a_run_folder_holding_links_is_refused_in_one_line_through_train_py(trained_run, tmp_path):  # noqa: F811
    run_dir, outside, files = linked_run(trained_run, tmp_path)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    done = train_py(f"ckpt_path={run_dir}/checkpoints/last.ckpt", "trainer.max_epochs=2", "logger=tensorboard",
                    cwd=tmp_path)
    line = one_line(done)
    assert "symbolic link" in line and str(run_dir) in line, line
    assert untouched(outside, files)
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_a_resume_in_process_refuses_a_run_folder_holding_a_link(trained_run, tmp_path):  # noqa: F811
    run_dir, outside, files = linked_run(trained_run, tmp_path)
    cfg = compose_cfg(run_dir, [f"ckpt_path={run_dir}/checkpoints/last.ckpt", "trainer.max_epochs=2"], tiny=False)
    with pytest.raises(MedvolError, match=r"holds a symbolic link") as refused:
        run(cfg)
    assert "\n" not in str(refused.value)
    assert untouched(outside, files)


def linked_files(tmp_path: Path) -> tuple[Path, Path, dict[Path, bytes]]:
    """An output folder whose `file` and `folder/` are links to outside, and the outside files."""
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "outside"
    files = outside_files(outside, ["file", "folder/inner"])
    (out / "file").symlink_to(outside / "file")
    (out / "folder").symlink_to(outside / "folder", target_is_directory=True)
    return out, outside, files


def _summary(out: Path, name: str) -> None:
    summary = RunSummary(str(out))
    summary.summary_file = lambda stage: out / name  # type: ignore[method-assign]
    summary.summary = lambda trainer: {"run_dir": str(out)}  # type: ignore[method-assign]
    summary._write(None, "fit")


def _table(out: Path, name: str) -> None:
    writer = PredictionWriter(out / Path(name).parent, root=out)
    writer._write_table([{"subject": "a", "dice": 1.0}], Path(name).name)


def _log(out: Path, name: str) -> None:
    with log_file(out / name):
        logging.getLogger("medvol").warning("a line for the log")


def _json(out: Path, name: str) -> None:
    write_json(out / name, {"a": 1}, out)


def _tensorboard(out: Path, name: str) -> None:
    logger = MedvolTensorBoardLogger(save_dir=str(out), name=name, version="")
    logger.log_hyperparams({"lr": 1.0})
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")


WRITERS = {"summary.json": _summary, "metrics table": _table, "log file": _log, "json record": _json,
           "tensorboard": _tensorboard}


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("name", ["file", "folder/inner", "folder"])
def test_each_writer_refuses_a_link_in_place_of_its_file_or_folder_in_one_line(tmp_path, writer, name):
    out, outside, files = linked_files(tmp_path)
    if writer == "tensorboard" and name == "file":
        pytest.skip("TensorBoard writes into a folder")
    if writer != "tensorboard" and name == "folder":
        pytest.skip("a file writer is given a file")
    if writer == "log file" and name == "folder/inner":
        pytest.skip("a log file's folder is the output folder itself (the user's choice)")
    with pytest.raises(MedvolError, match=r"symbolic link") as refused:
        WRITERS[writer](out, name)
    assert "\n" not in str(refused.value) and str(out / name.split("/")[0]) in str(refused.value)
    assert untouched(outside, files)


def test_the_safe_open_writes_inside_and_refuses_every_link_below_its_root(tmp_path):
    out, outside, files = linked_files(tmp_path)
    with open_in(out, out / "new" / "deeper" / "table.csv", "w") as handle:
        handle.write("a,b\n")
    assert (out / "new" / "deeper" / "table.csv").read_text() == "a,b\n"
    for name in ("file", "folder/inner", "folder/new"):
        for mode in ("w", "a", "wb"):
            with pytest.raises(MedvolError, match="symbolic link"):
                open_in(out, out / name, mode)
    with pytest.raises(MedvolError, match="outside"):
        open_in(out, out / ".." / "elsewhere", "w")
    assert untouched(outside, files)
    refuse_links(out / "new")
    with pytest.raises(MedvolError, match=r"holds a symbolic link, .*out/(file|folder) "):
        refuse_links(out)


# Routes 6 and 7: subject ids that are paths.

def nnunet_dataset(root: Path, ids: list[str]) -> Path:
    """An nnU-Net raw dataset whose dataset.json lists its cases under `ids` (its `dataset` entries)."""
    rng = np.random.default_rng(0)
    cases = {}
    for i in range(len(ids)):
        label = np.zeros((16, 14, 10), np.uint8)
        label[5:10, 4:9, 3:7] = 1
        cases[f"case_{i:02d}"] = ([rng.normal(100, 5, label.shape) + 50 * label], label, [1.0, 1.0, 2.0])
    write_raw(root, "Dataset059_Escape", ["T2"], {"background": 0, "lesion": 1}, cases)
    folder = root / "Dataset059_Escape"
    content = json.loads((folder / "dataset.json").read_text())
    content["dataset"] = {
        subject: {"images": [f"imagesTr/{case}_0000.nii.gz"], "label": f"labelsTr/{case}.nii.gz"}
        for subject, case in zip(ids, cases, strict=True)
    }
    (folder / "dataset.json").write_text(json.dumps(content))
    return folder


def listed_dataset(folder: Path, ids: list[str], suffix: str) -> Path:
    """A list file (JSON or CSV) of NIfTI subjects with labels, under `ids`."""
    folder.mkdir(parents=True)
    rows = []
    for i, subject in enumerate(ids):
        image = np.random.default_rng(i).normal(100, 5, (16, 14, 10)).astype(np.float32)
        label = np.zeros(image.shape, np.uint8)
        label[5:10, 4:9, 3:7] = 1
        affine = np.diag([1.0, 1.0, 2.0, 1.0])
        nib.save(nib.Nifti1Image(image + 50 * label, affine), str(folder / f"s{i}_image.nii.gz"))
        nib.save(nib.Nifti1Image(label, affine), str(folder / f"s{i}_label.nii.gz"))
        rows.append({"subject": subject, "image": f"s{i}_image.nii.gz", "label": f"s{i}_label.nii.gz"})
    path = folder / f"list{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("subject,image,label\n" + "".join(f"{r['subject']},{r['image']},{r['label']}\n" for r in rows))
    return path


ESCAPING_IDS = [f"{ESCAPING}{i}" for i in range(5)]


def test_an_nnunet_dataset_json_naming_a_subject_by_a_path_is_refused_where_it_is_read(tmp_path):
    root = nnunet_dataset(tmp_path / "raw", ["case_a", *ESCAPING_IDS[1:]])
    with pytest.raises(MedvolError) as refused:
        NnunetDataModule(root=str(root)).subjects()
    line = str(refused.value)
    assert "\n" not in line and str(root / "dataset.json") in line and repr(ESCAPING_IDS[1]) in line, line


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_a_list_file_naming_a_subject_by_a_path_is_refused_where_it_is_read(tmp_path, suffix):
    listing = listed_dataset(tmp_path / "data", ["s0", "s1", ESCAPING], suffix)
    datamodule = NiftiDataModule(root=None, list_file=str(listing), image_modalities=["image"])
    with pytest.raises(MedvolError) as refused:
        datamodule.subjects()
    line = str(refused.value)
    assert "\n" not in line and str(listing) in line and repr(ESCAPING) in line, line


@pytest.mark.slow
@pytest.mark.parametrize("source", ["nnunet", "list_file"])
def test_train_py_on_subjects_named_by_paths_ends_in_one_line_and_writes_nothing_outside(tmp_path, source):
    run_dir = tmp_path / "a" / "b" / "run"
    if source == "nnunet":
        root = nnunet_dataset(tmp_path / "a" / "raw", ESCAPING_IDS)
        named = root / "dataset.json"
        data = ["dataset=nnunet", f"dataset.root={root}"]
    else:
        named = listed_dataset(tmp_path / "a" / "data", ESCAPING_IDS, ".json")
        data = ["dataset=nifti", "dataset.root=null", f"dataset.list_file={named}", "dataset.image_modalities=[image]",
                "model.num_classes=2", "model.class_names=[lesion]"]
    before = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    done = train_py(
        "model=segmentation", *data, "dataset.val_fraction=0.4", "dataset.test_fraction=0", "dataset.num_workers=0",
        "model.plan.base_features=4", "model.plan.iterations_per_epoch=1", "hardware=cpu", "logger=none",
        "callbacks.progress_bar=null", "callbacks.model_summary=null", "trainer.max_epochs=1",
        "trainer.num_sanity_val_steps=0", f"hydra.run.dir={run_dir}", cwd=tmp_path,
    )
    assert not list(tmp_path.rglob("escaped*")), sorted(tmp_path.rglob("escaped*"))
    line = one_line(done)
    assert str(named) in line and "../../../escaped" in line, line
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == before


def test_a_subject_id_check_takes_names_and_refuses_paths(tmp_path):
    for good in ("BRATS_001", "sub-01.ses-2", "a..b", "la_003"):
        assert check_subject_id(good, "list.csv") == good
    for bad in ("../x", "a/b", "a\\b", ".", "..", "", "a b", "x\x00", "é", "a" * 201):
        with pytest.raises(MedvolError, match=r"^list\.csv: subject id .* expected letters, digits"):
            check_subject_id(bad, "list.csv")


def test_every_subject_becomes_a_file_name_inside_the_folder_and_two_ids_never_share_one(tmp_path):
    names = SubjectFiles()
    stems = [names.stem(s) for s in ("../../x", "a/b", "..", ".", "x\\y", "ok")]
    assert stems == [".._.._x", "a_b", "__", "_", "x_y", "ok"]
    with pytest.raises(MedvolError, match=r"subject ids 'a b' and 'a/b' both become the file name 'a_b'"):
        names.stem("a b")
    assert names.stem("a/b") == "a_b" and names.stem("ok") == "ok"
    maps = tmp_path / "run" / "validation" / "label_maps"
    assert label_map_file(maps, ESCAPING).parent == maps


def test_the_prediction_writer_keeps_every_subject_inside_its_output_folder(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    writer = PredictionWriter(out)
    batch = {"subject": [ESCAPING, "fine"], "affine": torch.eye(4)[None].repeat(2, 1, 1)}
    outputs = {"volumes": {"seg": torch.zeros(2, 1, 4, 4, 4, dtype=torch.int64)},
               "arrays": {"codes": torch.zeros(2, 3)}}
    written = writer.write(outputs, batch)
    assert len(written) == 4 and all(p.resolve().parent == out.resolve() for p in written), written
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted(p.name for p in written)
    with pytest.raises(MedvolError, match="both become the file name"):
        writer.write(outputs, {**batch, "subject": ["../../../escaped", ".._.._.._escaped"]})
