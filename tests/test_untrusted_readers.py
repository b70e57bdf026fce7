"""One reader for every structured file and one for every torch file (issue 59, routes 8, 11, 12, 13 and 16):
files built as an attacker would send them, each refused in one line, with the address space capped
(`tests/memory_limit.py`) so that a reader which still inflated what a file holds fails instead of refusing.

- a torch zip file whose tensor record is stored deflated (2 GiB in 9 MB), wherever a torch file is read;
- a 5000-digit integer (Python parses at most 4300), or one past 64 bits, in any JSON or YAML medvol reads;
- an nnU-Net dataset.json or a `dataset.list_file` nested 100,000 deep, holding such an integer or an interpolation;
- a postprocessing.json of 100,000 steps, or of names a megabyte long.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from datamodules.sources.nifti import NiftiDataModule
from datamodules.sources.nnunet_raw import NnunetDataModule
from lightning_modules.discriminative.backbone import build_backbone
from lightning_modules.ldm.first_stage import read_first_stage
from lightning_modules.segmentation.postprocessing import ALL_FOREGROUND, MAX_NAME, MAX_STEPS, Postprocessing
from lightning_modules.xray2ct.earlier_stages import read_stage
from medvol.core.checkpoint_read import checkpoints_trusted, load_checkpoint
from medvol.core.errors import MedvolError
from medvol.core.file_data import MAX_INTEGER, check_data, read_json, read_yaml
from medvol.run.fold_records import POSTPROCESSING_FILE, read_postprocessing, read_volume_range
from medvol.run.predicting import predict
from medvol.volumes.plan_record import read_plan_file
from medvol.volumes.volume_budget import BUDGET_ENV
from tests.conftest import ROOT, compose_cfg, subprocess_env
from tests.medvol.run.test_predict import predict_cfg, saved_run
from tests.memory_limit import at_most_more, limited
from tests.payloads import deflated_checkpoint, legacy_checkpoint, long_integer, nested_json
from tests.test_untrusted_sizes import copied_run, scan

BUDGET_GIB = "0.25"
HEADROOM_GIB = 1.0
INFLATED = 2 * 1024**3
# A number Python will not parse from text (its int-string limit is 4300 digits).
DIGITS = 5000


@pytest.fixture(autouse=True)
def small_budget(monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, BUDGET_GIB)


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    path = deflated_checkpoint(tmp_path_factory.mktemp("bomb") / "stage.ckpt", INFLATED)
    assert path.stat().st_size < 12 * 1024**2
    return path


@pytest.fixture(scope="module")
def phantom_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("phantoms") / "run"
    return saved_run(run_dir, compose_cfg(run_dir, ["logger=none", "callbacks.volume_slices=null"]))


def one_line_refusal(call, *args, **kwargs) -> str:
    """The refusal `call` raises with at most `HEADROOM_GIB` more memory mapped, as one line."""
    with pytest.raises(MedvolError) as refused, at_most_more(HEADROOM_GIB):
        call(*args, **kwargs)
    assert "\n" not in str(refused.value)
    return str(refused.value)


def with_integer(payload: dict, digits: int = DIGITS) -> str:
    """`payload` as JSON text with each string "@" replaced by an integer of `digits` digits (json.dumps will
    not write one past Python's limit either)."""
    return json.dumps(payload).replace('"@"', long_integer(digits))


def with_digits(record: Path) -> Path:
    """A run's record with its `n_codes` (32) replaced by an integer of `DIGITS` digits, whatever its layout."""
    text = record.read_text()
    assert '"n_codes": 32' in text
    record.write_text(text.replace('"n_codes": 32', f'"n_codes": {long_integer(DIGITS)}'))
    return record


# ---- route 8: torch files that inflate ---------------------------------------------------------------------------


@pytest.mark.parametrize("reader", ["ckpt_path", "first-stage", "earlier-stage", "backbone"])
def test_a_torch_file_deflated_1000x_is_refused_from_its_zip_directory_by_every_reader(bomb, reader):
    # 2 GiB of tensor in 9 MB: today's torch.load inflates it whole (2.7 GB resident) before any check.
    readers = {
        "ckpt_path": lambda: load_checkpoint(bomb, "ckpt_path", "a checkpoint"),
        "first-stage": lambda: read_first_stage(str(bomb)),
        "earlier-stage": lambda: read_stage(str(bomb)),
        "backbone": lambda: build_backbone("resnet10", 1, widen_factor=0.125, pretrained_path=str(bomb)),
    }
    line = one_line_refusal(readers[reader])
    assert str(bomb) in line and "stores `archive/data/0` deflated" in line, line
    assert "refused before inflating it" in line and len(line) < 600


def test_a_deflated_record_is_refused_even_where_the_file_is_trusted(bomb):
    with checkpoints_trusted(True):
        assert "deflated" in one_line_refusal(load_checkpoint, bomb, "ckpt_path", "a checkpoint")


def test_a_checkpoint_past_the_budget_is_refused_before_it_is_read_and_read_within_it(tmp_path, monkeypatch):
    # Stored as torch.save stores it (no compression: 8 MiB on disk, 8 MiB read), but past a budget of 1 MiB.
    path = tmp_path / "large.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2 * 1024**2)}, "loops": {}}, path)
    monkeypatch.setenv(BUDGET_ENV, str(1 / 1024))
    line = one_line_refusal(load_checkpoint, path, "ckpt_path", "a checkpoint")
    assert line.startswith(f"`ckpt_path`: {path} holds 8.39 MB of records") and "4 MiB" in line
    monkeypatch.setenv(BUDGET_ENV, str(4 / 1024))
    assert load_checkpoint(path, "ckpt_path", "a checkpoint")["state_dict"]["w"].shape == (2 * 1024**2,)


def test_a_legacy_torch_file_is_refused_as_data_and_read_when_trusted(tmp_path):
    path = legacy_checkpoint(tmp_path / "old.pth", {"state_dict": {"w": torch.ones(3)}})
    line = one_line_refusal(load_checkpoint, path, "model.pretrained_path", "a state dict")
    assert line.startswith(f"`model.pretrained_path`: {path} is in PyTorch's legacy format") and "trust_" in line
    with checkpoints_trusted(True):
        assert load_checkpoint(path, "model.pretrained_path", "a state dict")["state_dict"]["w"].sum() == 3


# ---- route 12: integers no real setting holds ------------------------------------------------------------------


@pytest.mark.parametrize("digits", [DIGITS, 30], ids=["past-the-parser", "past-64-bits"])
def test_an_integer_no_setting_holds_is_one_line_in_every_record_reader(tmp_path, digits):
    record = tmp_path / "record.json"
    record.write_text(with_integer({"config": {"model": {"n_codes": "@"}}}, digits))
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  n_codes: {long_integer(digits)}\n")
    for line in (one_line_refusal(read_json, record, "a run record (run.json)"),
                 one_line_refusal(read_yaml, config, "a run's config")):
        assert len(line) < 400 and ("digits" in line or "64 bits" in line), line
    assert one_line_refusal(read_json, record, "a run record").startswith(str(record))
    (tmp_path / "plan.json").write_text(with_integer({"spacing": ["@", 1, 1]}, digits))
    assert str(tmp_path / "plan.json") in one_line_refusal(read_plan_file, tmp_path / "plan.json")
    (tmp_path / "structure_volumes.json").write_text(with_integer({"lesion": {"min": 0, "max": "@"}}, digits))
    assert str(tmp_path / "structure_volumes.json") in one_line_refusal(read_volume_range, tmp_path)


def test_check_data_bounds_integers_to_64_bits_and_keeps_those_within():
    assert check_data({"seed": 2**64 - 1, "low": -(2**63)}, "x") == {"seed": 2**64 - 1, "low": -(2**63)}
    with pytest.raises(MedvolError, match=r"^x: `a\.b\[1\]` is an integer of 20 digits; .* 64 bits"):
        check_data({"a": {"b": [0, 10**19 * 2]}}, "x")
    assert MAX_INTEGER == 2**64


def test_a_run_record_or_an_old_config_holding_a_5000_digit_integer_is_one_line_through_predict(phantom_run, tmp_path):
    image = scan(tmp_path / "scans" / "head.nii.gz")
    run_dir = copied_run(phantom_run, tmp_path / "run")
    with_digits(run_dir / "run.json")
    line = one_line_refusal(predict, predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"input={image}",
                                                 f"output_dir={tmp_path / 'out'}"))
    assert line.startswith(f"{run_dir / 'run.json'}: is not a run record") and "4300 digits" in line
    (run_dir / "run.json").unlink()
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    config["model"]["n_codes"] = "@"
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config).replace("'@'", long_integer(DIGITS)))
    line = one_line_refusal(predict, predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"input={image}",
                                                 f"output_dir={tmp_path / 'out'}"))
    assert line.startswith(f"{run_dir / '.hydra' / 'config.yaml'}: is not a run's config") and "digits" in line
    assert not (tmp_path / "out").exists()


