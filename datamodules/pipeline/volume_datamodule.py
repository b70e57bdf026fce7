"""The LightningDataModule that every medvol dataset builds on: split, samplers and loaders."""

from __future__ import annotations

import logging
import os
import time
from abc import abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from monai.data import CacheDataset, ThreadDataLoader
from monai.data import DistributedSampler as EvaluationSampler
from monai.transforms import Compose, ToDeviced
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from datamodules.pipeline.cache import (
    PartitionSampler,
    SmartCacheLifecycle,
    cached_dataset,
    default_workers,
    find_smart_cache,
    partition,
    steps_share,
    validate_cache,
)
from datamodules.pipeline.cache_budget import (
    DISK_SHARE,
    CachePlan,
    available_memory,
    free_disk,
    item_bytes,
    parse_budget,
    plan_cache,
)
from datamodules.pipeline.disk_cache import fingerprint_folder, open_fingerprint_folder
from datamodules.pipeline.draws import DrawDataset, SeededDraws
from datamodules.pipeline.oversampling import OversamplingSampler
from datamodules.pipeline.split import fold_split, load_folds, load_split, make_folds, make_split, save_split
from medvol.core.errors import MedvolError

log = logging.getLogger("medvol")

Record = dict[str, Any]
# The tensors of a batch dict that `gpu_transforms` moves to the device before the random transforms.
DEVICE_KEYS = ("image", "cond", "label", "xray", "affine")
# Training subjects whose intensities the fingerprint reads (evenly spread over the split): a median
# that is stable without loading every volume of a large dataset at the start of training.
FINGERPRINT_INTENSITY_SUBJECTS = 16


def fingerprint_sample(records: list[Record], count: int = FINGERPRINT_INTENSITY_SUBJECTS) -> list[Record]:
    """Up to `count` records evenly spread over `records` (all of them when there are fewer)."""
    if len(records) <= count:
        return list(records)
    return [records[round(i * (len(records) - 1) / (count - 1))] for i in range(count)]


