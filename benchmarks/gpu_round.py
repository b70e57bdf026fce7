"""The GPU round: one command that proves every model family on one CUDA GPU and measures the rows of
docs/BENCHMARKS.md that no GPU has filled yet, within 9 minutes (docs/gpu_round.md).

    python3 benchmarks/gpu_round.py                        # on a machine with one CUDA GPU
    python3 benchmarks/gpu_round.py --dry-run --out DIR    # every step at toy size on the CPU (make test-slow)
    python3 benchmarks/gpu_round.py --only ldm-ctpa vqgan-b4    # some steps again (names: --list)

The steps run in this order, each in its own process(es) with its own time limit (at the limit its whole
process group is killed, so one hang costs that step alone), inside a budget for the whole round (`--budget`):

1. tests: `pytest -m gpu`;
2. families: each family's CPU-preset command (as its guide gives it) with `hardware=gpu
   trainer.precision=bf16-mixed test=true` for a few batches, then `predict.py` on the run's test subjects
   (the unconditional LDM: samples from noise); `--jobs` families at a time, each with its own limit;
3. benchmarks at the seed scale, a few steps each, one at a time, the issue's rows first: the CTPA LDM's training
   step at 64^3 and 128^3 latents, a whole 512x512x604 volume generated in 10 steps and decoded, a whole 256^3 CT
   through the three X-ray-to-CT stages, a planned BraTS segmentation step and nnU-Net's own step on the same card,
   the CTPA VQ-GAN's patches/s on 128^3 at batch 1 and 4, a Fast-DDPM step at 128^3 (memory, time), the VQ-GAN step's
   profile (its top kernels), and the X-ray-to-CT stages' training steps at the seed batches;
4. the fast tests of every family (tests/lightning_modules, tests/test_experiments.py) with the GPU visible, on
   pytest-xdist workers where it is installed;
5. environment: nvidia-smi, torch, CUDA and cuDNN, the packages' versions.

Each step leaves `<work>/steps/NN-name.log` (its output) and `NN-name.json` (its commands, exit codes, seconds,
limit, status and figures). After every step, `<out>/steps.tar.gz` holds all of them, `<out>/summary.json` every
step's record, and `<out>/summary.md` the figures against the targets of docs/BENCHMARKS.md, each memory figure
beside its CPU prediction (`benchmarks/gpu_rounds/predicted.json`, written before the round by
`benchmarks/gpu/gpu_estimates.py --json`) and each family's run beside its own preflight's line: a round stopped from
outside still leaves what it finished. `--out` is `$OUT` where that is set (the device machine's folder that comes
back, at most 8 files: hence one archive), else `outputs/gpu_round`.

`--dry-run` runs every step on the CPU at toy size (fp32 for bf16-mixed, `cpu` for `cuda`, tiny networks and
volumes, one step of each benchmark), so that the script cannot rot between GPU loans
(`tests/test_gpu_round.py`, slow).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
GB = 1e9 / 2**30  # one GB (10^9 bytes) in GiB: the targets are in GB, the scripts report GiB
# Seconds kept for the environment step at the end, and the least a step is started with.
ENVIRONMENT_LIMIT = 30.0
LEAST = 10.0
# The longest rerun budget printed: the device tool's 600 s a command, less the wheels' install and the start.
RERUN_BUDGET = 560.0
# A dry run's limit for every step: a hang's bound on a shared CPU, not a speed.
DRY_LIMIT = 600.0
# Each benchmark row's peak predicted on the CPU before the round (`benchmarks/gpu/gpu_estimates.py --json`, the
# preflight's emulation of the benchmark's own step), shown beside the measurement: no device time is spent on it.
PREDICTED = ROOT / "benchmarks" / "gpu_rounds" / "predicted.json"


@dataclass
class Step:
    """One step: commands run one after another in one log, under one time limit."""

    name: str
    phase: str
    commands: list[list[str]]
    limit: float
    figures: Callable[[Step], dict[str, Any]] = lambda step: {}
    # Benchmarks write their figures here (`--json`); families their run here.
    output: Path | None = None
    # Where the commands run (None: the round's work folder).
    cwd: Path | None = None
    record: dict[str, Any] = field(default_factory=dict)
    # The figures the step is held to, (name, target): shown as not met when the step gives none.
    targets: list[tuple[str, str]] = field(default_factory=list)


# ---- the steps ----------------------------------------------------------------------------------------------------

FAMILY_GPU = ["hardware=gpu", "trainer.precision=bf16-mixed", "test=true", "trainer.max_epochs=1",
              "trainer.limit_train_batches=3", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
              "callbacks.progress_bar=null"]
FAMILY_DRY = ["hardware=cpu", "trainer.precision=32-true", "test=true", "trainer.max_epochs=1",
              "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
              "callbacks.progress_bar=null"]
TOY_SYNTHETIC = ["dataset.num_subjects=8", "dataset.size=16"]
# Each family's CPU-preset command (its guide's), and in a dry run what makes it a toy.
FAMILIES: dict[str, dict[str, list[str]]] = {
    "vqgan": {
        "gpu": [],
        "dry": [*TOY_SYNTHETIC, "model.n_hiddens=8", "model.n_codes=32", "model.disc_channels=8", "model.disc_layers=2",
                "model.ssim_kernel_size=5"],
    },
    "ddpm": {
        "gpu": ["model=ddpm"],
        "dry": ["model=ddpm", *TOY_SYNTHETIC, "model.network.channels=[8,8]",
                "model.network.attention_levels=[false,true]", "model.network.norm_num_groups=4",
                "model.network.num_head_channels=4", "model.ssim_kernel_size=5"],
    },
    "xray2ct": {
        "gpu": ["experiment=xray2ct_cascade", *(f"cascade.stage{k}.trainer.max_epochs=1" for k in (1, 2, 3))],
        "dry": ["experiment=xray2ct_cascade", *(f"cascade.stage{k}.trainer.max_epochs=1" for k in (1, 2, 3)),
                "dataset.num_subjects=8", "model.timesteps=4"],
    },
    "ldm": {
        "gpu": ["experiment=ldm_cpu", *(f"cascade.stage{k}.trainer.max_epochs=1" for k in (1, 2))],
        "dry": ["experiment=ldm_cpu", *(f"cascade.stage{k}.trainer.max_epochs=1" for k in (1, 2)),
                "dataset.num_subjects=8", "model.n_hiddens=8", "model.n_codes=32"],
    },
    "segmentation": {
        "gpu": ["model=segmentation", "dataset=brats", "dataset.label_regions=[WT,TC,ET]"],
        "dry": ["model=segmentation", "dataset=brats", "dataset.label_regions=[WT,TC,ET]",
                "model.plan.base_features=4", "model.plan.memory_budget_mib=64"],
    },
    "survival": {
        "gpu": ["experiment=survival_synthetic"],
        "dry": ["experiment=survival_synthetic", "dataset.num_subjects=32", "dataset.size=16",
                "model.widen_factor=0.125"],
    },
    "classifier": {
        "gpu": ["model=classifier"],
        "dry": ["model=classifier", *TOY_SYNTHETIC, "model.backbone=resnet10", "model.widen_factor=0.125"],
    },
}
# The checkpoint predict.py reads, relative to the run, and what it predicts.
PREDICT = {
    "xray2ct": ("stage3/best.ckpt", ["split=test"]),
    "ldm": ("stage2/best.ckpt", ["num_samples=2"]),
}
# What a user gets from each family beside every run's test metrics (summary.json): files (patterns) the test epoch
# writes in the run's folder, then files predict.py writes in its output folder. A family step whose commands exit 0
# without them has failed (the 2026-11-27 survival run lost its test metrics and risk groups at the test epoch's end).
OUTPUTS: dict[str, tuple[list[str], list[str]]] = {
    "vqgan": (["predictions/*_reconstruction.nii.gz"], ["metrics.csv", "*_reconstruction.nii.gz"]),
    "ddpm": (["predictions/*_sample.nii.gz"], ["*_sample.nii.gz"]),
    "xray2ct": (["stage3/predictions/*_ct.nii.gz"], ["*_ct.nii.gz"]),
    "ldm": (["stage2/predictions/*_sample.nii.gz"], ["sample_0.nii.gz", "sample_1.nii.gz"]),
    "segmentation": (["predictions/metrics.csv", "predictions/*_seg.nii.gz"], ["metrics.csv", "*_seg.nii.gz"]),
    "survival": (["predictions/risks.csv", "predictions/km_risk_groups.png"], ["predictions.csv"]),
    "classifier": (["predictions/probabilities.csv"], ["predictions.csv"]),
}


# A family's limit on a GPU where 120 s is short: the cascade trains three stages, then predict.py samples all three
# (the 2026-11-28 round: 94 s of training beside the six other families, predict.py killed 26 s in).
FAMILY_LIMITS = {"xray2ct": 150.0}


def family_steps(dry: bool, work: Path) -> list[Step]:
    steps = []
    device = "cpu" if dry else "cuda"
    for family, presets in FAMILIES.items():
        run = work / "runs" / family
        overrides = [*(FAMILY_DRY if dry else FAMILY_GPU), *presets["dry" if dry else "gpu"], f"hydra.run.dir={run}"]
        commands = []
        if family == "segmentation":
            data = work / "data" / "brats"
            commands.append([PY, "-m", "datamodules.sources.example_data", "brats2021", str(data), "--subjects", "8",
                             "--size", "24" if dry else "32"])
            overrides.append(f"dataset.root={data}")
        commands.append([PY, str(ROOT / "train.py"), *overrides])
        checkpoint, inputs = PREDICT.get(family, ("checkpoints/last.ckpt", ["split=test"]))
        commands.append([PY, str(ROOT / "predict.py"), f"ckpt_path={run / checkpoint}", *inputs,
                         f"output_dir={run / 'predict'}", f"device={device}"])
        limit = DRY_LIMIT if dry else FAMILY_LIMITS.get(family, 120.0)
        steps.append(Step(f"family-{family}", "families", commands, limit, family_figures, run))
    return steps


# The dry run's toy networks: the CTPA VQ-GAN's and the X-ray-to-CT preset's, narrowed (Hydra overrides).
TOY_VQGAN = ["model.n_hiddens=8", "model.n_codes=64", "model.disc_channels=8"]
TOY_XRAY2CT = ["model.channels=[16,16,16,16]", "model.encoder_channels=[8,8,8,8,8]", "model.token_dim=16",
               "model.num_head_channels=8", "model.norm_num_groups=8", "model.num_res_blocks=1"]


def benchmark_steps(dry: bool, scratch: Path) -> list[Step]:
    """The benchmarks, the issue's rows first (a round cut short by its budget loses the last): (name, script and
    arguments on a GPU, the dry run's instead, limit on a GPU, figures, the targets it is held to)."""
    table: list[tuple[str, list[str], list[str], float, Callable[[Step], dict[str, Any]], list[tuple[str, str]]]] = [
        ("ldm-ctpa",
         ["generation/ldm.py", "--device", "cuda", "--preset", "ctpa", "--rows", "train", "--repeats", "2"],
         ["generation/ldm.py", "--device", "cpu", "--preset", "cpu", "--rows", "train", "--repeats", "1"], 90.0,
         ldm_figures,
         [("LDM training step at 128x128x128 latents (GiB)", f"<= 40 GB ({40 * GB:.1f} GiB)")]),
        ("ldm-generate", ["generation/ldm.py", "--device", "cuda", "--preset", "ctpa", "--rows", "generate",
                          "--samplers", "fast_ddpm_10", "--repeats", "1"],
         ["generation/ldm.py", "--device", "cpu", "--preset", "cpu", "--rows", "generate", "--samplers", "fast_ddpm_10",
          "--repeats", "1"], 100.0, ldm_figures,
         [("LDM volume generated (10 steps) and decoded, 128x128x152 latent (s)", "<= 8")]),
        ("xray2ct-whole-ct", ["generation/xray2ct_memory.py", "--device", "cuda", "--reduce", "1", "--parts", "whole",
                              "--steps", "10"],
         ["generation/xray2ct_memory.py", "--device", "cpu", "--reduce", "8", "--parts", "whole", "--steps", "1",
          "--overlap", "0", *TOY_XRAY2CT], 120.0, xray2ct_whole_figures,
         [("X-ray-to-CT whole 256^3 CT, 10 steps a stage (s)", "<= 120")]),
        ("segmentation-planned",
         ["segmentation/segmentation.py", "gpu", "--nets", "dynunet", "--steps", "5", "--batch", "2"],
         ["segmentation/segmentation.py", "gpu", "--nets", "dynunet", "--steps", "1", "--batch", "1", "--device", "cpu",
          "--size", "32"], 45.0, segmentation_figures, []),
        ("nnunet-step", ["segmentation/nnunet_plans.py", "gpu-step", "--size", "128", "--batch", "2", "--steps", "5"],
         ["segmentation/nnunet_plans.py", "gpu-step", "--size", "32", "--batch", "1", "--steps", "1", "--device",
          "cpu"], 45.0, nnunet_figures, [("planned segmentation step / nnU-Net's, batch 2, 128^3 (time)", "<= 1")]),
        ("vqgan-b1", ["gpu/gpu_vqgan.py", "--batch", "1", "--steps", "10", "--warmup", "3", "--channels-last"],
         ["gpu/gpu_vqgan.py", "--batch", "1", "--steps", "1", "--warmup", "1", "--channels-last", "--device", "cpu",
          "--size", "32", "--precision", "32-true", *TOY_VQGAN], 45.0, vqgan_figures(25.0),
         [("CTPA VQ-GAN patches/s, 128^3, batch 1", ">= 25")]),
        ("vqgan-b4", ["gpu/gpu_vqgan.py", "--batch", "4", "--steps", "10", "--warmup", "3", "--channels-last"],
         ["gpu/gpu_vqgan.py", "--batch", "4", "--steps", "1", "--warmup", "1", "--channels-last", "--device", "cpu",
          "--size", "32", "--precision", "32-true", *TOY_VQGAN], 60.0, vqgan_figures(40.0),
         [("CTPA VQ-GAN patches/s, 128^3, batch 4", ">= 40")]),
        # The same step without channels-last (hardware=gpu's default): GroupNorm, which runs on contiguous tensors,
        # was 28% of the step's kernel time on 2026-11-28 and `copy_` 13%; this row says whether the layout pays.
        ("vqgan-b1-ncdhw", ["gpu/gpu_vqgan.py", "--batch", "1", "--steps", "10", "--warmup", "3"],
         ["gpu/gpu_vqgan.py", "--batch", "1", "--steps", "1", "--warmup", "1", "--device", "cpu", "--size", "32",
          "--precision", "32-true", *TOY_VQGAN], 45.0, read_output, []),
        ("ddpm-seed", ["generation/ddpm.py", "memory", "--size", "128", "--device", "cuda", "--precision",
                       "bf16-mixed", "--checkpointing", "--low-precision-norm", "--channels", "32", "64", "128", "128",
                       "--groups", "32", "--head-channels", "32", "--repeats", "5"],
         ["generation/ddpm.py", "memory", "--size", "16", "--device", "cpu", "--precision", "32", "--checkpointing",
          "--low-precision-norm", "--channels", "8", "16", "16", "16", "--groups", "8", "--head-channels", "8",
          "--repeats", "1"],
         75.0, ddpm_figures,
         [("Fast-DDPM step memory, 128^3 (GiB)", f"<= 4 GB ({4 * GB:.2f} GiB)"),
          ("Fast-DDPM step time, 128^3 (ms)", "<= 120")]),
        ("profile-vqgan", ["gpu/profile_vqgan.py", "--batch", "1", "--steps", "3", "--warmup", "2",
                           "model.channels_last=true"],
         ["gpu/profile_vqgan.py", "--batch", "1", "--steps", "1", "--warmup", "1", "--device", "cpu", "--size", "32",
          "--precision", "32-true", *TOY_VQGAN], 45.0, profile_figures, []),
        ("xray2ct-stages", ["generation/xray2ct_memory.py", "--device", "cuda", "--reduce", "1", "--modes", "on",
                            "--repeats", "2", "--parts", "train"],
         ["generation/xray2ct_memory.py", "--device", "cpu", "--reduce", "8", "--batch-divisor", "16", "--modes", "on",
          "--repeats", "1", "--parts", "train", *TOY_XRAY2CT], 110.0, xray2ct_stage_figures,
         [(f"X-ray-to-CT stage {k} training step, batch {b} (GiB)", f"<= 40 GB ({40 * GB:.1f} GiB)")
          for k, b in ((1, 16), (2, 8), (3, 4))]),
    ]
    steps = []
    for name, gpu, toy, limit, figures, targets in table:
        if name == "nnunet-step" and dry and not Path(nnunet_python(dry)).is_file():
            # A machine without nnU-Net's venv (a fresh clone's CI) dry-runs every other step.
            continue
        output = scratch / f"{name}.json"
        arguments = toy if dry else gpu
        python = nnunet_python(dry) if name == "nnunet-step" else PY
        command = [python, str(ROOT / "benchmarks" / arguments[0]), *arguments[1:], "--json", str(output)]
        step = Step(name, "benchmarks", [command], DRY_LIMIT if dry else limit, figures, output)
        step.targets = targets
        steps.append(step)
    return steps


