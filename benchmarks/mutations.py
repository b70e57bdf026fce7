"""Mutation check: break the code on purpose, one named mutation at a time, and see which tests notice.

    .venv/bin/python benchmarks/mutations.py                 # every mutation, then the table
    .venv/bin/python benchmarks/mutations.py --only straight-through doctor-inf
    .venv/bin/python benchmarks/mutations.py --list

Each mutation replaces one exact piece of source text in a temporary copy of the repository
(the working tree is never touched) and runs only the tests that should catch it, slow ones
included. A mutation is caught when those tests fail. First the same tests run on the
unmutated copy: a test that already fails there proves nothing, and the script stops.
Minutes, not seconds: run it before a release, not in CI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A mutation that makes a DDP test hang is caught by the test's own timeouts long before this.
RUN_TIMEOUT = 900


@dataclass(frozen=True)
class Mutation:
    """Replace `original` (must occur exactly once in `file`) by `replacement`; `tests` should then fail."""

    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    what: str


MUTATIONS = [
    Mutation(
        "codebook-broadcast", "lightning_modules/vqgan/codebook.py",
        "            dist.broadcast(picked, src=0)\n", "            pass\n",
        ("tests/test_ddp_codebook.py",),
        "no rank-0 broadcast of codebook initialisation and restarts",
    ),
    Mutation(
        "restart-broadcast", "lightning_modules/vqgan/codebook.py",
        "        if _distributed():\n            dist.broadcast(picked, src=0)",
        "        if _distributed() and not bool(self.initialized):\n            dist.broadcast(picked, src=0)",
        ("tests/test_ddp_codebook.py",),
        "initialisation broadcast, dead-code restarts not",
    ),
    Mutation(
        "ema-sums-not-reduced", "lightning_modules/vqgan/codebook.py",
        "            dist.all_reduce(sums)\n", "",
        ("tests/test_ddp_codebook.py",),
        "EMA code sums stay per rank",
    ),
    Mutation(
        "straight-through", "lightning_modules/vqgan/codebook.py",
        "return Quantized(straight_through,", "return Quantized(quantized,",
        ("tests/test_vqgan.py::test_straight_through_gradient_reaches_the_encoder_output",),
        "quantized value returned instead of the straight-through one",
    ),
    Mutation(
        "commitment-no-gradient", "lightning_modules/vqgan/codebook.py",
        "F.mse_loss(z, quantized.detach())", "F.mse_loss(z.detach(), quantized.detach())",
        ("tests/test_vqgan.py",),
        "commitment loss gives the encoder no gradient",
    ),
    Mutation(
        "least-squares-is-hinge", "lightning_modules/vqgan/vqgan.py",
        '"least_squares": "least_squares", "lsgan"', '"least_squares": "hinge", "lsgan"',
        ("tests/test_vqgan.py::test_least_squares_discriminator_loss_is_the_squared_distance_to_the_target",),
        "disc_loss_type=least_squares trains with the hinge loss",
    ),
    Mutation(
        "accumulation-unscaled", "lightning_modules/vqgan/vqgan.py",
        "scale = 1.0 / self.accumulate_grad_batches", "scale = 1.0",
        ("tests/test_vqgan.py::test_accumulating_two_batches_of_one_steps_like_one_batch_of_two",
         "tests/test_vqgan.py::test_accumulation_steps_every_n_batches_and_discriminator_start_counts_batches"),
        "manual-optimization gradients summed, not averaged, over accumulated batches",
    ),
    Mutation(
        "clipping-off", "lightning_modules/base.py",
        "if not self.automatic_optimization and self.gradient_clip_val:", "if False:",
        ("tests/test_vqgan.py::test_gradient_clipping_is_applied_after_unscaling_in_manual_optimization",),
        "manual optimization ignores trainer.gradient_clip_val",
    ),
    Mutation(
        "doctor-inf", "datamodules/pipeline/check.py",
        "np.count_nonzero(~np.isfinite(data))", "np.count_nonzero(np.isnan(data))",
        ("tests/test_data_doctor.py",),
        "data doctor looks for NaN only, lets Inf through",
    ),
    Mutation(
        "doctor-non-integer-labels", "datamodules/pipeline/check.py",
        "if np.any(values != np.round(values)):", "if False:",
        ("tests/test_data_doctor.py",),
        "data doctor's non-integer label check off",
    ),
    Mutation(
        "doctor-label-values", "datamodules/pipeline/check.py",
        "outside = sorted(set(values.tolist()) - set(label_values))", "outside = []",
        ("tests/test_data_doctor.py",),
        "data doctor accepts any label value",
    ),
    Mutation(
        "doctor-2d", "datamodules/pipeline/check.py",
        "if len(header.shape) < 3:", "if len(header.shape) < 2:",
        ("tests/test_data_doctor.py",),
        "data doctor accepts 2D images",
    ),
    Mutation(
        "doctor-covariates", "datamodules/sources/csv_table.py",
        "                if value is None:\n                    problems.append",
        "                if value is None and False:\n                    problems.append",
        ("tests/test_data_doctor.py",),
        "non-numeric covariates pass the data doctor",
    ),
    Mutation(
        "test-last-weights", "medvol/run/training.py",
        'test_ckpt = getattr(trainer.checkpoint_callback, "best_model_path", "") or None', "test_ckpt = None",
        ("tests/test_best_checkpoint.py", "tests/test_train.py::test_test_split_is_evaluated_with_the_best_checkpoint_and_alone"),
        "test=true tests the last weights, not the best checkpoint",
    ),
    Mutation(
        "worker-seeds-off", "datamodules/sources/nifti.py",
        "self.worker_init_fn = worker_init_fn", "self.worker_init_fn = None",
        ("tests/test_data_cache.py::test_each_loader_worker_draws_its_own_random_transforms",),
        "loader workers share one seed for the random transforms",
    ),
    Mutation(
        "disk-cache-one-folder", "datamodules/sources/nifti.py",
        'fingerprint({"class": type(self).__name__, "settings": asdict(self.settings), "extra": self.cache_key()})',
        'fingerprint({"class": type(self).__name__, "extra": self.cache_key()})',
        ("tests/test_data_cache.py::test_disk_cache_gets_a_new_folder_when_the_transform_settings_change",
         "tests/test_data_cache.py::test_cached_items_equal_uncached_ones"),
        "disk cache reused after a change of transform settings",
    ),
    Mutation(
        "val-fewer-than-ranks", "datamodules/pipeline/volume_datamodule.py",
        "        if total < world:\n            # A rank without a batch",
        "        if False:\n            # A rank without a batch",
        ("tests/test_ddp_failures.py::test_a_validation_split_with_fewer_subjects_than_ranks_stops_with_one_line",),
        "no check that every rank has a validation subject",
    ),
    Mutation(
        "evaluation-padded", "datamodules/pipeline/volume_datamodule.py",
        "EvaluationSampler(dataset, even_divisible=False,", "EvaluationSampler(dataset, even_divisible=True,",
        ("tests/test_ddp_correctness.py::test_validation_and_test_metrics_identical_on_ranks_and_single_process",),
        "validation pads uneven ranks with duplicate subjects",
    ),
    Mutation(
        "doctor-gzip-trailer", "datamodules/pipeline/check.py",
        "    return stored != expected % 2**32", "    return False",
        ("tests/test_data_doctor.py",),
        "the cheap check no longer spots truncated .nii.gz files",
    ),
    Mutation(
        "codebook-flag-not-saved", "lightning_modules/vqgan/codebook.py",
        'self.register_buffer("initialized", torch.tensor(False))',
        'self.register_buffer("initialized", torch.tensor(False), persistent=False)',
        ("tests/test_train.py::test_resumed_run_matches_uninterrupted_run_and_keeps_the_codebook",),
        "a resumed run re-initialises the codebook",
    ),
    Mutation(
        "csv-log-not-continued", "medvol/core/csv_logger.py",
        "        if self._fs.isfile(self.metrics_file_path):", "        if False:",
        ("tests/test_train.py::test_resumed_run_matches_uninterrupted_run_and_keeps_the_codebook",),
        "a resumed run's metrics.csv does not adopt the earlier header",
    ),
    Mutation(
        "find-unused-off", "conf/strategy/ddp_find_unused.yaml",
        "find_unused_parameters: true", "find_unused_parameters: false",
        ("tests/test_ddp_strategies.py::test_strategy_on_two_ranks_matches_one_process[ddp_find_unused-RegressorWithUnusedBranch]",),
        "strategy=ddp_find_unused is plain ddp",
    ),
    Mutation(
        "predict-no-source-units", "medvol/volumes/prediction_writer.py",
        "        return torch.stack([scale_from_range(c, lo, hi, out_range)",
        "        return volume if True else torch.stack([scale_from_range(c, lo, hi, out_range)",
        ("tests/test_predict.py",),
        "outputs written in model units, the dataset's percentile/window scaling not inverted",
    ),
    Mutation(
        "predict-one-channel-scaling", "medvol/volumes/prediction_writer.py",
        "zip(volume, lows, highs, strict=True)", "zip(volume, lows[:1] * len(lows), highs[:1] * len(highs), strict=True)",
        ("tests/test_predict.py",),
        "every output channel inverted with the first channel's percentiles",
    ),
    Mutation(
        "predict-whole-volume-window", "medvol/volumes/sliding_window.py",
        "stacked.to(self.output_device), list(self.roi)", "stacked.to(self.output_device), list(stacked.shape[2:])",
        ("tests/test_predict.py",),
        "predict.py runs the network on the whole volume, not on windows of the training size",
    ),
    Mutation(
        "predict-channels-unchecked", "medvol/run/predicting.py",
        "                check_channels(batch, expected_channels)\n", "",
        ("tests/test_predict.py",),
        "an input with another channel count than the model's is not refused",
    ),
    Mutation(
        "predict-output-inside-input", "medvol/run/predicting.py",
        "        if out == folder or folder in out.parents:", "        if out == folder:",
        ("tests/test_predict.py",),
        "an output_dir below the input folder is accepted",
    ),
]


def copy_repository(destination: Path) -> None:
    """The tracked and untracked (not ignored) files of the working tree, without the venv or caches."""
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def pytest(copy: Path, tests: Sequence[str]) -> tuple[bool, float, str]:
    """Run `tests` (slow ones too) in `copy`: whether they all pass, the seconds, the first failure's line."""
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-m", "", "-p", "no:cacheprovider", *tests]
    start = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - start, f"timed out after {RUN_TIMEOUT} s"
    failures = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if result.returncode != 0:
        (copy / "last-failure.txt").write_text(result.stdout + result.stderr)
    return result.returncode == 0, time.perf_counter() - start, (failures or [""])[0][:200]


