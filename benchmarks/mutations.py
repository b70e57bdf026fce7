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
        '"class": type(self).__name__, "settings": asdict(self.settings), "extra": self.cache_key(),',
        '"class": type(self).__name__, "extra": self.cache_key(),',
        ("tests/test_data_cache.py::test_disk_cache_gets_a_new_folder_when_the_transform_settings_change",
         "tests/test_data_cache_auto.py::test_a_disk_cache_is_reused_only_for_the_same_transforms_and_files"),
        "disk cache reused after a change of transform settings",
    ),
    Mutation(
        "disk-cache-files-ignored", "datamodules/sources/nifti.py",
        '            "files": file_stats(files),\n', "",
        ("tests/test_data_cache_auto.py::test_a_disk_cache_is_reused_only_for_the_same_transforms_and_files",),
        "disk cache reused after a source file was rewritten",
    ),
    Mutation(
        "disk-cache-item-not-atomic", "datamodules/pipeline/disk_cache.py",
        "atomic_torch_save(item, path, shared=True)",
        "(path.parent.mkdir(parents=True, exist_ok=True), torch.save(item, path))",
        ("tests/test_data_cache_auto.py::test_a_full_disk_leaves_no_item_file_and_a_truncated_item_is_made_again",),
        "disk cache items written in place (a full disk leaves half an item)",
    ),
    Mutation(
        "uncached-random-reseeded", "datamodules/pipeline/cache.py",
        "        base: Dataset = TransformDataset(records, head)\n",
        "        return TransformDataset(records, Compose([*deterministic, *tail.transforms]))\n",
        ("tests/test_data_cache_auto.py::test_cached_training_batches_equal_uncached_ones_bitwise_with_the_random_transforms",),
        "uncached random transforms reseeded by MONAI, not by the run's seed",
    ),
    Mutation(
        "auto-not-partitioned", "datamodules/pipeline/volume_datamodule.py",
        'return self.cache != "none"', 'return self.cache in ("memory", "smart")',
        ("tests/test_data_cache_auto.py::test_two_gloo_ranks_each_cache_their_own_share",),
        "every rank caches every subject with dataset.cache=auto or disk",
    ),
    Mutation(
        "cached-loaded-by-processes", "datamodules/pipeline/volume_datamodule.py",
        "if self.gpu_transforms or isinstance(dataset, CacheDataset):", "if self.gpu_transforms:",
        ("tests/test_data_cache_auto.py::test_a_memory_cache_with_nothing_to_compute_per_draw_is_served_by_a_thread",),
        "in-memory items with nothing to compute per draw copied through worker processes",
    ),
    Mutation(
        "patches-cache-metadata", "datamodules/sources/patches.py",
        "        chain.append(EnsureTyped(keys, track_meta=False))\n", "",
        ("tests/test_data_cache_auto.py::test_every_file_dataset_reads_its_disk_items_back_instead_of_making_them_again",),
        "patch volumes cached with MONAI metadata, so their disk items are made again on every read",
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
        "        return torch.stack([convert(c, lo, hi, out_range)",
        "        return volume if True else torch.stack([convert(c, lo, hi, out_range)",
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
        "        check_input_channels(inputs.records, expected, where)\n", "",
        ("tests/test_predict.py",),
        "an input with another channel count than the model's is not refused",
    ),
    Mutation(
        "predict-output-inside-input", "medvol/run/predicting.py",
        "        if out == folder or folder in out.parents:", "        if out == folder:",
        ("tests/test_predict.py",),
        "an output_dir below the input folder is accepted",
    ),    # Issue 18: survival and classifier metrics.
    Mutation(
        "survival-auc-negated-risk", "lightning_modules/discriminative/survival_metrics.py",
        "auc = Auc()(risk, event, time,", "auc = Auc()(-risk, event, time,",
        ("tests/test_outcome_metrics.py::test_time_dependent_auc_equals_the_hand_worked_ipcw_estimate",),
        "the time-dependent AUC computed on -risk",
    ),
    Mutation(
        "survival-auc-unweighted", "lightning_modules/discriminative/survival_metrics.py",
        "auc = Auc()(risk, event, time, weight=ipcw,", "auc = Auc()(risk, event, time, weight=None,",
        ("tests/test_outcome_metrics.py::test_time_dependent_auc_equals_the_hand_worked_ipcw_estimate",),
        "the time-dependent AUC without the inverse-probability-of-censoring weights",
    ),
    Mutation(
        "survival-uno-unweighted", "lightning_modules/discriminative/survival_metrics.py",
        'out["uno_cindex"] = ConcordanceIndex()(risk, event, time, weight=ipcw)',
        'out["uno_cindex"] = ConcordanceIndex()(risk, event, time)',
        ("tests/test_survival.py::test_cindex_equals_lifelines_and_uno_equals_torchsurv_on_ties_and_censoring",),
        "Uno's C-index is Harrell's (no censoring weights)",
    ),
    Mutation(
        "survival-metrics-per-rank", "lightning_modules/discriminative/survival_metrics.py",
        "        super().__init__()\n        self.horizons", "        super().__init__(sync_on_compute=False)\n        self.horizons",
        ("tests/test_outcome_metrics.py::test_survival_metrics_gathered_from_two_gloo_ranks_are_the_whole_sets",),
        "survival metrics computed on each rank's share, not on the gathered set",
    ),
    Mutation(
        "cox-risk-set-per-rank", "lightning_modules/discriminative/survival.py",
        "        if self.trainer.world_size == 1:\n            return tensor", "        if True:\n            return tensor",
        ("tests/test_survival.py::test_two_gloo_ranks_train_and_evaluate_as_one_process",),
        "the Cox loss of each rank's batch alone, not of the global batch",
    ),
    Mutation(
        "cox-breslow-for-efron", "lightning_modules/discriminative/cox_loss.py",
        "ties_method=ties,", 'ties_method="breslow",',
        ("tests/test_survival.py::test_cox_loss_equals_hand_computed_ties_and_torchsurv",),
        "model.ties=efron trains with Breslow's ties",
    ),
    Mutation(
        "classifier-flipped-probabilities", "lightning_modules/discriminative/classifier.py",
        'getattr(self, f"{stage}_metrics").update(probabilities, labels)\n        getattr(self, f"{stage}_auroc").update(probabilities, labels)',
        'getattr(self, f"{stage}_metrics").update(probabilities.flip(1), labels)\n        getattr(self, f"{stage}_auroc").update(probabilities.flip(1), labels)',
        ("tests/test_outcome_metrics.py::test_classifier_auroc_and_accuracies_equal_scikit_learn_on_the_same_probabilities",
         "tests/test_outcome_metrics.py::test_classifier_metrics_gathered_from_two_gloo_ranks_equal_scikit_learn_on_the_whole_set"),
        "the classifier's AUROC and accuracies fed flipped probabilities",
    ),
    Mutation(
        "classifier-accuracy-macro", "lightning_modules/discriminative/classifier.py",
        'MulticlassAccuracy(num_classes, average="micro")', 'MulticlassAccuracy(num_classes, average="macro")',
        ("tests/test_outcome_metrics.py::test_classifier_auroc_and_accuracies_equal_scikit_learn_on_the_same_probabilities",),
        "accuracy is the mean per-class recall (balanced accuracy under another name)",
    ),
    Mutation(
        "classifier-balanced-accuracy-micro", "lightning_modules/discriminative/classifier.py",
        'MulticlassRecall(num_classes, average="macro")', 'MulticlassRecall(num_classes, average="micro")',
        ("tests/test_outcome_metrics.py::test_classifier_auroc_and_accuracies_equal_scikit_learn_on_the_same_probabilities",),
        "balanced accuracy is plain accuracy",
    ),
    Mutation(
        "classifier-rows-argmin", "lightning_modules/discriminative/classifier.py",
        '"predicted": int(row.argmax())', '"predicted": int(row.argmin())',
        ("tests/test_outcome_metrics.py::test_classifier_test_rows_hold_the_softmax_and_its_argmax",),
        "probabilities.csv names the least likely class as the prediction",
    ),
    # Issue 18: segmentation (loss, metrics in mm, post-processing, whole-volume windows).
    Mutation(
        "seg-region-bce-dropped", "lightning_modules/segmentation/losses.py",
        "return self.lambda_dice * self.dice(logits, target) + self.lambda_bce * bce",
        "return self.lambda_dice * self.dice(logits, target)",
        ("tests/test_segmentation.py::test_region_loss_is_sigmoid_dice_plus_binary_cross_entropy_not_monais_softmax_ce",),
        "the region loss without its binary cross-entropy term",
    ),
    Mutation(
        "seg-region-softmax-ce", "lightning_modules/segmentation/losses.py",
        'return DiceBCELoss() if name == "dice_ce"', 'return DiceCELoss(sigmoid=True) if name == "dice_ce"',
        ("tests/test_segmentation.py::test_region_loss_is_sigmoid_dice_plus_binary_cross_entropy_not_monais_softmax_ce",),
        "overlapping regions trained with MONAI's softmax cross-entropy",
    ),
    Mutation(
        "seg-hd95-in-voxels", "lightning_modules/segmentation/subject_scores.py",
        "percentile=95, spacing=spacing)", "percentile=95, spacing=None)",
        ("tests/test_segmentation.py::test_hd95_in_millimetres_and_dice_on_an_oblique_anisotropic_volume_equal_a_hand_count",),
        "HD95 in voxels, not millimetres",
    ),
    Mutation(
        "seg-spacing-row-norms", "lightning_modules/segmentation/segmentation.py",
        "affine[:, :3, :3].double().norm(dim=1)", "affine[:, :3, :3].double().norm(dim=2)",
        ("tests/test_segmentation.py::test_hd95_in_millimetres_and_dice_on_an_oblique_anisotropic_volume_equal_a_hand_count",),
        "voxel spacing read from the affine's rows (wrong on an oblique grid)",
    ),
    Mutation(
        "seg-hd-maximum", "lightning_modules/segmentation/subject_scores.py",
        "include_background=True, percentile=95,", "include_background=True, percentile=None,",
        ("tests/test_segmentation.py::test_hd95_in_millimetres_and_dice_on_an_oblique_anisotropic_volume_equal_a_hand_count",),
        "the maximum Hausdorff distance reported as HD95",
    ),
    Mutation(
        "seg-dice-empty-ignored", "lightning_modules/segmentation/subject_scores.py",
        "ignore_empty=False)", "ignore_empty=True)",
        ("tests/test_segmentation.py::test_dice_and_hd95_equal_monais_metric_classes",),
        "an empty prediction of an empty target is not scored 1",
    ),
    Mutation(
        "seg-largest-component-off", "lightning_modules/segmentation/segmentation.py",
        "if self.largest is not None:", "if False:",
        ("tests/test_segmentation.py::test_post_processing_keeps_the_largest_component_of_each_class_or_region",),
        "model.largest_component=true keeps every component",
    ),
    Mutation(
        "seg-largest-cuts-background", "lightning_modules/segmentation/segmentation.py",
        "first = 0 if self.scheme.is_regions else 1", "first = 0",
        ("tests/test_segmentation.py::test_post_processing_keeps_the_largest_component_of_each_class_or_region",),
        "the background is cut down to its largest component too",
    ),
    Mutation(
        "seg-window-constant-blend", "lightning_modules/segmentation/segmentation.py",
        'overlap=self.hparams.overlap, mode="gaussian",', 'overlap=self.hparams.overlap, mode="constant",',
        ("tests/test_segmentation.py::test_whole_volume_evaluation_blends_windows_with_gaussian_weights",),
        "validation and test blend the windows with constant weights",
    ),
    # Issue 18: predict (geometry, units, fill values).
    Mutation(
        "source-grid-nearest-for-linear", "medvol/volumes/source_grid.py",
        '        if mode == "nearest":\n', "        if True:\n",
        ("tests/test_volume_geometry.py::test_linear_resampling_onto_an_oblique_anisotropic_source_grid_equals_nibabel",),
        "the source-grid resampling nearest instead of linear",
    ),
    Mutation(
        "writer-nearest-for-intensities", "medvol/volumes/prediction_writer.py",
        '"nearest" if is_label else "linear"', '"nearest"',
        ("tests/test_volume_geometry.py::test_the_writer_puts_a_float_output_on_the_source_grid_linearly_with_its_darkest_value_outside",),
        "float outputs written to the source grid by nearest voxel",
    ),
    Mutation(
        "source-grid-axes-unreversed", "medvol/volumes/source_grid.py",
        "normalised = (coords / scale * 2 - 1)[:, ::-1].copy()", "normalised = (coords / scale * 2 - 1).copy()",
        ("tests/test_volume_geometry.py::test_linear_resampling_onto_an_oblique_anisotropic_source_grid_equals_nibabel",),
        "grid_sample given (D, H, W) where it reads (x, y, z) = (W, H, D)",
    ),
    Mutation(
        "source-grid-half-voxel", "medvol/volumes/source_grid.py",
        'mode="bilinear", padding_mode="zeros", align_corners=True', 'mode="bilinear", padding_mode="zeros", align_corners=False',
        ("tests/test_volume_geometry.py::test_linear_resampling_onto_an_oblique_anisotropic_source_grid_equals_nibabel",),
        "linear lookups half a voxel off (corners, not centres, aligned)",
    ),
    Mutation(
        "source-grid-floor", "medvol/volumes/source_grid.py",
        "nearest = np.rint(coords).astype(np.int64)", "nearest = np.floor(coords).astype(np.int64)",
        ("tests/test_volume_geometry.py::test_nearest_resampling_of_a_label_map_equals_nibabel_order_zero",),
        "label maps take the voxel below, not the nearest one",
    ),
    Mutation(
        "writer-fill-zero", "medvol/volumes/prediction_writer.py",
        "fill = 0.0 if is_label else float(volume.min())", "fill = 0.0",
        ("tests/test_volume_geometry.py::test_the_writer_puts_a_float_output_on_the_source_grid_linearly_with_its_darkest_value_outside",),
        "source voxels outside the model's field of view are 0 (0 HU: water), not the darkest output value",
    ),
    Mutation(
        "sliding-window-constant-blend", "medvol/volumes/sliding_window.py",
        "mode=self.mode, sw_device=self.device", 'mode="constant", sw_device=self.device',
        ("tests/test_volume_geometry.py::test_gaussian_blending_of_a_position_dependent_network_equals_a_hand_blend",),
        "the sliding window blending with constant weights",
    ),
    Mutation(
        "units-window-range", "medvol/volumes/prediction_writer.py",
        "float(window[1]), (-1.0, 1.0))", "float(window[1]), (0.0, 1.0))",
        ("tests/test_volume_geometry.py::test_a_model_window_is_inverted_into_its_raw_units_by_hand",),
        "a model's raw window inverted from [0, 1] model units instead of [-1, 1]",
    ),
    Mutation(
        "units-unclipped", "medvol/volumes/intensity.py",
        "unit = (volume.clamp(out_low, out_high) - out_low)", "unit = (volume - out_low)",
        ("tests/test_volume_geometry.py::test_a_model_window_is_inverted_into_its_raw_units_by_hand",),
        "model values beyond the model range extrapolated past the window",
    ),
    # Issue 18: telemetry.
    Mutation(
        "telemetry-no-world-size", "callbacks/telemetry.py",
        "self.epoch.samples += batch_size(batch) * trainer.world_size", "self.epoch.samples += batch_size(batch)",
        ("tests/test_telemetry.py::test_samples_per_second_on_two_gloo_ranks_counts_both_ranks_batches",),
        "telemetry's samples/s without the world size",
    ),
    Mutation(
        "telemetry-first-step-counted", "callbacks/telemetry.py",
        "if trainer.current_epoch > 0 or self.run.steps:", "if True:",
        ("tests/test_telemetry.py::test_samples_per_second_on_two_gloo_ranks_counts_both_ranks_batches",),
        "the run's first step (one-off start-up costs) counted",
    ),
    Mutation(
        "telemetry-wait-not-counted", "callbacks/telemetry.py",
        "self.epoch.wait_seconds += time.perf_counter() - self._last_end", "self.epoch.wait_seconds += 0.0",
        ("tests/test_telemetry.py::test_data_wait_is_near_one_for_a_slow_loader_and_warns_with_the_remedies",),
        "the CPU data wait never counted",
    ),
    Mutation(
        "telemetry-wait-share-of-wait-plus-step", "callbacks/telemetry.py",
        "min(1.0, totals.wait_seconds / totals.seconds)", "totals.wait_seconds / (totals.seconds + totals.wait_seconds)",
        ("tests/test_telemetry.py::test_data_wait_is_near_one_for_a_slow_loader_and_warns_with_the_remedies",),
        "the wait, already part of the step, counted twice in the data-wait fraction",
    ),
    Mutation(
        "telemetry-samples-per-step-and-wait", "callbacks/telemetry.py",
        '"samples_per_second": totals.samples / totals.seconds if', '"samples_per_second": totals.samples / (totals.seconds + totals.wait_seconds) if',
        ("tests/test_telemetry.py::test_data_wait_is_near_one_for_a_slow_loader_and_warns_with_the_remedies",),
        "samples/s over the step time plus the wait again",
    ),
    Mutation(
        "telemetry-warning-off", "callbacks/telemetry.py",
        "if wait > self.data_wait_warning:", "if wait > 1.0:",
        ("tests/test_telemetry.py::test_data_wait_is_near_one_for_a_slow_loader_and_warns_with_the_remedies",),
        "no warning for a loader-bound run",
    ),
    # Issue 18: atomic checkpoints.
    Mutation(
        "atomic-direct-write", "medvol/core/atomic_checkpoint.py",
        "    partial = partial_path(target)\n", "    partial = target\n",
        ("tests/test_atomic_checkpoint.py::test_failed_write_leaves_the_previous_last_checkpoint_intact",),
        "checkpoints written in place: a failed write destroys the previous last.ckpt",
    ),
    Mutation(
        "atomic-no-file-fsync", "medvol/core/atomic_checkpoint.py",
        "            os.fsync(stream.fileno())\n", "",
        ("tests/test_atomic_checkpoint.py::test_write_fsyncs_the_file_before_the_rename_and_the_folder_after",),
        "the file renamed into place before its bytes reach the disk",
    ),
    Mutation(
        "atomic-no-folder-fsync", "medvol/core/atomic_checkpoint.py",
        "    _fsync_folder(target.parent)\n", "",
        ("tests/test_atomic_checkpoint.py::test_write_fsyncs_the_file_before_the_rename_and_the_folder_after",),
        "the rename itself not made durable",
    ),
    Mutation(
        "atomic-stale-partials-kept", "medvol/core/atomic_checkpoint.py",
        "    _remove_partials(target.parent)\n", "",
        ("tests/test_atomic_checkpoint.py::test_partial_file_left_by_a_killed_writer_is_removed_by_the_next_write",),
        "partial files of a killed writer pile up",
    ),
    Mutation(
        "atomic-partial-kept-on-failure", "medvol/core/atomic_checkpoint.py",
        "        partial.unlink(missing_ok=True)\n        raise", "        raise",
        ("tests/test_atomic_checkpoint.py::test_failed_write_leaves_the_previous_last_checkpoint_intact",),
        "a failed write leaves its partial file",
    ),
    Mutation(
        "atomic-plugin-off", "medvol/core/atomic_checkpoint.py",
        "    return [AtomicCheckpointIO()]", "    return []",
        ("tests/test_atomic_checkpoint.py::test_a_strategy_with_its_own_checkpoint_io_keeps_it",
         "tests/test_atomic_checkpoint.py::test_every_run_writes_its_checkpoints_atomically"),
        "runs write their checkpoints with Lightning's plain writer",
    ),
    # Issue 18: refusals (one line, nothing left behind).
    Mutation(
        "refusal-fresh-dir-kept", "medvol/run/refusal.py",
        "            shutil.rmtree(self.output_dir, ignore_errors=True)\n            return True",
        "            return True",
        ("tests/test_refusals.py::test_take_back_removes_only_a_directory_made_for_the_refused_command",),
        "a refused command leaves its fresh run directory",
    ),
    Mutation(
        "refusal-log-not-cut", "medvol/run/refusal.py",
        "                file.truncate(self.log_size)", "                pass",
        ("tests/test_refusals.py::test_take_back_removes_only_a_directory_made_for_the_refused_command",),
        "a refused command's lines stay in an earlier run's train.log",
    ),
    Mutation(
        "refusal-checkpointed-run-removed", "medvol/run/refusal.py",
        "        if self.saved_checkpoints():\n            return False\n", "",
        ("tests/test_refusals.py::test_take_back_keeps_a_run_once_the_refused_command_has_saved_a_checkpoint",),
        "a run that failed after saving a checkpoint is removed",
    ),
    Mutation(
        "refusal-resume-record-kept", "medvol/run/refusal.py",
        'if self.hydra_subdir and Path(self.hydra_subdir).name.startswith("resume-"):', "if False:",
        ("tests/test_refusals.py::test_a_refused_resume_adds_nothing_to_the_run",),
        "a refused resume leaves its .hydra/resume-<stamp> record",
    ),
    Mutation(
        "checkpoint-family-unchecked", "medvol/run/checkpoint_check.py",
        "    if saved != wanted:", "    if False:",
        ("tests/test_refusals.py::test_each_checkpoint_that_cannot_resume_this_model_is_named",),
        "another family's checkpoint accepted",
    ),
    Mutation(
        "checkpoint-shapes-unchecked", "medvol/run/checkpoint_check.py",
        "if key in own and tuple(own[key].shape) != tuple(value.shape):", "if False:",
        ("tests/test_refusals.py::test_each_checkpoint_that_cannot_resume_this_model_is_named",),
        "a checkpoint of other network sizes accepted",
    ),
    Mutation(
        "checkpoint-missing-weights-accepted", "medvol/run/checkpoint_check.py",
        'missing = sorted(set(own) - set(checkpoint["state_dict"]))', "missing = []",
        ("tests/test_refusals.py::test_each_checkpoint_that_cannot_resume_this_model_is_named",),
        "a checkpoint without some of the model's weights accepted",
    ),
    Mutation(
        "run-check-fp16-on-cpu", "medvol/run/run_check.py",
        'if accelerator == "cpu" and str(precision) in ("16-mixed", "16"):', "if False:",
        ("tests/test_refusals.py::test_each_trainer_value_lightning_would_refuse_is_named",),
        "float16 mixed precision on the CPU not refused",
    ),
    Mutation(
        "run-check-optimizer-unbuilt", "medvol/run/run_check.py",
        "            factory([torch.nn.Parameter(torch.zeros(1))])", "            pass",
        ("tests/test_refusals.py::test_values_pytorch_or_the_loader_would_refuse_are_named",),
        "a bad learning rate found only inside fit",
    ),
    # Issue 18: the cascade hands on the best checkpoint.
    Mutation(
        "cascade-hands-on-last", "medvol/run/cascade.py",
        "source = Path(best) if found else last", "source = last",
        ("tests/test_cascade.py",),
        "the cascade hands on the last checkpoint, not the best",
    ),
    Mutation(
        "cascade-best-by-class-name", "medvol/run/cascade.py",
        '((s["best_model_path"], s.get("best_model_score")) for s in state.get("callbacks", {}).values()\n'
        '         if isinstance(s, dict) and s.get("monitor") and s.get("best_model_path")),',
        '((s["best_model_path"], s.get("best_model_score")) for k, s in state.get("callbacks", {}).items()\n'
        '         if "ModelCheckpoint" in k and s.get("best_model_path")),',
        ("tests/test_cascade.py",),
        "the best path looked up under a callback state named ModelCheckpoint (StepCheckpoint's has its own name)",
    ),
    Mutation(
        "cascade-summary-last-score", "medvol/run/cascade.py",
        '"best_score": score,', '"best_score": stage_metrics.get(str(cfg.get("optimized_metric"))),',
        ("tests/test_cascade.py",),
        "the cascade's summary and log give a stage's last-epoch metric as its best score",
    ),
    # Issue 18: the diffusion core (lightning_modules/diffusion/).
    Mutation(
        "ddim-walk-to-minus-one", "lightning_modules/diffusion/samplers.py",
        "previous = [-1, *steps[:-1]]", "previous = [-1] * len(steps)",
        ("tests/test_diffusion_core.py::test_ddim_walk_of_a_biased_denoiser_equals_the_papers_update_written_out",),
        "the DDIM walk steps every time to t = -1",
    ),
    Mutation(
        "ddim-sigma-not-subtracted", "lightning_modules/diffusion/samplers.py",
        "(1 - a_prev - sigma**2).clamp(min=0).sqrt() * eps", "(1 - a_prev).clamp(min=0).sqrt() * eps",
        ("tests/test_diffusion_core.py::test_ddim_walk_of_a_biased_denoiser_equals_the_papers_update_written_out",),
        "DDIM with eta > 0 keeps the whole sqrt(1 - a_prev) on the predicted noise",
    ),
    Mutation(
        "ddpm-posterior-same-step", "lightning_modules/diffusion/samplers.py",
        "schedule.alpha_bar(t_batch), schedule.alpha_bar(t_batch - 1))", "schedule.alpha_bar(t_batch), schedule.alpha_bar(t_batch))",
        ("tests/test_diffusion_core.py::test_ddpm_ancestral_walk_of_a_biased_denoiser_equals_hos_posterior_written_out",),
        "ancestral sampling takes alpha_bar_t for alpha_bar_{t-1}",
    ),
    Mutation(
        "cosine-offset-dropped", "lightning_modules/diffusion/schedule.py",
        "        s = 0.008\n", "        s = 0.0\n",
        ("tests/test_diffusion_core.py::test_schedules_equal_monais_and_the_v_target_is_monais_velocity",),
        "the cosine schedule without Nichol and Dhariwal's offset s",
    ),
    Mutation(
        "v-target-sign", "lightning_modules/diffusion/prediction.py",
        "return a.sqrt() * noise - (1 - a).sqrt() * x0", "return a.sqrt() * noise + (1 - a).sqrt() * x0",
        ("tests/test_diffusion_core.py::test_schedules_equal_monais_and_the_v_target_is_monais_velocity",),
        "the v target with the sign of its x0 term flipped",
    ),
    Mutation(
        "clip-sample-ignored", "lightning_modules/diffusion/diffusion_module.py",
        "return clip_x0(x0, x_t, self.schedule.alpha_bar(t)) if self.clip_sample else (x0, eps)", "return x0, eps",
        ("tests/test_diffusion_core.py::test_clip_sample_clamps_each_predicted_x0_and_recomputes_its_epsilon",),
        "model.clip_sample=true does not clamp the predicted x0",
    ),
    Mutation(
        "loss-sum-is-mean", "lightning_modules/diffusion/diffusion_module.py",
        "return squared.flatten(1).sum(1).mean()", "return squared.mean()",
        ("tests/test_diffusion_core.py::test_loss_reductions_are_the_voxel_mean_and_the_per_sample_voxel_sum_averaged_over_the_batch",),
        "model.loss_reduction=sum averages over the voxels",
    ),
    Mutation(
        "ema-decay-inverted", "lightning_modules/diffusion/ema.py",
        "ema_param.lerp_(param.detach().to(ema_param.dtype), 1.0 - decay)", "ema_param.lerp_(param.detach().to(ema_param.dtype), decay)",
        ("tests/test_diffusion_core.py::test_ema_follows_the_decay_and_copies_buffers",),
        "the EMA keeps 1 - decay of its average and takes decay of the new weights",
    ),
    Mutation(
        "subject-noise-ignores-name", "lightning_modules/diffusion/subject_noise.py",
        'f"{int(seed)}/{subject}/{salt}"', 'f"{int(seed)}/{salt}"',
        ("tests/test_subject_noise.py",),
        "every subject draws the same sampling noise",
    ),
    Mutation(
        "train-steps-not-antithetic", "lightning_modules/diffusion/diffusion_module.py",
        "index = antithetic_indices(batch_size, len(self.train_timesteps))",
        "index = torch.randint(0, len(self.train_timesteps), (batch_size,))",
        ("tests/test_ddpm.py::test_training_draws_only_from_the_set_in_antithetic_pairs",),
        "training steps drawn independently, not in Fast-DDPM's antithetic pairs",
    ),
    Mutation(
        "validation-raw-weights", "lightning_modules/diffusion/diffusion_module.py",
        "return self.ema.module if self.ema is not None else self.network", "return self.network",
        ("tests/test_ddpm.py::test_validation_and_sampling_use_the_ema_weights",),
        "validation, test and sampling use the trained weights, not their EMA",
    ),
    # Issue 18: the Fast-DDPM module (lightning_modules/diffusion/fast_ddpm.py).
    Mutation(
        "fast-ddpm-condition-last", "lightning_modules/diffusion/fast_ddpm.py",
        "torch.cat([cond.to(x_t.dtype), x_t], dim=1)", "torch.cat([x_t, cond.to(x_t.dtype)], dim=1)",
        ("tests/test_ddpm.py::test_translation_on_synthetic_pairs_t1_to_t2_and_concatenates_the_condition_first",),
        "the condition concatenated after x_t (MONAI's order), not before it (the reference's)",
    ),
    Mutation(
        "fast-ddpm-denoising-clean-condition", "lightning_modules/diffusion/fast_ddpm.py",
        "return image.float() + self.hparams.noise_std * self.noise_like(image, noise)", "return image.float()",
        ("tests/test_ddpm.py::test_denoising_and_super_resolution_conditions_are_the_image_degraded_by_hand",),
        "task=denoising conditions on the clean image",
    ),
    Mutation(
        "fast-ddpm-super-resolution-max-pool", "lightning_modules/diffusion/fast_ddpm.py",
        "low = F.avg_pool3d(image.float(), kernel_size=factor)", "low = F.max_pool3d(image.float(), kernel_size=factor)",
        ("tests/test_ddpm.py::test_denoising_and_super_resolution_conditions_are_the_image_degraded_by_hand",),
        "task=super_resolution downsamples by the block maximum, not the block mean",
    ),
    Mutation(
        "fast-ddpm-psnr-of-the-condition", "lightning_modules/diffusion/fast_ddpm.py",
        'metrics[f"{prefix}psnr"].update(sample, x0)', 'metrics[f"{prefix}psnr"].update(cond, x0)',
        ("tests/test_ddpm.py::test_validation_psnr_is_that_of_the_sample_against_the_target_by_hand",),
        "val/psnr scores the condition, not the sample",
    ),
    Mutation(
        "fast-ddpm-validation-global-noise", "lightning_modules/diffusion/fast_ddpm.py",
        "sample = self.sample(self.noise_like(x0, noise),", "sample = self.sample(self.noise_like(x0),",
        ("tests/test_ddpm.py::test_validation_and_sampling_use_the_ema_weights",),
        "validation starts from the global RNG's noise, not the subject's stream",
    ),
    Mutation(
        "fast-ddpm-streams-by-position", "lightning_modules/diffusion/fast_ddpm.py",
        "names = subject_names(batch, batch_idx,", "names = subject_names({}, batch_idx,",
        ("tests/test_ddpm.py::test_validation_and_sampling_use_the_ema_weights",),
        "sampling noise follows the batch position, not the subject",
    ),
    Mutation(
        "fast-ddpm-trains-the-ema", "lightning_modules/diffusion/fast_ddpm.py",
        "loss = self.diffusion_loss(self.network, x0,", "loss = self.diffusion_loss(self.sampling_network, x0,",
        ("tests/test_ddpm.py::test_training_draws_only_from_the_set_in_antithetic_pairs",),
        "the training loss is computed with the EMA copy, not the trained network",
    ),
    # Issue 18: X-ray-to-CT (the physics term, the projector's views and axes, the stage hand-off).
    Mutation(
        "xray-physics-term-dropped", "lightning_modules/xray2ct/module.py",
        "loss = diffusion_loss + self.hparams.physics_weight * ", "loss = diffusion_loss + 0.0 * ",
        ("tests/test_xray2ct_training.py::test_training_loss_gradient_holds_the_projection_term_of_a_hand_built_loss",),
        "the X-ray-to-CT loss without the physics term (logged, not trained)",
    ),
    Mutation(
        "xray-physics-of-the-output", "lightning_modules/xray2ct/module.py",
        "self.physics(x0_hat if base is None", "self.physics(output if base is None",
        ("tests/test_xray2ct_training.py::test_training_loss_gradient_holds_the_projection_term_of_a_hand_built_loss",),
        "the physics term projects the network's output (v), not the x0 recovered from it",
    ),
    Mutation(
        "xray-physics-window-ignored", "lightning_modules/xray2ct/physics.py",
        "scale_from_range(volume[:, 0].float(), *self.window,", "scale_from_range(volume[:, 0].float(), -1000.0, 1000.0,",
        ("tests/test_xray2ct_training.py::test_training_loss_gradient_holds_the_projection_term_of_a_hand_built_loss",),
        "the physics loss maps model units to HU with [-1000, 1000], not model.window",
    ),
    Mutation(
        "xray-physics-views-reversed", "lightning_modules/xray2ct/physics.py",
        "self.views = list(views)", "self.views = list(views)[::-1]",
        ("tests/test_xray2ct_training.py::test_training_loss_gradient_holds_the_projection_term_of_a_hand_built_loss",),
        "the physics loss compares each DRR with the other view",
    ),
    Mutation(
        "xray-mu-water-not-passed", "lightning_modules/xray2ct/module.py",
        "ProjectionLoss(views, window, (-1.0, 1.0), mu_water)", "ProjectionLoss(views, window, (-1.0, 1.0))",
        ("tests/test_xray2ct_training.py::test_training_loss_gradient_holds_the_projection_term_of_a_hand_built_loss",),
        "the physics loss ignores model.mu_water",
    ),
    Mutation(
        "xray-view-axes-swapped", "medvol/volumes/projection.py",
        'VIEW_AXES = {"ap": 1, "lateral": 0}', 'VIEW_AXES = {"ap": 0, "lateral": 1}',
        ("tests/test_xray2ct_training.py::test_training_loss_gradient_holds_the_projection_term_of_a_hand_built_loss",),
        "the AP view integrates along x, the lateral one along y",
    ),
    Mutation(
        "xray-drr-rows-unflipped", "medvol/volumes/projection.py",
        "return radiograph.flip(-1).transpose(-1, -2)", "return radiograph.transpose(-1, -2)",
        ("tests/test_xray2ct_training.py::test_training_loss_gradient_holds_the_projection_term_of_a_hand_built_loss",),
        "radiograph rows run from the feet up, not from the head down",
    ),
    Mutation(
        "xray-spacing-row-norms", "medvol/volumes/projection.py",
        "affine[..., :3, :3].double().pow(2).sum(dim=-2)", "affine[..., :3, :3].double().pow(2).sum(dim=-1)",
        ("tests/test_xray2ct_training.py::test_training_loss_gradient_holds_the_projection_term_of_a_hand_built_loss",),
        "voxel sizes for the path integrals from the affine's rows (wrong on an oblique grid)",
    ),
    Mutation(
        "xray-handoff-without-the-output", "lightning_modules/xray2ct/module.py",
        "upsampled = F.interpolate(previous,", "upsampled = F.interpolate(torch.zeros_like(previous),",
        ("tests/test_xray2ct_training.py::test_stage_two_samples_from_stage_ones_output_upsampled_plus_its_conditioning_noise",),
        "stage k samples without stage k-1's output",
    ),
    Mutation(
        "xray-handoff-without-noise", "lightning_modules/xray2ct/module.py",
        "self.hparams.previous_sampling_noise * conditioning_noise", "0.0 * conditioning_noise",
        ("tests/test_xray2ct_training.py::test_stage_two_samples_from_stage_ones_output_upsampled_plus_its_conditioning_noise",),
        "no conditioning noise on the previous stage's output at sampling time",
    ),
    Mutation(
        "xray-training-previous-not-degraded", "lightning_modules/xray2ct/module.py",
        "base = self.degraded(x0)", "base = x0",
        ("tests/test_xray2ct_training.py::test_stage_two_trains_on_the_ground_truth_degraded_to_stage_ones_grid",),
        "stage k trains on the ground truth at its own resolution as the previous stage's output",
    ),
    # Issue 20: residual stages >= 2 (the base, the identity start, each stage's own prediction type).
    Mutation(
        "xray-residual-physics-without-the-base", "lightning_modules/xray2ct/module.py",
        "else base + x0_hat, views, affine)", "else x0_hat, views, affine)",
        ("tests/test_xray2ct_training.py::test_a_residual_stage_diffuses_the_ct_minus_the_degraded_ground_truth_and_adds_that_back",),
        "a residual stage's physics term projects the residual, not the base plus the residual",
    ),
    Mutation(
        "xray-residual-base-with-the-noise", "lightning_modules/xray2ct/module.py",
        "base = base if self.residual else None", 'base = volumes["previous"] if self.residual else None',
        ("tests/test_xray2ct_training.py::test_a_residual_stage_diffuses_the_ct_minus_the_degraded_ground_truth_and_adds_that_back",),
        "the residual is taken over the noise-augmented input, so the augmentation noise enters the target",
    ),
    Mutation(
        "xray-residual-sample-without-the-base", "lightning_modules/xray2ct/module.py",
        "previous = (upsampled + sampled if is_residual(settings) else sampled)", "previous = (sampled)",
        ("tests/test_xray2ct_training.py::test_an_untrained_residual_stage_is_its_identity_baseline_and_samples_stage_one_as_stage_one_predicts",),
        "a residual stage's sample is not added to the upsampled previous stage",
    ),
    Mutation(
        "xray-residual-output-not-zeroed", "lightning_modules/xray2ct/module.py",
        "            zero_output(network)\n", "            pass\n",
        ("tests/test_xray2ct_training.py::test_an_untrained_residual_stage_is_its_identity_baseline_and_samples_stage_one_as_stage_one_predicts",),
        "a residual stage keeps stage k-1's output layer, so it does not start as its identity baseline",
    ),
    Mutation(
        "xray-earlier-stages-with-this-prediction-type", "lightning_modules/xray2ct/module.py",
        "prediction_type = settings.get(\"prediction_type\", DIFFUSION_DEFAULTS[\"prediction_type\"])",
        "prediction_type = self.prediction_type",
        ("tests/test_xray2ct_training.py::test_an_untrained_residual_stage_is_its_identity_baseline_and_samples_stage_one_as_stage_one_predicts",),
        "earlier stages are sampled with this stage's prediction type instead of their own",
    ),
    Mutation(
        "xray-earlier-stage-schedule-unchecked", "lightning_modules/xray2ct/module.py",
        "differing = [key for key in SHARED_SAMPLING if ours[key] != theirs[key]]", "differing = []",
        ("tests/test_xray2ct_training.py::test_a_stage_whose_schedule_differs_from_an_earlier_stage_is_one_clear_line",),
        "a stage whose schedule or sampling set differs from an earlier stage's samples that stage with its own",
    ),
    Mutation(
        "xray-restore-reads-earlier-files", "lightning_modules/xray2ct/module.py",
        'return {"previous_settings": hyper_parameters["previous_settings"]}', "return {}",
        ("tests/test_xray2ct.py::test_a_moved_cascade_run_predicts_from_its_checkpoint_alone",),
        "predict builds a stage's earlier stages from the files its run read, not from its checkpoint",
    ),
    Mutation(
        "xray-restore-reads-init-from", "lightning_modules/xray2ct/module.py",
        "if init_from and not restoring:", "if init_from:",
        ("tests/test_xray2ct.py::test_a_moved_cascade_run_predicts_from_its_checkpoint_alone",),
        "a stage restored from its checkpoint still loads the weights it started training from",
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