def nnunet_python(dry: bool) -> str:
    """The Python that runs nnU-Net's step: on the GPU this one (the round's wheels bring nnU-Net's packages); in a dry
    run nnU-Net's own venv (`NNUNET_PYTHON`, benchmarks/segmentation/nnunet_plans.py), whose torch never enters the
    project's."""
    return os.environ.get("NNUNET_PYTHON", "/work/nnunet-venv/bin/python") if dry else PY


def all_steps(dry: bool, work: Path) -> list[Step]:
    family_tests = ["tests/lightning_modules", "tests/test_experiments.py"]
    pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    workers = [] if dry or not installed("xdist") else ["-n", str(min(12, os.cpu_count() or 1))]
    steps = [
        Step("tests-gpu", "tests", [[*pytest, "-m", "gpu", "tests/test_gpu.py"]], DRY_LIMIT if dry else 60.0,
             pytest_figures, cwd=ROOT),
        *family_steps(dry, work),
        *benchmark_steps(dry, work / "scratch"),
        # After the figures (a round cut short by its budget loses the last step): the fast suite runs these on the
        # CPU anyway. The dry run collects them.
        Step("tests-families", "tests", [[*pytest, *workers, *(["--collect-only"] if dry else []), *family_tests]],
             DRY_LIMIT if dry else 120.0, pytest_figures, cwd=ROOT),
        Step("environment", "environment", [[PY, str(Path(__file__).resolve()), "--environment"]], ENVIRONMENT_LIMIT,
             environment_figures),
    ]
    return steps


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---- figures of each kind of step ---------------------------------------------------------------------------------


