"""Every value a file gives is bounded where it is read (issue 59, routes 3, 9 and 10): an orientation that MONAI would
run as Python in an exported bundle, a window of 512^3 voxels and an overlap of 0.99 in a run record, each refused in
one line naming the file, the key, the value and the range; and every experiment preset within the bounds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigWorkflow
from omegaconf import OmegaConf

from medvol.core.errors import MedvolError
from medvol.run.bundle import BundleSteps, as_text
from medvol.run.exporting import export
from medvol.run.predicting import predict
from medvol.run.settings_bounds import MAX_OVERLAP, check_checkpoint_settings, check_run_settings
from tests.conftest import CONF_DIR, ROOT, TINY_MODEL, compose_cfg, subprocess_env
from tests.medvol.run.test_predict import predict_cfg, saved_run, trained_run  # noqa: F401 - a fixture
from tests.memory_limit import at_most_more
from tests.test_untrusted_run_folders import _record, _save_record, attack  # noqa: F401 - a fixture

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
FAMILIES = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


@pytest.fixture(scope="module")
def segmentation_run(tmp_path_factory) -> Path:
    """A tiny segmentation model trained on the synthetic phantoms: its record sets a window and an overlap."""
    run_dir = tmp_path_factory.mktemp("values") / "run"
    return saved_run(run_dir, compose_cfg(run_dir, ["model=segmentation", *TINY_MODEL["segmentation"], "logger=none",
                                                    "callbacks.volume_slices=null"]))


@pytest.fixture
def segmentation_attack(segmentation_run, attack) -> tuple[Path, Path]:  # noqa: F811
    """(a copy of the genuine segmentation run, one input scan)."""
    run_dir = attack[0].parent / "segmentation"
    shutil.copytree(segmentation_run, run_dir)
    return run_dir, attack[3]


def _expression(marker: Path) -> str:
    """MONAI bundle syntax for Python that creates `marker`."""
    return f"$open({str(marker)!r}, 'w').close() or 'RAS'"


def _exported_and_run(run_dir: Path, scan: Path) -> str | None:
    """export.py format=bundle on the run's checkpoint, and where it writes one, the bundle run by MONAI as `python
    -m monai.bundle run` runs it; the refusal's line, or None where there was none."""
    bundle = run_dir.parent / "bundle"
    cfg = OmegaConf.create({"ckpt_path": str(run_dir / "checkpoints" / "last.ckpt"), "format": "bundle",
                            "output_dir": str(bundle), "opset": 17, "tta": None})
    try:
        export(cfg)
    except MedvolError as err:
        assert not bundle.exists()
        return str(err)
    ConfigWorkflow(
        config_file=str(bundle / "configs" / "inference.json"), meta_file=str(bundle / "configs" / "metadata.json"),
        workflow_type="infer", bundle_root=str(bundle), dataset_dir=str(scan.parent), output_dir=str(bundle / "out"),
    ).run()
    return None


def _one_line(text: str | None) -> str:
    assert text is not None and "\n" not in text, text
    return text


# ---- route 3: an orientation MONAI would run -------------------------------------------------------------------


def test_a_run_records_orientation_that_is_a_monai_expression_is_refused_and_never_run(attack):  # noqa: F811
    run_dir, _, marker, scan = attack
    record = _record(run_dir)
    record["values"]["dataset"]["transforms"]["orientation"] = _expression(marker)
    _save_record(run_dir, record)
    line = _exported_and_run(run_dir, scan)
    assert not marker.exists()
    line = _one_line(line)
    assert line.startswith(f"{run_dir / 'run.json'}: `dataset.transforms.orientation` is \"$open(")
    assert line.endswith("expected null or one of the 48 axis codes (3 letters: one of L/R, one of A/P, one of S/I, "
                         "e.g. RAS)")


def test_a_checkpoints_training_orientation_that_is_a_monai_expression_is_refused_and_never_run(attack):  # noqa: F811
    run_dir, _, marker, scan = attack
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["medvol_data"]["orientation"] = _expression(marker)
    torch.save(checkpoint, ckpt)
    line = _exported_and_run(run_dir, scan)
    assert not marker.exists()
    line = _one_line(line)
    assert line.startswith(f"{ckpt}: `medvol_data.orientation` is \"$open(") and "48 axis codes" in line


@pytest.mark.parametrize("value", ["$print(1)", "@network", "%/etc/hosts"])
def test_the_bundle_writes_no_string_a_file_gave_that_monai_would_read_as_syntax(value):
    # The bundle's own end, whatever reached it: the orientation and every string of metadata.json.
    with pytest.raises(MedvolError, match="`dataset.transforms.orientation` is .* expected text that starts with"):
        BundleSteps().preprocessing({"orientation": value}, 1)
    with pytest.raises(MedvolError, match=r"`configs/metadata.json.medvol.labels\[1\]` is "):
        as_text({"medvol": {"labels": ["tumour", value]}}, "configs/metadata.json")
    with pytest.raises(MedvolError, match="`configs/metadata.json` is "):
        as_text({value: 1}, "configs/metadata.json")
    with pytest.raises(MedvolError, match="holds '@'"):
        BundleSteps().intensity({"intensity": "zscore", "normalization": [{"kind": "mr", "note": "x@network"}]}, 1)


def test_only_the_48_axis_codes_are_orientations():
    from datamodules.pipeline.transforms import AXIS_CODES, TransformSettings

    assert len(AXIS_CODES) == 48 and {"RAS", "LPS", "SAR", "IPL"} <= AXIS_CODES
    for bad in ("RAR", "ras", "RA", "RASL", "XYZ", "$RAS"):
        with pytest.raises(MedvolError, match="`dataset.transforms.orientation` is"):
            TransformSettings.from_config({"orientation": bad})


# ---- routes 9 and 10: a window and an overlap that take the machine ----------------------------------------------


@pytest.mark.parametrize(("key", "value", "accepted"), [
    ("patch_size", [512, 512, 512], "of at most 16,777,216 voxels in all (256^3)"),
    ("overlap", 0.99, f"a number in [0.0, {MAX_OVERLAP}]"),
])
def test_a_run_record_whose_window_or_overlap_would_take_the_machine_is_refused_by_predict(segmentation_attack, key,
                                                                                          value, accepted):
    run_dir, scan = segmentation_attack
    record = _record(run_dir)
    record["values"]["model"][key] = value
    _save_record(run_dir, record)
    out = run_dir.parent / "out"
    with pytest.raises(MedvolError) as refused, at_most_more(1.0):
        predict(predict_cfg(f"ckpt_path={run_dir}/checkpoints/last.ckpt", f"input={scan}", f"output_dir={out}"))
    line = _one_line(str(refused.value))
    assert line.startswith(f"{run_dir / 'run.json'}: `model.{key}` is {value}; expected ") and line.endswith(accepted)
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("route", ["orientation", "patch_size", "overlap"])
def test_each_value_attack_ends_in_one_line_and_exit_2_through_its_entry_point(attack, segmentation_attack,  # noqa: F811
                                                                               route):
    run_dir, _, marker, scan = attack
    if route != "orientation":
        run_dir = segmentation_attack[0]
    record = _record(run_dir)
    if route == "orientation":
        record["values"]["dataset"]["transforms"]["orientation"] = _expression(marker)
    else:
        record["values"]["model"][route] = [512, 512, 512] if route == "patch_size" else 0.99
    _save_record(run_dir, record)
    out = run_dir.parent / "out"
    ckpt = f"ckpt_path={run_dir}/checkpoints/last.ckpt"
    entry = ["export.py", ckpt, "format=bundle"] if route == "orientation" else \
        ["predict.py", ckpt, f"input={scan}", "device=cpu"]
    done = subprocess.run(
        [sys.executable, str(ROOT / entry[0]), *entry[1:], f"output_dir={out}"], cwd=run_dir.parent,
        env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, lines[-20:]
    assert lines[0].startswith(f"medvol: error: {run_dir / 'run.json'}: `") and route in lines[0]
    assert not marker.exists() and not out.exists()


