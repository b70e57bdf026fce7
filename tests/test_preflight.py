"""The preflight (medvol/run/preflight.py): a named card's prediction printed before any data is read, a step that
does not fit refused in one line naming changes that each fit, nothing at all on the CPU with no card named; a planned
segmentation run's own network (from its plan.json, a plan the config gives whole, or once planned from the data), a
segmenter whose classes come from the data, and `hardware.fit`'s largest batch, kept by a resume."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

import medvol.run.resolvers  # noqa: F401 - resolvers the configs use
from medvol.core.errors import MedvolError
from medvol.run import preflight as preflight_module
from medvol.run import run_data, training
from medvol.run.run_record import read_record
from medvol.volumes.network_topology import pool_and_conv_props
from medvol.volumes.plan import DataFingerprint, make_plan, write_plan
from tests.conftest import compose_cfg

ROOT = Path(__file__).resolve().parents[1]
# Fast-DDPM on 24^3 phantoms, batch 4, float32: about 158 MiB a step (48 MiB at batch 1).
SMALL_DDPM = ["model=ddpm", "dataset.size=24", "dataset.batch_size=4", "dataset.num_subjects=8", "hardware=cpu"]
SMALL_CARD = "preflight=0.1GiB"


def composed(tmp_path: Path, overrides: list[str]):
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose("train", overrides=[f"paths.output_dir={tmp_path}", *overrides])


def test_on_the_cpu_with_no_card_named_nothing_runs(tmp_path, monkeypatch):
    cfg = composed(tmp_path, SMALL_DDPM)

    def predicted(*args, **kwargs):
        raise AssertionError("the preflight predicted on a CPU run with no card named")

    monkeypatch.setattr(preflight_module, "predict", predicted)
    assert preflight_module.preflight(cfg) == preflight_module.Preflight()


def test_a_named_card_prints_the_prediction_and_reads_no_data(tmp_path, monkeypatch, caplog):
    cfg = composed(tmp_path, [*SMALL_DDPM, "preflight=H100"])

    def no_data(*args, **kwargs):
        raise AssertionError("data was built after a named card's preflight")

    monkeypatch.setattr(run_data, "build", no_data)
    with caplog.at_level("INFO", logger="medvol"):
        assert training.run(cfg) == {}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("preflight:")]
    assert len(lines) == 1, lines
    assert "H100 has 79.18 GiB" in lines[0] and "TFLOP a step" in lines[0] and "s at " in lines[0]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "split.json").exists()


def test_a_step_too_large_for_the_card_names_changes_that_each_fit(tmp_path):
    cfg = composed(tmp_path, [*SMALL_DDPM, SMALL_CARD])
    with pytest.raises(MedvolError) as refused:
        preflight_module.preflight(cfg)
    message = str(refused.value)
    assert "\n" not in message and "will not fit" in message
    fixes = re.findall(r"(\S+=\S+) \((\d+\.\d+) GiB\)", message.split("would fit:")[1])
    assert fixes and any(key.startswith("dataset.batch_size=") for key, _ in fixes)
    for _, gib in fixes:
        assert float(gib) * (1 + preflight_module.MARGIN) <= 0.1


@pytest.mark.slow
def test_train_py_refuses_in_one_line_with_exit_2_before_any_data(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *SMALL_DDPM, SMALL_CARD, f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("medvol: error:")]
    assert len(errors) == 1 and "would fit: dataset.batch_size=" in errors[0]
    assert not (tmp_path / "split.json").exists()


@pytest.mark.slow
def test_train_py_with_a_named_card_prints_the_line_and_leaves_no_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *SMALL_DDPM, "preflight=H100", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "preflight: " in line]
    assert len(lines) == 1 and "H100 has 79.18 GiB" in lines[0], done.stdout[-2000:]
    # Not even Hydra's own folder (.hydra/, train.log) is left: the question ran nothing.
    assert not run_dir.exists()


FAMILIES = {
    "vqgan": ["model=vqgan", "dataset.size=32", "dataset.batch_size=1"],
    "ddpm": SMALL_DDPM,
    # The classes come from the data at a run's start; the preflight reads none, so the test names them.
    "segmentation": ["model=segmentation", "dataset.size=16", "model.patch_size=[16,16,16]", "model.num_classes=3"],
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_is_predicted_for_a_named_card(tmp_path, family):
    cfg = composed(tmp_path, [*FAMILIES[family], "preflight=H200"])
    prediction = preflight_module.predict(cfg, "bf16-mixed")
    assert prediction is not None and 0 < prediction.peak < 2**30 and prediction.flops > 0


def predicted_configs(monkeypatch) -> list[tuple[DictConfig, preflight_module.Prediction]]:
    """Every config the preflight predicts a step of, with its prediction, in order (the prediction runs as it is)."""
    seen: list[tuple[DictConfig, preflight_module.Prediction]] = []
    original = preflight_module.predict

    def recording(cfg, precision):
        prediction = original(cfg, precision)
        seen.append((cfg, prediction))
        return prediction

    monkeypatch.setattr(preflight_module, "predict", recording)
    return seen


def preflight_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("preflight:")]


# A planned segmentation run on the phantoms whose config gives the whole plan the network follows from: the spacing
# (its ratios set the strides), the patch, the batch and the classes. 2 mm along the last axis: nnU-Net's rules pool
# that axis later, so the strides are not the unplanned network's.
GIVEN_PLAN = ["model=segmentation", "dataset.size=16", "model.num_classes=3", "model.plan.use=true",
              "model.plan.spacing=[1.0,1.0,2.0]", "model.plan.patch_size=[32,32,16]", "model.plan.batch_size=2",
              "model.plan.features=[4,8,16,32]"]


def by_hand(cfg: DictConfig, spacing: list[float], patch: list[int], features: list[int]) -> DictConfig:
    """`cfg` with the DynUNet nnU-Net's pooling rules give (`pool_and_conv_props`, in nnU-Net's reversed axes), set
    by hand as benchmarks/segmentation/segmentation.py builds its planned network."""
    found = pool_and_conv_props(spacing[::-1], patch[::-1])
    levels = len(features)
    changed = cfg.copy()
    with open_dict(changed):
        changed.model.update(net="dynunet", res_block=False, transposed_bias=True, features=features,
                             strides=[s[::-1] for s in found.strides][:levels],
                             kernels=[k[::-1] for k in found.kernels][:levels], patch_size=patch,
                             deep_supervision=levels >= 3)
    return changed


def test_a_plan_the_config_gives_whole_is_the_network_predicted_before_any_data(tmp_path, monkeypatch, caplog):
    cfg = composed(tmp_path, [*GIVEN_PLAN, "preflight=H200"])
    seen = predicted_configs(monkeypatch)
    with caplog.at_level("INFO", logger="medvol"):
        checked = preflight_module.preflight(cfg)
    assert checked.stop and len(seen) == 1
    model = seen[0][0].model
    assert model.net == "dynunet" and list(model.features) == [4, 8, 16, 32] and not model.res_block
    expected = by_hand(cfg, [1.0, 1.0, 2.0], [32, 32, 16], [4, 8, 16, 32])
    assert [list(s) for s in model.strides] == list(expected.model.strides)
    assert [list(s) for s in model.strides] != [[1, 1, 1], [2, 2, 2], [2, 2, 2], [2, 2, 2]]
    monkeypatch.undo()
    assert seen[0][1].peak == preflight_module.predict(expected, "bf16-mixed").peak
    assert seen[0][1].peak != preflight_module.predict(cfg, "bf16-mixed").peak


def box_cases(root: Path) -> list[str]:
    """A planned segmentation run on a small nnU-Net raw dataset of six boxes (2 mm slices) written under `root`."""
    from benchmarks.segmentation.nnunet_plans import write_raw

    rng = np.random.default_rng(0)
    cases = {}
    for i in range(6):
        label = np.zeros((24, 24, 12), np.uint8)
        label[6 + i % 3 : 16, 6:15, 3:8] = 1
        t2 = rng.normal(100, 5, label.shape).astype(np.float32) + 50 * label
        cases[f"case_{i:02d}"] = ([t2], label, [1.0, 1.0, 2.0])
    write_raw(root, "Dataset001_Box", ["T2"], {"background": 0, "box": 1}, cases)
    return ["model=segmentation", "dataset=nnunet", f"dataset.root={root / 'Dataset001_Box'}",
            "model.plan.memory_budget_mib=64", "hardware=cpu"]


def test_a_plan_from_the_data_is_predicted_once_planned_and_no_plan_is_written(tmp_path, monkeypatch, caplog):
    """model.num_classes is null: the classes come from the plan (dataset.json's box and background)."""
    run_dir = tmp_path / "run"
    cfg = compose_cfg(run_dir, [*box_cases(tmp_path / "raw"), "preflight=H200"], tiny=False)
    assert cfg.model.num_classes is None
    seen = predicted_configs(monkeypatch)
    with caplog.at_level("INFO", logger="medvol"):
        assert training.run(cfg) == {}
    lines = preflight_lines(caplog)
    assert len(lines) == 2 and "comes from the data (its plan)" in lines[0] and "predicted peak" in lines[1]
    assert len(seen) == 1 and seen[0][0].model.net == "dynunet" and seen[0][0].model.num_classes == 2
    assert not (run_dir / "plan.json").exists()
    # The network is the one the run plans on a GPU (nnU-Net's 32 base filters there, 16 on this CPU), as a run that
    # plans writes it.
    cfg = compose_cfg(run_dir, box_cases(tmp_path / "raw")[:-1], tiny=False)
    datamodule = run_data.build(cfg.dataset)
    on_the_cpu, _ = run_data.planned(cfg, datamodule, "cpu", write=False)
    planned, _ = run_data.planned(cfg, datamodule, "gpu")
    assert (run_dir / "plan.json").is_file()
    for key in ("features", "strides", "kernels", "patch_size", "num_classes"):
        assert seen[0][0].model[key] == planned.model[key], key
    assert seen[0][0].dataset.batch_size == planned.dataset.batch_size
    assert planned.model.features[0] == 32 and on_the_cpu.model.features[0] == 16


def test_a_run_folders_plan_json_is_the_network_predicted_before_any_data(tmp_path, monkeypatch):
    fingerprint = DataFingerprint(
        spacings=np.array([[1.0, 1.0, 2.0]] * 4), shapes=np.array([[40, 40, 20]] * 4), relative_sizes=np.ones(4),
        channels=[{"kind": "mr", "mean": 0.0, "std": 1.0, "low": -1.0, "high": 1.0}], labels={0: 900, 1: 100, 2: 10},
    )
    plan = make_plan(fingerprint, 64, 4)
    write_plan(plan, tmp_path / "plan.json")
    cfg = composed(tmp_path, ["model=segmentation", "dataset=nnunet", "dataset.root=/unused", "preflight=H200"])
    seen = predicted_configs(monkeypatch)

    def no_data(*args, **kwargs):
        raise AssertionError("data was built: the plan.json was known before the data")

    monkeypatch.setattr(run_data, "build", no_data)
    assert training.run(cfg) == {}
    assert [seen[0][0].model[k] for k in ("features", "strides", "patch_size", "num_classes")] == [
        plan["features"], plan["strides"], plan["patch_size"], 3]


def test_a_segmenter_whose_classes_come_from_the_data_is_predicted_with_them(tmp_path, monkeypatch, caplog):
    """The phantoms say their classes (background, core, oedema) once their datamodule is built."""
    cfg = composed(tmp_path, ["model=segmentation", "dataset.size=16", "model.patch_size=[16,16,16]",
                              "preflight=H200"])
    assert cfg.model.num_classes is None
    seen = predicted_configs(monkeypatch)
    with caplog.at_level("INFO", logger="medvol"):
        assert training.run(cfg) == {}
    lines = preflight_lines(caplog)
    assert len(lines) == 2 and "model.num_classes is null" in lines[0] and "predicted peak" in lines[1]
    assert len(seen) == 1 and seen[0][0].model.num_classes == 3


def brute_force_largest(cfg: DictConfig, available_gib: float, up_to: int) -> int:
    """The largest batch that fits, every batch from 1 predicted (what the search must agree with)."""
    largest = 0
    for batch in range(1, up_to + 1):
        changed = cfg.copy()
        changed.dataset.batch_size = batch
        peak = preflight_module.predict(changed, "32-true").peak / 2**30
        if peak * (1 + preflight_module.MARGIN) <= available_gib:
            largest = batch
    return largest


# The tiny Fast-DDPM of tests/conftest.py (16^3) takes about 5 MiB a sample: a 20 MiB card holds 3.
TINY_CARD = "preflight=0.02GiB"


@pytest.mark.parametrize("configured", [1, 8])
def test_fit_picks_the_largest_batch_that_fits_a_small_named_card_in_few_predictions(
        tmp_path, monkeypatch, caplog, configured):
    cfg = compose_cfg(tmp_path, ["model=ddpm", f"dataset.batch_size={configured}", "trainer.precision=32-true",
                                 TINY_CARD, "hardware.fit=true"])
    seen = predicted_configs(monkeypatch)
    with caplog.at_level("INFO", logger="medvol"):
        checked = preflight_module.preflight(cfg)
    monkeypatch.undo()
    expected = brute_force_largest(cfg, 0.02, 6)
    assert 1 < expected < 6 and checked.stop and checked.batch == expected
    assert len(seen) <= 5, [c.dataset.batch_size for c, _ in seen]
    assert any(f"hardware.fit: dataset.batch_size={expected}," in line for line in preflight_lines(caplog))


def test_fit_is_bounded_to_true_or_false(tmp_path):
    cfg = composed(tmp_path, [*SMALL_DDPM, SMALL_CARD])
    cfg.hardware.fit = "yes"
    with pytest.raises(MedvolError, match="hardware.fit"):
        preflight_module.preflight(cfg)


def on_a_gpu_of(monkeypatch, free_gib: float) -> None:
    """This CPU run's preflight as on a GPU with `free_gib` free (the run itself still trains on the CPU)."""
    monkeypatch.setattr(preflight_module, "_trains_on_a_gpu", lambda cfg: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(free_gib * 2**30), int(free_gib * 2**30)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Test GPU")


def test_fits_batch_is_recorded_in_the_run_and_a_resume_keeps_it(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    tiny = ["model=ddpm", "dataset.batch_size=1", "trainer.limit_train_batches=1", "trainer.limit_val_batches=1",
            "logger=csv", "callbacks.volume_slices=null"]
    cfg = compose_cfg(run_dir, [*tiny, "hardware.fit=true"])
    # A card with room for batch 3, not 4.
    peaks = []
    for batch in (3, 4):
        changed = cfg.copy()
        changed.dataset.batch_size = batch
        peaks.append(preflight_module.predict(changed, "32-true").peak / 2**30 * (1 + preflight_module.MARGIN))
    on_a_gpu_of(monkeypatch, sum(peaks) / 2)
    batches = []
    original = training.fit_run

    def recording(cfg, *args):
        batches.append(int(cfg.dataset.batch_size))
        return original(cfg, *args)

    monkeypatch.setattr(training, "fit_run", recording)
    training.run(cfg)
    record = read_record(run_dir)
    assert batches == [3] and record is not None and record.values["dataset"]["batch_size"] == 3
    # Resumed on a card with ten times the room: the run's batch, not a new fit.
    on_a_gpu_of(monkeypatch, 10 * sum(peaks) / 2)
    (run_dir / ".hydra").mkdir(exist_ok=True)
    training.run(compose_cfg(run_dir, [f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
                                       "trainer.max_epochs=2"], tiny=False))
    assert batches == [3, 3]


def test_a_latent_diffusion_step_is_predicted_before_its_scale_and_with_its_spacing(tmp_path):
    """The LDM's latent scale is computed from the data before its first step, and spacing conditioning reads each
    sample's affine: the preflight steps it before either exists (it raised on both)."""
    from tests.medvol.run.test_train import model_extra

    cfg = compose_cfg(tmp_path, ["model=ldm", *model_extra("ldm", tmp_path), "model.spacing_conditioning=true",
                                 "model.position_channels=true", "preflight=H200"])
    prediction = preflight_module.predict(cfg, "bf16-mixed")
    assert prediction is not None and 0 < prediction.peak < 2**30 and prediction.flops > 0


def test_a_named_cards_preflight_of_a_cascade_predicts_its_first_stage_and_writes_nothing(tmp_path, monkeypatch,
                                                                                         caplog):
    """Stage 2 is built from stage 1's best checkpoint: it is predicted when it starts, not here (the cascade went on
    to it and failed for stage 1's missing checkpoint)."""
    cfg = compose_cfg(tmp_path, ["model=xray2ct", "experiment=xray2ct_cascade", "preflight=H200"])
    seen = predicted_configs(monkeypatch)
    with caplog.at_level("INFO", logger="medvol"):
        assert training.run(cfg) == {}
    lines = preflight_lines(caplog)
    assert len(seen) == 1 and seen[0][0].model.stage == 1 and "predicted peak" in lines[0]
    assert "stages [2, 3] are predicted as each starts" in lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())