def read_output(step: Step) -> dict[str, Any]:
    if step.output is None or not step.output.is_file():
        return {}
    return json.loads(step.output.read_text())


def check(name: str, value: float | None, target: str, met: bool | None, device: str,
          predicted: str | None = None) -> dict[str, Any]:
    """One figure against its target (`met` None: a figure recorded without one) and, for a GPU's figure, the CPU's
    prediction of it (`predicted`: a row of `PREDICTED`); `met` is None where the figure is not a GPU's (a dry run's:
    the targets and the predictions are a GPU's)."""
    cpu = str(device).startswith("cpu")
    return {"figure": name, "value": value, "target": target, "met": None if cpu else met,
            "predicted": None if cpu or predicted is None else predicted_peak(predicted)}


def predicted_peak(row: str) -> float | None:
    """The peak (GiB) `PREDICTED` holds for a row of `benchmarks/gpu/gpu_estimates.py`; None where it holds none."""
    if not PREDICTED.is_file():
        return None
    found = (json.loads(PREDICTED.read_text()).get("rows") or {}).get(row) or {}
    return found.get("peak_gib")


def at_most(value: float | None, bound: float) -> bool:
    """Within `bound`; a figure that is missing (out of memory, a failed row) is not."""
    return value is not None and value <= bound