# ---- what a checkpoint restores, each family's bounds, and the presets -------------------------------------------


def test_what_a_checkpoint_restores_is_bounded_by_its_family():
    segmentation = "lightning_modules.segmentation.segmentation.Segmenter"
    check_checkpoint_settings(segmentation, {"num_classes": 4, "class_names": ["a", "b", "c"]}, {}, "last.ckpt")
    with pytest.raises(MedvolError, match=r"^last.ckpt: `hyper_parameters.num_classes` is 100000000; expected null "
                                          r"or a whole number in \[2, 1024\]$"):
        check_checkpoint_settings(segmentation, {"num_classes": 10**8}, {}, "last.ckpt")
    with pytest.raises(MedvolError, match=r"`hyper_parameters.first_stage_settings.n_codes` is 268435456"):
        check_checkpoint_settings("lightning_modules.ldm.latent_diffusion.LatentDiffusion",
                                  {"first_stage_settings": {"n_codes": 2**28}}, {}, "last.ckpt")
    with pytest.raises(MedvolError, match=r"`hyper_parameters.previous_settings\[0\].crop_size` is \[512, 512, 512\]"):
        check_checkpoint_settings("lightning_modules.xray2ct.module.XrayToCT",
                                  {"previous_settings": [{"crop_size": [512, 512, 512]}]}, {}, "last.ckpt")
    with pytest.raises(MedvolError, match=r"`medvol_data.spacing` is \[1.0, inf, 1.0\]; expected null or three "
                                          "positive, finite"):
        check_checkpoint_settings(segmentation, {}, {"medvol_data": {"spacing": [1.0, float("inf"), 1.0]}}, "x")