# ---- routes 13 and 16: a dataset's own files ----------------------------------------------------------------------


def nnunet_dataset(root: Path, labels_text: str = '{"background": 0, "lesion": 1}', extra: str = "") -> Path:
    """An nnU-Net raw dataset folder whose dataset.json is written as text (to hold what json.dumps would not)."""
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    (root / "dataset.json").write_text(
        f'{{"channel_names": {{"0": "T1"}}, "labels": {labels_text}, "file_ending": ".nii.gz"{extra}}}'
    )
    return root


@pytest.mark.parametrize("attack", ["nested", "digits", "interpolation"])
def test_an_nnunet_dataset_json_an_attacker_wrote_is_one_line(tmp_path, attack):
    root = tmp_path / "Dataset099_Attack"
    if attack == "nested":
        nnunet_dataset(root, extra=', "numTraining": ' + "[" * 100_000 + "1" + "]" * 100_000)
    elif attack == "digits":
        nnunet_dataset(root, extra=f', "numTraining": {long_integer(DIGITS)}')
    else:
        # Route 16: a label NAME that OmegaConf would resolve once it reached a config.
        nnunet_dataset(root, '{"background": 0, "${oc.create:{_target_:os.system,_args_:[touch x]}}": 1}')
    line = one_line_refusal(lambda: NnunetDataModule(root=str(root), split_file=str(tmp_path / "s.json")).subjects())
    assert line.startswith(f"{root / 'dataset.json'}: ") and len(line) < 400, line
    expected = {"nested": "nests", "digits": "4300 digits", "interpolation": "holds an interpolation"}[attack]
    assert expected in line