def pytest_figures(step: Step) -> dict[str, Any]:
    """The counts of pytest's closing line ("3 passed, 1 skipped in 4.20s")."""
    text = Path(step.record["log"]).read_text(errors="replace")
    found = re.findall(r"(\d+)(?:/\d+)? (passed|failed|skipped|errors?|deselected|xfailed|xpassed|tests? collected)",
                       text[-3000:])
    return {"counts": {("collected" if "collected" in word else word): int(n) for n, word in found}}


def family_figures(step: Step) -> dict[str, Any]:
    """Per run (a cascade: per stage) the test metrics file and its metrics, samples/s and peak GPU memory; the files
    predict.py wrote; what a user gets (`OUTPUTS`), each file found by its pattern, and `missing`: what is not there
    (a run without test metrics, a pattern without a file)."""
    run = step.output
    assert run is not None
    runs = {}
    for summary in sorted(run.glob("**/summary.json")):
        data = json.loads(summary.read_text())
        metrics = {k: v for k, v in (data.get("metrics") or {}).items() if k.startswith("test/")}
        runs[str(summary.parent.relative_to(run)) or "."] = {
            "test_metrics_file": str(summary.relative_to(run)), "test": metrics,
            "samples_per_second": data.get("samples_per_second"), "peak_gpu_memory_mb": data.get("peak_gpu_memory_mb"),
        }
    predicted = sorted(p.name for p in (run / "predict").glob("*")) if (run / "predict").is_dir() else []
    written, from_predict = OUTPUTS[step.name.removeprefix("family-")]
    # Patterns relative to the run: predict.py's output folder is its `predict/`.
    patterns = [*written, *(f"predict/{pattern}" for pattern in from_predict)]
    found = {pattern: sorted(str(p.relative_to(run)) for p in run.glob(pattern)) for pattern in patterns}
    missing = [f"test metrics in {r['test_metrics_file']}" for r in runs.values() if not r["test"]] if runs else [
        "test metrics (no summary.json)"]
    missing += [pattern for pattern, files in found.items() if not files]
    return {"runs": runs, "predicted_files": len(predicted), "predicted": predicted[:6],
            "outputs": {pattern: files[:3] for pattern, files in found.items()}, "missing": missing,
            "preflight": preflight_figures(Path(step.record["log"]).read_text(errors="replace"), runs)
            if step.record.get("log") else {}}