def _resolved(cfg) -> dict:
    """A composed config's model, dataset and cascade, resolved as a run's record holds them."""
    return {key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("model", "dataset", "cascade")
            if key in cfg}


# One value per family beyond its bounds (a file's, as a crafted run.json would hold it).
BEYOND = {
    "classifier": ("num_classes", 10**6),
    "ddpm": ("sampling_timesteps", 10**6),
    "ldm": ("sampling_window_batch_size", 10**4),
    "segmentation": ("sw_batch_size", 10**4),
    "survival": ("widen_factor", 1e6),
    "vqgan": ("n_codes", 2**28),
    "xray2ct": ("crop_size", [1024, 1024, 1024]),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_defaults_pass_and_one_value_beyond_its_bounds_is_refused(tmp_path, family):
    overrides = [f"model={family}", "model.first_stage_ckpt=null"] if family == "ldm" else [f"model={family}"]
    if family == "xray2ct":
        overrides += ["dataset.image_modalities=[ct]", "dataset.views=[ap,lateral]"]
    config = _resolved(compose_cfg(tmp_path, overrides, tiny=False))
    check_run_settings(config, "run.json")
    key, value = BEYOND[family]
    config["model"][key] = value
    with pytest.raises(MedvolError, match=rf"^run.json: `model.{key}` is .*; expected "):
        check_run_settings(config, "run.json")


def _merged(base: dict, over: dict) -> dict:
    return {**base, **{k: _merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                       for k, v in over.items()}}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_preset_is_within_the_bounds(tmp_path, name):
    config = _resolved(compose_cfg(tmp_path, [f"experiment={name}"], tiny=False))
    check_run_settings(config, f"experiment={name}")
    # A cascade's stages each set their own values over the preset's.
    cascade = config.get("cascade") or {}
    stages = [stage for key, stage in cascade.items() if key.startswith("stage") and isinstance(stage, dict)]
    for stage in stages:
        check_run_settings(_merged(config, stage), f"experiment={name}")
    assert json.dumps(config)
