"""The preflight (medvol/run/preflight.py): a named card's prediction printed before any data is read, a step that
does not fit refused in one line naming changes that each fit, nothing at all on the CPU with no card named."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import medvol.run.resolvers  # noqa: F401 - resolvers the configs use
from medvol.core.errors import MedvolError
from medvol.run import preflight as preflight_module
from medvol.run import training

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
    assert preflight_module.preflight(cfg) is False


def test_a_named_card_prints_the_prediction_and_reads_no_data(tmp_path, monkeypatch, caplog):
    cfg = composed(tmp_path, [*SMALL_DDPM, "preflight=H100"])

    def no_data(*args, **kwargs):
        raise AssertionError("data was built after a named card's preflight")

    monkeypatch.setattr(training, "build", no_data)
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