# What medvol predicted in a family's own commands (their logs) before they ran: the training preflight's line of each
# run (a cascade: of each stage, in order) and predict.py's inference preflight lines; and what predict.py measured.
TRAINING_PREDICTED = re.compile(r"\bpreflight: predicted peak ([\d.]+) GiB per rank")
INFERENCE_PREDICTED = re.compile(r"inference preflight: .*?: predicted peak ([\d.]+) (GiB|MiB) a call")
PREDICT_MEASURED = re.compile(r"peak GPU memory: ([\d.]+) GiB")


def preflight_figures(log: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Predicted beside measured for a family's commands (GiB): each run's training step (its run's peak, which also
    holds its validation and test) and predict.py's largest planned call (its whole prediction's peak)."""
    training = [float(v) for v in TRAINING_PREDICTED.findall(log)]
    pairs = []
    if len(training) == len(runs):
        for predicted, (name, run) in zip(training, runs.items(), strict=True):
            measured = run.get("peak_gpu_memory_mb")
            pairs.append({"run": name, "predicted_gib": predicted,
                          "measured_gib": None if measured is None else measured / 1024})
    calls = [float(v) / (1024 if unit == "MiB" else 1) for v, unit in INFERENCE_PREDICTED.findall(log)]
    measured = [float(v) for v in PREDICT_MEASURED.findall(log)]
    return {"training": pairs, "training_lines": len(training),
            "predict": {"predicted_gib": max(calls) if calls else None,
                        "measured_gib": measured[-1] if measured else None}}


def vqgan_figures(target: float) -> Callable[[Step], dict[str, Any]]:
    def figures(step: Step) -> dict[str, Any]:
        data = read_output(step)
        if not data:
            return {}
        rate = data["patches_per_second"]
        data["checks"] = [check(f"CTPA VQ-GAN patches/s, {data['size']}^3, batch {data['batch']}", rate,
                                f">= {target:g}", rate >= target, data["device"])]
        if isinstance(data.get("peak_memory_gib"), float) and math.isfinite(data["peak_memory_gib"]):
            data["checks"].append(check(f"CTPA VQ-GAN step memory, {data['size']}^3, batch {data['batch']} (GiB)",
                                        data["peak_memory_gib"], "-", None, data["device"], f"vqgan-b{data['batch']}"))
        return data

    return figures


def ddpm_figures(step: Step) -> dict[str, Any]:
    data = read_output(step)
    if not data:
        return {}
    data["checks"] = [
        check(f"Fast-DDPM step memory, {data['size']}^3 (GiB)", data.get("peak_gib"), f"<= 4 GB ({4 * GB:.2f} GiB)",
              at_most(data.get("peak_gib"), 4 * GB), data["device"], "ddpm-seed-now"),
        check(f"Fast-DDPM step time, {data['size']}^3 (ms)", data["step_ms"], "<= 120", at_most(data["step_ms"], 120),
              data["device"]),
    ]
    return data


def xray2ct_stage_figures(step: Step) -> dict[str, Any]:
    data = read_output(step)
    if not data:
        return {}
    checks = []
    for row in data["stages"]:
        # On the CPU the row holds the host's resident set, no GPU figure.
        peak = row["peak_mib"] / 1024 if "peak_mib" in row and data["device"] == "cuda" else None
        checks.append(check(f"X-ray-to-CT stage {row['stage']} training step, batch {row['batch']} (GiB)", peak,
                            f"<= 40 GB ({40 * GB:.1f} GiB)", at_most(peak, 40 * GB), data["device"],
                            f"xray2ct-stage{row['stage']}"))
    data["checks"] = checks
    return data


def xray2ct_whole_figures(step: Step) -> dict[str, Any]:
    data = read_output(step)
    whole = data.get("whole") if data else None
    if not whole:
        return data
    size = whole.get("size", ["?"])[0] if "size" in whole else "?"
    name = f"X-ray-to-CT whole {size}^3 CT, {data['sampling_steps']} steps a stage (s)"
    data["checks"] = [check(name, whole.get("seconds"), "<= 120", at_most(whole.get("seconds"), 120), data["device"])]
    return data


def ldm_figures(step: Step) -> dict[str, Any]:
    data = read_output(step)
    if not data:
        return {}
    rows, checks, device = data["rows"], [], data["device"]
    train = [name for name in rows if name.startswith("train:")]
    if train:
        # On the CPU the row holds the host's resident set, no GPU figure.
        peak = rows[train[-1]].get("peak_gib") if device == "cuda" else None
        edge = train[-1][6:].split("x")[0]
        checks.append(check(f"LDM training step at {train[-1][6:]} latents (GiB)", peak,
                            f"<= 40 GB ({40 * GB:.1f} GiB)", at_most(peak, 40 * GB), device, f"ldm-{edge}-fused"))
    if "generate:fast_ddpm_10" in rows:
        latent = "x".join(map(str, data["generate_latent"]))
        seconds = rows["generate:fast_ddpm_10"].get("total_s")
        # Issue 61: 8 s (the 60 s of issue 48 was met at 16.2 s on 2026-11-28; 2,703 TFLOP is ~2.7 s at bf16 peak).
        checks.append(check(f"LDM volume generated (10 steps) and decoded, {latent} latent (s)", seconds, "<= 8",
                            at_most(seconds, 8), device))
    data["checks"] = checks
    return data


def segmentation_figures(step: Step) -> dict[str, Any]:
    return read_output(step)


def nnunet_figures(step: Step) -> dict[str, Any]:
    """nnU-Net's step, and medvol's planned step (the `segmentation-planned` step's figures, on the same card) against
    it: "no slower than nnU-Net per step"."""
    data = read_output(step)
    assert step.output is not None
    medvol = step.output.with_name("segmentation-planned.json")
    if not data or not medvol.is_file():
        return data
    ours = json.loads(medvol.read_text())["rows"][0]["step_ms"]
    ratio = ours / data["step_ms"]
    data["checks"] = [check(f"planned segmentation step / nnU-Net's, batch {data['batch']}, {data['size']}^3 (time)",
                            ratio, "<= 1", ratio <= 1.0, data["device"])]
    return data


def profile_figures(step: Step) -> dict[str, Any]:
    return read_output(step)


def environment_figures(step: Step) -> dict[str, Any]:
    text = Path(step.record["log"]).read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def environment() -> None:
    """Print the machine: nvidia-smi, then one JSON line of versions and the device."""
    import importlib.metadata
    import platform

    import torch

    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi"], check=False)
    else:
        print("nvidia-smi: not found")
    cuda = torch.cuda.is_available()
    versions = {}
    # scipy, scikit-learn, pandas, lifelines: the image's own or the carried wheels' (FID and the survival tests
    # depend on them; the 2026-11-27 round recorded neither, and its SciPy refused MONAI's sqrtm call).
    for name in ("torch", "pytorch-lightning", "torchmetrics", "monai", "hydra-core", "omegaconf", "nibabel",
                 "numpy", "scipy", "scikit-learn", "scikit-image", "pandas", "lifelines", "scikit-survival", "pillow",
                 "torchsurv", "pydicom", "highdicom", "triton"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    info = {
        "python": platform.python_version(), "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None, "cuda_available": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
        "cpus": os.cpu_count(), "versions": versions,
    }
    print(json.dumps(info))


# ---- running ------------------------------------------------------------------------------------------------------


class Round:
    """The steps, the budget, and the files each step leaves."""

    def __init__(self, args: argparse.Namespace, steps: list[Step]) -> None:
        self.args = args
        self.steps = steps
        self.start = time.monotonic()
        self.deadline = self.start + args.budget
        self.lock = threading.Lock()
        self.out: Path = args.out
        self.folder: Path = args.work / "steps"
        self.folder.mkdir(parents=True, exist_ok=True)
        (args.work / "scratch").mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    def left(self, step: Step) -> float:
        """Seconds this step may take: its limit, within the budget less the environment step's share (where the
        round has that step)."""
        last = any(s.phase == "environment" for s in self.steps)
        reserve = ENVIRONMENT_LIMIT if last and step.phase != "environment" else 0.0
        return min(step.limit, self.deadline - time.monotonic() - reserve)

    def run(self, index: int, step: Step) -> None:
        stem = f"{index:02d}-{step.name}"
        log = self.folder / f"{stem}.log"
        step.record = {"step": step.name, "phase": step.phase, "limit_s": step.limit, "log": str(log),
                       "commands": [subprocess.list2cmdline(c) for c in step.commands], "exit_codes": [],
                       "targets": step.targets}
        began = time.monotonic()
        with log.open("w") as handle:
            for command in step.commands:
                limit = self.left(step) - (time.monotonic() - began)
                if limit < LEAST:
                    step.record["status"] = f"{'stopped' if step.record['exit_codes'] else 'skipped'}: budget spent"
                    break
                handle.write(f"$ {subprocess.list2cmdline(command)}\n")
                handle.flush()
                code = run_command(command, handle, limit, step.cwd or self.args.work, self.env(step))
                step.record["exit_codes"].append(code)
                if code != 0:
                    step.record["status"] = "timed out" if code is None else "failed"
                    break
            else:
                step.record["status"] = "passed"
        seconds = round(time.monotonic() - began, 1)
        try:
            figures = step.figures(step)
        except (OSError, ValueError, KeyError, TypeError) as error:
            figures = {"error": f"{type(error).__name__}: {error}"}
        if step.record["status"] == "passed" and figures.get("missing"):
            # Every command exited 0, but the user would not have what the step checks for.
            step.record["status"] = "failed"
        unmeasured = [] if self.args.dry_run else without_figure(step, figures)
        if step.record["status"] == "passed" and unmeasured:
            # Every command exited 0, but a target got no figure (the 2026-11-28 whole CT: out of memory, caught and
            # printed, exit 0).
            figures["no_figure"] = unmeasured
            step.record["status"] = "failed"
        with self.lock:
            # Finished: the summary takes the steps whose record has its seconds.
            step.record.update(seconds=seconds, figures=figures)
            (self.folder / f"{stem}.json").write_text(json.dumps(step.record, indent=1))
            print(f"[{time.monotonic() - self.start:5.0f} s] {step.name}: {step.record['status']} in "
                  f"{step.record['seconds']:.0f} s (limit {step.limit:.0f} s) {brief(step)}", flush=True)
            self.save()

    def env(self, step: Step) -> dict[str, str]:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        variables = {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
        if step.phase == "families":
            # Several runs share the machine's cores.
            variables["OMP_NUM_THREADS"] = "1" if self.args.dry_run else "2"
        return {**os.environ, **variables}

    def save(self) -> None:
        """summary.json, summary.md and steps.tar.gz in `out`, as far as the round has come."""
        records = [step.record for step in self.steps if "seconds" in step.record]
        summary = {"started": self.started, "dry_run": self.args.dry_run, "budget_s": self.args.budget,
                   "seconds": round(time.monotonic() - self.start, 1), "commit": commit(), "steps": records}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        (self.out / "summary.md").write_text(markdown(summary))
        archive = self.out / "steps.tar.gz"
        partial = archive.with_suffix(".partial")
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(self.folder, arcname="steps")
        partial.replace(archive)

    def go(self) -> None:
        numbered = list(enumerate(self.steps, start=1))
        families = [(i, s) for i, s in numbered if s.phase == "families"]
        for index, step in numbered:
            if step.phase == "families":
                if families:
                    with ThreadPoolExecutor(max_workers=self.args.jobs) as pool:
                        running = [pool.submit(self.run, *pair) for pair in families]
                    # Every family has run; an error of the round's own code is raised now.
                    for future in running:
                        future.result()
                    families = []
                continue
            self.run(index, step)
        print(f"\nround done in {time.monotonic() - self.start:.0f} s; {self.out / 'summary.md'}:\n")
        print((self.out / "summary.md").read_text())


def run_command(command: list[str], handle: Any, limit: float, cwd: Path, env: dict[str, str]) -> int | None:
    """The command's exit code, or None when it ran past `limit` seconds (its process group is killed)."""
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                               start_new_session=True)
    try:
        return process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        handle.write(f"\n[gpu_round] killed after {limit:.0f} s\n")
        return None
    finally:
        # Whatever the command left running in its group (loader workers, xdist workers, a hung child) goes too.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()