@pytest.mark.parametrize("attack", ["nested", "digits"])
def test_a_list_file_an_attacker_wrote_is_one_line(tmp_path, attack):
    path = tmp_path / "subjects.json"
    if attack == "nested":
        nested_json(path, 100_000)
    else:
        path.write_text(f'[{{"subject": "a", "image": "a.nii.gz", "age": {long_integer(DIGITS)}}}]')
    datamodule = NiftiDataModule(list_file=str(path), image_modalities=["image"], split_file=str(tmp_path / "s.json"))
    line = one_line_refusal(datamodule.subjects)
    assert line.startswith(f"{path}: ") and len(line) < 400, line
    assert ("nests" if attack == "nested" else "4300 digits") in line


# ---- route 11: a post-processing record --------------------------------------------------------------------------


def postprocessing_record(folder: Path, steps: list[dict], folds: int = 5) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / POSTPROCESSING_FILE).write_text(json.dumps({"steps": steps, "folds": folds}))
    return folder


def test_a_postprocessing_record_of_100000_steps_is_refused_in_one_short_line(tmp_path):
    # 3.5 MB: predict applied each step to every label map (over 5 minutes) and logged every name (800 KB).
    folder = postprocessing_record(tmp_path, [{"name": f"structure {i}", "values": [1]} for i in range(100_000)])
    line = one_line_refusal(read_postprocessing, folder)
    assert line.startswith(f"{folder / POSTPROCESSING_FILE}: ") and f"at most {MAX_STEPS}" in line
    assert len(line) < 400