class VolumeDataModule(pl.LightningDataModule):
    """Subjects -> split -> datasets -> loaders, the same for every dataset.

    Subclasses list their subjects as records (`{"subject": id, ...}`) and turn a list of
    records into a Dataset whose items are batch dicts (`image`, `label`, `cond`, `time`,
    `event`, `subject`, `affine`, ...).

    Training uses a seeded `DistributedSampler` with `drop_last`, so every rank takes the
    same number of steps and the data order depends only on the seed and the epoch (which is
    what makes a resumed run identical to an uninterrupted one); each item's random transforms are
    seeded from the seed, the epoch, the rank and its place in the epoch (`datamodules/pipeline/draws.py`),
    whatever the loader workers. Validation and testing
    partition the subjects without padding, so no subject is counted twice in a metric.

    With any `cache` but none, each rank builds its datasets over its own share of the
    subjects only (see `datamodules/pipeline/cache.py`), so the cache is not copied per rank; a
    `PartitionSampler` then gives every rank the same number of samples per epoch. `auto` picks
    memory, disk or none for this rank's share once, when the first dataset is built.

    Args:
        batch_size: per-device training batch size.
        val_batch_size: per-device evaluation batch size (defaults to `batch_size`).
        num_workers: DataLoader worker processes per device; null: from the CPU count and devices.
        pin_memory: pin host memory for faster copies to the GPU.
        persistent_workers: keep workers alive between epochs.
        val_fraction: share of subjects held out for validation.
        test_fraction: share of subjects held out for testing.
        split_seed: seed of the subject split.
        stratify_by: a record key (e.g. `class_label`) whose values keep their share in every split; null: none.
        split_file: where the split is recorded; an existing file is reused, never rewritten.
        fold: cross-validation: the subjects outside the test split are cut into `num_folds` folds (recorded in
            the split file) and this run validates on fold `fold` and trains on the others (`val_fraction` is
            then unused); null: the train/val split.
        num_folds: folds of a cross-validation run.
        max_subjects: use only the first N subjects (quick runs).
        shuffle_seed: seed of the training order.
        cache: auto (memory within `cache_budget`, else disk, else none), none, memory (CacheDataset), smart
            (SmartCacheDataset) or disk (items saved under `cache_dir`).
        cache_rate: share of the subjects held in a memory/smart cache.
        replace_rate: share of a smart cache replaced after every epoch.
        cache_dir: folder of the disk cache (one fingerprinted subfolder per transform settings and file list).
        cache_budget: memory an `auto` cache may take on this node: a fraction of the available memory
            (0.25, "25%") or a size ("8GiB"); each rank of the node gets an equal share.
        gpu_transforms: move each item to the training device right after the cached transforms and run
            the random ones there, loading with a thread loader (MONAI's fast-training recipe).
        iterations_per_epoch: training batches per epoch drawn with replacement, the last `oversample_foreground`
            share of each forced onto the foreground (nnU-Net's epoch; a segmentation plan sets it); null: one
            pass over the training subjects.
        oversample_foreground: with `iterations_per_epoch`, the share of each batch forced onto the foreground.
    """

    def __init__(
        self,
        batch_size: int = 1,
        val_batch_size: int | None = None,
        num_workers: int | None = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        split_seed: int = 0,
        split_file: str | None = None,
        fold: int | None = None,
        num_folds: int = 5,
        stratify_by: str | None = None,
        max_subjects: int | None = None,
        shuffle_seed: int | None = 0,
        cache: str = "none",
        cache_rate: float = 1.0,
        replace_rate: float = 0.1,
        cache_dir: str | None = None,
        cache_budget: float | str = 0.25,
        gpu_transforms: bool = False,
        iterations_per_epoch: int | None = None,
        oversample_foreground: float = 0.33,
    ) -> None:
        super().__init__()
        if iterations_per_epoch is not None and int(iterations_per_epoch) < 1:
            raise MedvolError(
                f"`dataset.iterations_per_epoch` is {iterations_per_epoch}; expected a positive number of batches or "
                "null (one pass over the training subjects)"
            )
        if not 0.0 <= oversample_foreground <= 1.0:
            raise MedvolError(f"`dataset.oversample_foreground` must be in [0, 1], got {oversample_foreground}")
        self.iterations_per_epoch = int(iterations_per_epoch) if iterations_per_epoch is not None else None
        self.oversample_foreground = float(oversample_foreground)
        if batch_size < 1:
            raise MedvolError(f"`dataset.batch_size` must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        validate_cache(cache, cache_rate, replace_rate, cache_dir)
        if cache == "smart" and persistent_workers and num_workers != 0:
            raise MedvolError(
                "`dataset.cache=smart` cannot be combined with `dataset.persistent_workers=true`: persistent worker "
                "processes keep the first epoch's cache and never see the replaced items; set persistent_workers=false"
            )
        self.cache = cache
        self.cache_rate = cache_rate
        self.replace_rate = replace_rate
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.cache_budget = parse_budget(cache_budget)
        self.cache_plan: CachePlan | None = None
        self.cache_fill_seconds = 0.0
        # A model's deterministic step run after the dataset's own and cached with them (a latent model's encoder),
        # and what it is made from (the disk cache's fingerprint includes it): `add_cached_transform`.
        self.model_transform: tuple[Any, dict[str, Any]] | None = None
        self._rank_records: list[Record] = []
        self.gpu_transforms = gpu_transforms
        self.collate_fn: Any = None
        self.worker_init_fn: Any = None
        self._split_sizes: dict[str, int] = {}
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.split_file = Path(split_file) if split_file else None
        self.fold, self.num_folds = fold, num_folds
        self.folds: list[list[str]] | None = None
        self.stratify_by = stratify_by
        self.max_subjects = max_subjects
        self.shuffle_seed = shuffle_seed or 0
        self.split: dict[str, list[str]] | None = None
        self.datasets: dict[str, Dataset] = {}

    @abstractmethod
    def subjects(self) -> list[Record]:
        """Every subject of the dataset, one record each, with a unique `subject` id."""

    @abstractmethod
    def build_dataset(self, records: list[Record], stage: str) -> Dataset:
        """A dataset over `records` for `stage` (train, val, test)."""

    def preflight(self) -> None:
        """Cheap checks of the data that run before the Trainer is built; file-based datasets override it."""

    def fingerprint(self) -> dict[str, Any]:
        """What the model sees of the training subjects, recorded in its checkpoints for `predict.py`.

        As nnU-Net's dataset fingerprint: `spacing` (mm per axis of the model grid), `orientation`
        (axis codes, or None for the stored axes) and `intensity` (`low`/`high`: per `image` channel,
        the raw values mapped onto the ends of `range`, typical of the training targets). Called after
        `setup`. A dataset without a voxel geometry records nothing, and predict.py keeps each input's
        own spacing.
        """
        return {}

    def training_records(self) -> list[Record]:
        """The records of the training split (after `setup`); in a cross-validation run, of every fold, so the
        folds share one plan and one fingerprint (nnU-Net plans once per dataset) and their predictions average
        on one grid."""
        if self.split is None:
            raise RuntimeError("training_records() needs the split: call setup() first")
        by_id = {str(r["subject"]): r for r in self.subjects()}
        members = sorted(s for fold in self.folds for s in fold) if self.folds is not None else self.split["train"]
        return [by_id[s] for s in members]

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is not None:
            return trainer.world_size, trainer.global_rank
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    @property
    def partitioned(self) -> bool:
        """Whether each rank holds datasets over its own share of the subjects only."""
        return self.cache != "none"

    @property
    def cache_mode(self) -> str:
        """The cache in use: `dataset.cache`, or what `auto` chose (none before the first dataset is built)."""
        if self.cache != "auto":
            return self.cache
        return self.cache_plan.mode if self.cache_plan is not None else "none"

    def item_voxels(self, record: Record) -> int:
        """Voxels of `record`'s cached item relative to the others' (the `auto` estimate); all equal by default."""
        return 1

    def _ranks_per_node(self) -> int:
        if self.trainer is not None:
            return max(1, int(self.trainer.num_devices))
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def _plan(self, records: list[Record], deterministic: list[Any], folder: Path | None) -> CachePlan:
        """What `auto` caches: one item is made to measure, the others are scaled by their voxel counts."""
        share = self._rank_records or records
        sample = item_bytes(Compose(list(deterministic))(records[0]))
        estimate = int(sample * sum(self.item_voxels(r) for r in share) / self.item_voxels(records[0]))
        ranks = self._ranks_per_node()
        available = available_memory()
        budget = self.cache_budget.bytes(available) // ranks
        budget_text = self.cache_budget.describe(available) + (f", shared by {ranks} ranks" if ranks > 1 else "")
        disk_room = None
        if folder is not None:
            kept = sum(f.stat().st_size for f in folder.rglob("*.pt")) if folder.is_dir() else 0
            disk_room = int(DISK_SHARE * free_disk(folder) / ranks) + kept
        return plan_cache(len(share), estimate, budget, budget_text, folder, disk_room)

    def summary_fields(self) -> dict[str, Any]:
        """The cache's choice, its fill time and how training batches are loaded, for `summary.json`."""
        fields = self.cache_plan.summary() if self.cache_plan else {"requested": self.cache, "mode": self.cache_mode}
        fields["fill_seconds"] = round(self.cache_fill_seconds, 2)
        if "train" in self.datasets:
            threaded, workers = self._loading(self.datasets["train"])
            fields["loader"] = "thread" if threaded else f"{workers} worker processes" if workers else "main process"
        return {"cache": fields}

    def workers(self) -> int:
        """Loader workers per device: the configured count, or a default from the CPUs and devices."""
        if self.num_workers is not None:
            return int(self.num_workers)
        devices = self.trainer.num_devices if self.trainer is not None else 1
        return default_workers(devices)

    def device(self) -> torch.device:
        """Where `gpu_transforms` sends items: the Trainer's device; outside a Trainer the current GPU, else the CPU.

        A CUDA device always carries its index (`cuda:0`, never `cuda`), so it compares equal to a tensor's device.
        """
        if self.trainer is not None:
            device = torch.device(self.trainer.strategy.root_device)
        else:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def device_transforms(self) -> list[Any]:
        """With `gpu_transforms`, the step that moves an item's volumes to `device()` (empty otherwise).

        Datasets run it right after the deterministic (cached) transforms, so the random ones run on the device.
        """
        if not self.gpu_transforms:
            return []
        return [ToDeviced(list(DEVICE_KEYS), device=self.device(), allow_missing_keys=True)]

    def cached_dataset(
        self, records: list[Record], deterministic: list[Any], random: list[Any], stage: str,
        fingerprint: Mapping[str, Any] | None = None,
    ) -> Dataset:
        """A dataset over `records` with `dataset.cache` applied to the deterministic transforms.

        Args:
            records: this rank's records for `stage`.
            deterministic: cacheable transforms.
            random: per-draw transforms (empty outside training).
            stage: train, val or test.
            fingerprint: what the cached items are made from (transform settings, source files); a disk
                cache made from anything else is never reused.
        """
        post = [*self.device_transforms(), *random]
        if self.model_transform is not None and not random:
            transform, made_from = self.model_transform
            deterministic = [*deterministic, transform]
            fingerprint = {**(fingerprint or {}), "model_transform": made_from}
        folder, record = None, {}
        if self.cache_dir is not None and self.cache in ("auto", "disk"):
            folder, record = fingerprint_folder(self.cache_dir, fingerprint or {})
        if self.cache == "auto" and self.cache_plan is None and records:
            self.cache_plan = self._plan(records, deterministic, folder)
            if self._is_global_zero():
                (log.warning if self.cache_plan.mode == "none" else log.info)("%s", self.cache_plan.describe())
        mode = self.cache_mode
        if mode == "disk":
            assert folder is not None
            open_fingerprint_folder(folder, record)
        _, rank = self._world()
        start = time.perf_counter()
        dataset = cached_dataset(
            records, deterministic, post, mode, stage, 1.0 if self.cache == "auto" else self.cache_rate,
            self.replace_rate, folder / stage if folder else None, workers=max(1, self.workers()),
            seed=self.shuffle_seed + rank,
        )
        self.cache_fill_seconds += time.perf_counter() - start
        smart = find_smart_cache(dataset)
        if smart is not None and self.trainer is not None:
            self.trainer.callbacks.append(SmartCacheLifecycle(smart))
        return dataset

    def add_cached_transform(self, transform: Any, fingerprint: Mapping[str, Any]) -> None:
        """Run `transform` (item -> item, deterministic) after the dataset's deterministic transforms, inside the
        cache, for every dataset built from now on whose items get no random transform (a random one must run
        before it: those datasets leave the step to the model). `fingerprint` says what it is made from."""
        self.model_transform = (transform, dict(fingerprint))

    def _is_global_zero(self) -> bool:
        if self.trainer is not None:
            return self.trainer.is_global_zero
        return int(os.environ.get("RANK", "0")) == 0

    def assign_split(self) -> list[Record]:
        """Read or make (and record) the split without building datasets; return the subjects in use."""
        records = self.subjects()
        if self.max_subjects:
            records = records[: self.max_subjects]
        if not records:
            raise MedvolError("the dataset has no subjects; check `dataset.root` and the file pattern")
        if self.split is not None:
            return records
        ids = [str(r["subject"]) for r in records]
        if self.split_file is not None and self.split_file.is_file():
            self.split = load_split(self.split_file, ids)
            self.folds = load_folds(self.split_file, self.fold)
        else:
            strata = self._strata(records)
            # Survival subjects: whether each one's event was seen, so a split of too few events is warned about.
            events = [r.get("event") == 1 for r in records] if all("event" in r for r in records) else None
            self.split = make_split(ids, self.val_fraction, self.test_fraction, self.split_seed, strata, events)
            if self.fold is not None:
                pool = [i for i in ids if i not in set(self.split["test"])]
                kinds = dict(zip(ids, strata, strict=True)) if strata is not None else None
                pool_strata = [kinds[i] for i in pool] if kinds is not None else None
                self.folds = make_folds(pool, self.num_folds, self.split_seed, pool_strata)
                self.split = fold_split(self.split, self.folds, self.fold)
            if self.split_file is not None and self._is_global_zero():
                save_split(self.split_file, self.split, self.split_seed, self.folds, self.fold)
        return records

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        records = self.assign_split()
        assert self.split is not None
        by_id = {str(r["subject"]): r for r in records}
        world, rank = self._world()
        shares = {}
        for name, members in self.split.items():
            self._split_sizes[name] = len(members)
            shares[name] = partition(sorted(members), world, rank) if self.partitioned else members
        self._rank_records = [by_id[s] for members in shares.values() for s in members]
        for name, members in shares.items():
            self.datasets[name] = self.build_dataset([by_id[s] for s in members], name)

    def _strata(self, records: list[Record]) -> list[Any] | None:
        if self.stratify_by is None:
            return None
        missing = [str(r["subject"]) for r in records if self.stratify_by not in r]
        if missing:
            raise MedvolError(
                f"`dataset.stratify_by`: the subjects have no {self.stratify_by!r} (first: {missing[0]}); "
                "name a value every subject has (e.g. class_label with `dataset.class_column`) or null"
            )
        return [r[self.stratify_by] for r in records]

    def _loading(self, dataset: Dataset) -> tuple[bool, int]:
        """Whether `dataset` is loaded by a background thread, and by how many worker processes otherwise.

        Items served from an in-memory cache with nothing left to compute per draw go through MONAI's
        `ThreadDataLoader`: a thread collates the next batch while the step runs, where worker processes
        would only copy every batch through shared memory (measured: docs/benchmarks/data.md). So do items
        moved to the GPU by `gpu_transforms` (CUDA cannot be used from forked workers).
        """
        if self.gpu_transforms or isinstance(dataset, CacheDataset):
            return True, 0
        return False, self.workers()

    def _loader(self, dataset: Dataset, batch_size: int, sampler: Any) -> DataLoader:
        threaded, workers = self._loading(dataset)
        if self.cache_mode == "smart" and workers > 0 and torch.multiprocessing.get_start_method() != "fork":
            raise MedvolError(
                f"`dataset.cache=smart` with `dataset.num_workers`={workers} needs forked worker processes, but this "
                f"platform starts them with {torch.multiprocessing.get_start_method()!r} (each worker would get a "
                "stale copy of the cache); set dataset.num_workers=0 or use dataset.cache=memory"
            )
        loader_class = ThreadDataLoader if threaded else DataLoader
        return loader_class(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=workers,
            pin_memory=self.pin_memory and not self.gpu_transforms,
            persistent_workers=self.persistent_workers and workers > 0,
            collate_fn=self.collate_fn,
            worker_init_fn=self.worker_init_fn if workers > 0 else None,
            # An own generator keeps loader creation from consuming the global RNG (exact resume).
            generator=torch.Generator().manual_seed(self.shuffle_seed),
        )

    def train_dataloader(self) -> DataLoader:
        dataset = self.datasets["train"]
        world, rank = self._world()
        total = self._split_sizes.get("train", len(dataset))
        if total < world * self.batch_size:
            raise MedvolError(
                f"the training split has {total} subjects, fewer than one batch per device "
                f"({world} devices x batch_size {self.batch_size}); add data or lower `dataset.batch_size`"
            )
        sampler: DistributedSampler
        if self.iterations_per_epoch is not None:
            sampler = OversamplingSampler(
                dataset, self.batch_size, self.iterations_per_epoch, self.oversample_foreground, self.shuffle_seed, rank
            )
        elif self.partitioned:
            share = steps_share(total, world, self.cache_mode, "train", self.cache_rate)
            if share < self.batch_size:
                raise MedvolError(
                    f"each rank caches {share} training subjects, fewer than `dataset.batch_size`={self.batch_size}; "
                    "raise `dataset.cache_rate` or lower the batch size"
                )
            sampler = PartitionSampler(dataset, share, seed=self.shuffle_seed)
        else:
            sampler = DistributedSampler(
                dataset, num_replicas=world, rank=rank, shuffle=True, seed=self.shuffle_seed, drop_last=True
            )
        if isinstance(dataset, DrawDataset):
            # Each item's augmentation from where it stands in the run: a resumed epoch draws what it drew.
            sampler = SeededDraws(dataset, sampler, self.shuffle_seed, rank)
        sampler.set_epoch(self._epoch())
        return self._loader(dataset, self.batch_size, sampler)

    def _epoch(self) -> int:
        """The epoch the Trainer trains next: the one it gives the sampler (`set_epoch`) when the epoch starts.

        Resumed, Lightning makes the first epoch's loader iterator before it sets the sampler's epoch, and loader
        workers take their first draws from the sampler as the iterator is made: without the epoch set here they
        would be epoch 0's.
        """
        loop = getattr(self.trainer, "fit_loop", None) if self.trainer is not None else None
        return 0 if loop is None else int(loop.epoch_progress.current.processed)

    def _evaluation_loader(self, stage: str) -> DataLoader:
        dataset = self.datasets[stage]
        total = self._split_sizes.get(stage, len(dataset))
        if total == 0:
            raise MedvolError(f"the {stage} split is empty; raise `dataset.{stage}_fraction` or add subjects")
        world, rank = self._world()
        if total < world:
            # A rank without a batch would skip the metric sync of the others, and DDP would hang.
            raise MedvolError(
                f"the {stage} split has {total} subjects, fewer than the {world} devices; "
                f"raise `dataset.{stage}_fraction` or add subjects"
            )
        if self.partitioned:
            # The dataset already is this rank's share: take all of it, once.
            world, rank = 1, 0
        sampler = EvaluationSampler(dataset, even_divisible=False, num_replicas=world, rank=rank, shuffle=False)
        return self._loader(dataset, self.val_batch_size, sampler)

    def val_dataloader(self) -> DataLoader:
        return self._evaluation_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._evaluation_loader("test")