def commit() -> str:
    """The checkout's commit (`git rev-parse HEAD` in ROOT), or "unknown" where ROOT has no `.git` of its own. A copy
    of the working tree (the device tool sends one without `.git`) is inside no repository of the project, and git
    asked there walks up to whatever repository holds the copy's folder: the 2026-11-27 round recorded that one's."""
    if not (ROOT / ".git").exists():
        return "unknown"
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def without_figure(step: Step, figures: dict[str, Any]) -> list[str]:
    """The targets of a GPU step that got no figure: its checks without a value (or every target where it gave no
    checks), each with the reason its output recorded (`out_of_memory`, `error`) where it did."""
    checks = figures.get("checks")
    names = [c["figure"] for c in checks if c["value"] is None] if checks else [n for n, _ in step.targets]
    reasons = [str(v) for k, v in flat(figures) if k in ("out_of_memory", "error")]
    return [f"{name} ({reasons[0][:160]})" if reasons else name for name in names]


def flat(data: Any) -> list[tuple[str, Any]]:
    """Every (key, value) pair of nested dicts and lists."""
    if isinstance(data, dict):
        return [pair for key, item in data.items() for pair in [(key, item), *flat(item)]]
    if isinstance(data, list):
        return [pair for item in data for pair in flat(item)]
    return []