@pytest.mark.parametrize(("steps", "refusal"), [
    ([{"name": "x" * 1_000_000, "values": [1]}], f"longer than {MAX_NAME} characters"),
    ([{"name": "a", "values": [1]}, {"name": "a", "values": [2]}], "named twice"),
    ([{"name": "a", "values": list(range(100_000))}], "label values"),
    ([{"name": "a", "values": [-1]}], "label values"),
    ([{"name": "a", "values": [2**40]}], "label values"),
])
def test_a_postprocessing_record_whose_steps_no_run_chose_is_refused_in_one_short_line(tmp_path, steps, refusal):
    line = one_line_refusal(read_postprocessing, postprocessing_record(tmp_path, steps))
    assert refusal in line and len(line) < 400, line


def test_a_genuine_postprocessing_record_reads_back(tmp_path):
    steps = [{"name": ALL_FOREGROUND, "values": [1, 2, 3]}, *({"name": f"c{i}", "values": [i]} for i in (1, 2, 3))]
    decision = read_postprocessing(postprocessing_record(tmp_path, steps, folds=5))
    assert decision.steps == ((ALL_FOREGROUND, (1, 2, 3)), ("c1", (1,)), ("c2", (2,)), ("c3", (3,)))
    assert Postprocessing.from_json(decision.to_json(), "p") == decision


# ---- through the entry points, as a user runs them -------------------------------------------------------------


@pytest.fixture(scope="module")
def segmentation_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("segmentation") / "run"
    return saved_run(run_dir, compose_cfg(run_dir, ["model=segmentation", "logger=none",
                                                    "callbacks.volume_slices=null"]))


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["deflated-first-stage", "run-json-digits", "dataset-json-nested",
                                    "list-file-digits", "postprocessing-steps"])
def test_each_reader_attack_ends_in_one_line_and_exit_2_through_its_entry_point(
    bomb, phantom_run, segmentation_run, tmp_path, attack
):
    out = tmp_path / "out"
    image = scan(tmp_path / "scans" / "head.nii.gz")
    if attack == "deflated-first-stage":
        named = bomb
        command = ["train.py", "model=ldm", f"model.first_stage_ckpt={named}", "hardware=cpu", "logger=none",
                   f"hydra.run.dir={out}"]
    elif attack == "run-json-digits":
        run_dir = copied_run(phantom_run, tmp_path / "run")
        named = run_dir / "run.json"
        with_digits(named)
        command = ["predict.py", f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"input={image}", f"output_dir={out}",
                   "device=cpu"]
    elif attack == "dataset-json-nested":
        root = nnunet_dataset(tmp_path / "Dataset099_Attack", extra=', "x": ' + "[" * 100_000 + "]" * 100_000)
        named = root / "dataset.json"
        command = ["check_data.py", "model=segmentation", "dataset=nnunet", f"dataset.root={root}"]
    elif attack == "list-file-digits":
        named = tmp_path / "subjects.json"
        named.write_text(f'[{{"subject": "a", "image": "{image}", "age": {long_integer(DIGITS)}}}]')
        command = ["train.py", "dataset=nifti", f"dataset.root={tmp_path}", f"dataset.list_file={named}",
                   "dataset.image_modalities=[image]",
                   "hardware=cpu", "logger=none", f"hydra.run.dir={out}"]
    else:
        run_dir = copied_run(segmentation_run, tmp_path / "run")
        postprocessing_record(run_dir, [{"name": f"s{i}", "values": [1]} for i in range(100_000)])
        named = run_dir / POSTPROCESSING_FILE
        command = ["predict.py", f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"input={image}", f"output_dir={out}",
                   "device=cpu"]
    done = subprocess.run(
        [sys.executable, str(ROOT / command[0]), *command[1:]], cwd=tmp_path, capture_output=True, text=True,
        env=subprocess_env(OMP_NUM_THREADS="1", **{BUDGET_ENV: BUDGET_GIB}), preexec_fn=limited(3.0), timeout=300,
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, lines[-20:]
    assert lines[0].startswith("medvol: error: ") and str(named) in lines[0] and len(lines[0]) < 600
    assert not out.exists()