def check_imports_from(copy: Path) -> None:
    """The tests must import the copy's (mutated) modules, not the editable install of the working tree."""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    probe = "import medvol, lightning_modules, datamodules; print(medvol.__file__, lightning_modules.__file__, datamodules.__file__)"
    files = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=env, capture_output=True, text=True, check=True)
    if any(not Path(f).resolve().is_relative_to(copy.resolve()) for f in files.stdout.split()):
        raise SystemExit(f"the copy does not shadow the installed packages: {files.stdout.strip()}")


def apply(copy: Path, mutation: Mutation) -> str:
    """Mutate the copy's file; return its original text."""
    path = copy / mutation.file
    text = path.read_text()
    count = text.count(mutation.original)
    if count != 1:
        raise SystemExit(f"{mutation.name}: the original text occurs {count} times in {mutation.file}; update the mutation")
    path.write_text(text.replace(mutation.original, mutation.replacement))
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s): {sorted(unknown)}")
    if args.list:
        for m in chosen:
            print(f"{m.name:<28} {m.file:<45} {m.what}")
        return 0

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="medvol-mutations-") as tmp:
        copy = Path(tmp)
        copy_repository(copy)
        check_imports_from(copy)
        for m in chosen:  # every original text is found before any test runs
            (copy / m.file).write_text(apply(copy, m))
        if not args.no_baseline:
            tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
            passed, seconds, failure = pytest(copy, tests)
            print(f"baseline: {len(tests)} test selections on the unmutated copy {'pass' if passed else 'FAIL'} ({seconds:.0f} s)")
            if failure:
                print(f"  {failure}")
            if not passed:
                report = copy / "last-failure.txt"
                print(report.read_text()[-6000:] if report.is_file() else "")
                return 1
        rows = []
        for m in chosen:
            original = apply(copy, m)
            passed, seconds, failure = pytest(copy, m.tests)
            (copy / m.file).write_text(original)
            rows.append((m, not passed, seconds, failure))
            # The failing test's line shows it failed for the mutation, not for an unrelated reason.
            print(f"{m.name}: {'caught' if not passed else 'NOT CAUGHT'} ({seconds:.0f} s) {failure}", flush=True)

    print("\n| mutation | what it breaks | caught by (first failing test) | s |\n|---|---|---|---|")
    for m, caught, seconds, failure in rows:
        if caught:
            # "FAILED tests/x.py::name - AssertionError..." -> "x.py::name"
            by = f"`{failure.split(' ', 1)[1].split(' - ')[0].removeprefix('tests/')}`" if " " in failure else "yes"
        else:
            by = "**not caught** by " + ", ".join(f"`{t.removeprefix('tests/')}`" for t in m.tests)
        print(f"| `{m.name}` | {m.what} | {by} | {seconds:.0f} |")
    missed = [m.name for m, caught, _, _ in rows if not caught]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} mutations caught" + (f"; not caught: {', '.join(missed)}" if missed else ""))
    print(f"{time.perf_counter() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