def brief(step: Step) -> str:
    """The step's figures in a few words."""
    figures = step.record.get("figures") or {}
    if "counts" in figures:
        return ", ".join(f"{n} {w}" for w, n in figures["counts"].items())
    if "runs" in figures:
        tested = [f"{r['test_metrics_file']} ({len(r['test'])})" for r in figures["runs"].values()]
        outputs = [f"{pattern} ({len(files)}{'+' if len(files) == 3 else ''})"
                   for pattern, files in figures.get("outputs", {}).items()]
        missing = f"; missing: {', '.join(figures['missing'])}" if figures.get("missing") else ""
        return f"test metrics: {', '.join(tested) or 'none'}; files: {', '.join(outputs)}{missing}"
    if figures.get("no_figure"):
        return f"no figure: {'; '.join(figures['no_figure'])}"
    if "checks" in figures:
        return "; ".join(f"{c['figure']}: {value(c['value'])}" for c in figures["checks"])
    if "device" in figures and "versions" in figures:
        return f"{figures['device']}, torch {figures['versions'].get('torch')}, CUDA {figures.get('torch_cuda')}"
    if "rows" in figures:
        return "; ".join(f"{r.get('net')}: {r.get('step_ms', 0):.0f} ms a step" for r in figures["rows"])
    if "patches_per_second" in figures:
        rate, step_ms = figures["patches_per_second"], figures["step_ms"]
        return f"{figures['options']}: {rate:.3g} patches/s, {step_ms:.0f} ms a step"
    if "top" in figures:
        return "; ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in figures["top"][:3])
    return figures.get("error", "")


def value(number: float | None) -> str:
    return "-" if number is None else f"{number:.3g}" if abs(number) < 100 else f"{number:.0f}"


def markdown(summary: dict[str, Any]) -> str:
    """The round as tables: the figures against their targets, then every step."""
    device = next((s["figures"].get("device") for s in summary["steps"] if s["phase"] == "environment"
                   and s.get("figures")), None)
    lines = [f"GPU round{' (dry run, CPU)' if summary['dry_run'] else ''}: started {summary['started']}, "
             f"{summary['seconds']:.0f} s of the {summary['budget_s']:.0f} s budget, "
             f"device {device or 'not read yet'}, "
             f"commit {summary['commit']}", "",
             *predictions_made(summary["dry_run"]),
             "| figure | target | predicted on the CPU | value | met |", "|---|---|---|---|---|"]
    for record in summary["steps"]:
        # A step that gave no figures (timed out, failed, skipped) misses its targets: listed, not met.
        missing = [{"figure": name, "target": target, "value": None, "met": None if summary["dry_run"] else False}
                   for name, target in record.get("targets", [])]
        for c in (record.get("figures") or {}).get("checks") or missing:
            met = "-" if c["met"] is None else "yes" if c["met"] else "**no**"
            lines.append(f"| {c['figure']} | {c['target']} | {value(c.get('predicted'))} | {value(c['value'])} | "
                         f"{met} |")
    lines += preflight_table(summary["steps"])
    lines += ["", "| step | status | seconds | limit | figures |", "|---|---|---|---|---|"]
    for record in summary["steps"]:
        step = Step(record["step"], record["phase"], [], record["limit_s"], record=record)
        lines.append(f"| {record['step']} | {record['status']} | {record['seconds']:.0f} | {record['limit_s']:.0f} | "
                     f"{brief(step)} |")
    again = [record for record in summary["steps"] if record["status"] != "passed"]
    if again and not summary["dry_run"]:
        lines += ["", "Not passed; again, on the same machine while it is warm:", "",
                  f"    python3 benchmarks/gpu_round.py {rerun(again)}"]
    return "\n".join(lines) + "\n"


def predictions_made(dry: bool) -> list[str]:
    """Where the predicted column comes from: the commit, day and command of `PREDICTED`."""
    if dry or not PREDICTED.is_file():
        return []
    made = json.loads(PREDICTED.read_text())
    return [f"Predicted on the CPU at commit {str(made.get('commit'))[:10]} on {made.get('date')}: "
            f"`{made.get('command')}`.", ""]


def preflight_table(records: list[dict[str, Any]]) -> list[str]:
    """The families' own predictions beside their measurements (GiB): the training preflight of each run against the
    run's peak (training, validation and test), predict.py's largest planned call against its whole prediction's
    peak; empty where no family ran on a GPU."""
    rows = []
    for record in records:
        found = (record.get("figures") or {}).get("preflight") or {}
        family = record["step"].removeprefix("family-")
        for pair in found.get("training") or []:
            rows.append(f"| {family} {pair['run']} | train.py's step | {value(pair['predicted_gib'])} | "
                        f"{value(pair['measured_gib'])} |")
        predict = found.get("predict") or {}
        if predict.get("predicted_gib") is not None:
            rows.append(f"| {family} | predict.py's largest call | {value(predict['predicted_gib'])} | "
                        f"{value(predict.get('measured_gib'))} |")
    if not rows:
        return []
    return ["", "The families' preflights, predicted before each command ran, beside its measured peak (GiB; a run's "
                "peak also holds its validation and test, predict.py's the whole prediction):", "",
            "| run | what | predicted | measured |", "|---|---|---|---|", *rows]


def rerun(records: list[dict[str, Any]]) -> str:
    """The arguments that run these steps again: `--only` them, within a budget of their limits (the families'
    longest, as they run together), at most what one device command may take less the wheels' install."""
    families = [r["limit_s"] for r in records if r["phase"] == "families"]
    budget = max(families, default=0.0) + sum(r["limit_s"] for r in records if r["phase"] != "families")
    return f"--only {' '.join(r['step'] for r in records)} --budget {min(budget, RERUN_BUDGET):.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="every step at toy size on the CPU")
    parser.add_argument("--out", type=Path, default=None, help="summary and archive ($OUT, else outputs/gpu_round)")
    parser.add_argument("--work", type=Path, default=None, help="runs, step logs and figures (a new temporary folder)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole round (530; dry run 3600)")
    parser.add_argument("--jobs", type=int, default=None, help="families at a time (GPU 7, dry run 2)")
    parser.add_argument("--only", nargs="+", metavar="STEP", help="these steps alone, in the round's order")
    parser.add_argument("--list", action="store_true", help="print the steps and their commands")
    parser.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.environment:
        environment()
        return
    args.out = args.out or Path(os.environ.get("OUT") or ROOT / "outputs" / "gpu_round")
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="medvol-gpu-round-"))).resolve()
    args.jobs = args.jobs or (2 if args.dry_run else len(FAMILIES))
    args.budget = args.budget or (3600.0 if args.dry_run else 530.0)
    steps = all_steps(args.dry_run, args.work)
    if args.only:
        unknown = set(args.only) - {s.name for s in steps}
        if unknown:
            parser.error(f"--only names no step {sorted(unknown)}; the steps: {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in args.only]
    if args.list:
        for step in steps:
            print(f"{step.name} ({step.phase}, limit {step.limit:.0f} s)")
            for command in step.commands:
                print(f"    {subprocess.list2cmdline(command)}")
        return
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            sys.exit("benchmarks/gpu_round.py needs a CUDA GPU (or --dry-run for the CPU)")
    print(f"GPU round{' (dry run)' if args.dry_run else ''}: {len(steps)} steps, budget {args.budget:.0f} s; "
          f"work {args.work}, out {args.out}", flush=True)
    Round(args, steps).go()


if __name__ == "__main__":
    main()
