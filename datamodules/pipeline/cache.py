"""Caching of the deterministic transforms (`dataset.cache: auto | none | memory | smart | disk`), partitioned per rank.

Under DDP a cache holds only this rank's share of the subjects, so the whole job keeps about
one copy of the data instead of one per rank (and each disk item is written by one rank). The
partition is fixed (a strided slice of the sorted subject list), the order within it
reshuffles every epoch, and every rank draws the same number of samples per epoch.
`auto` chooses memory, disk or none per rank (`datamodules/pipeline/cache_budget.py`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytorch_lightning as pl
import torch
from monai.data import CacheDataset, SmartCacheDataset
from monai.data import Dataset as TransformDataset
from monai.transforms import Compose
from torch.utils.data import Dataset, DistributedSampler

from datamodules.pipeline.cache_budget import check_cache_folder
from datamodules.pipeline.disk_cache import DiskCache
from datamodules.pipeline.draws import DrawDataset
from medvol.core.errors import MedvolError

CACHE_MODES = ("auto", "none", "memory", "smart", "disk")
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # the ceiling of glibc's adaptive threshold on 64-bit systems

T = TypeVar("T")


def partition(items: Sequence[T], world_size: int, rank: int) -> list[T]:
    """This rank's share: every `world_size`-th item from `rank`; the shares are disjoint and cover all items."""
    return list(items[rank::world_size])


def smallest_share(total: int, world_size: int) -> int:
    """The size of the smallest rank share of `total` items."""
    return total // world_size


def smart_cache_size(items: int, cache_rate: float) -> int:
    """How many items a SmartCacheDataset over `items` holds (MONAI's rule)."""
    return min(items, int(items * cache_rate))


def validate_cache(mode: str, cache_rate: float, replace_rate: float, cache_dir: str | None) -> None:
    if mode not in CACHE_MODES:
        raise MedvolError(f"`dataset.cache` is {mode!r}; expected one of {list(CACHE_MODES)}")
    if not 0.0 < cache_rate <= 1.0:
        raise MedvolError(f"`dataset.cache_rate` must be in (0, 1], got {cache_rate}")
    if not 0.0 < replace_rate <= 1.0:
        raise MedvolError(f"`dataset.replace_rate` must be in (0, 1], got {replace_rate}")
    if mode == "disk" and not cache_dir:
        raise MedvolError("`dataset.cache=disk` needs `dataset.cache_dir`, a folder for the cached volumes")
    if mode in ("auto", "disk") and cache_dir:
        check_cache_folder(Path(cache_dir))


@contextmanager
def compact_cache_fill() -> Iterator[None]:
    """While filling an in-memory cache, serve allocations >= 1 MiB from mmap; afterwards, trim the heap.

    Loading a volume makes large short-lived buffers (decompression, casts, percentiles)
    between the long-lived cached tensors. With glibc's adaptive threshold those buffers land
    in the heap and the cached tensors pin it: measured 2.5x the cached bytes in RSS
    (docs/benchmarks/data.md). A low threshold only during the fill keeps the cache compact; the
    threshold then goes to glibc's usual ceiling, since mmap-ing every batch-sized buffer
    during training halved the cached throughput. No-op where the C library is not glibc.
    """
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    glibc = libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")
    if glibc:
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
        libc.malloc_trim(0)
    try:
        yield
    finally:
        if glibc:
            libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX)
            libc.malloc_trim(0)


def cached_dataset(
    records: list[dict[str, Any]],
    deterministic: Sequence[Callable],
    random: Sequence[Callable],
    mode: str,
    stage: str,
    cache_rate: float = 1.0,
    replace_rate: float = 0.1,
    cache_dir: Path | None = None,
    workers: int = 0,
    seed: int = 0,
) -> Dataset:
    """`records` through the deterministic transforms (cached as `mode` says), then the random ones per draw.

    Smart caching applies to training only; evaluation sets use a memory cache, since a
    rotating subset would make validation metrics jump between epochs.

    Args:
        records: subject records (file paths and values).
        deterministic: transforms whose output is cached.
        random: transforms run on every draw (augmentation, device transfer).
        mode: none, memory, smart or disk.
        stage: train, val or test.
        cache_rate: share of the records to cache.
        replace_rate: share of a smart cache replaced each epoch.
        cache_dir: folder of the disk cache's items for this stage.
        workers: threads that fill the cache.
        seed: seed of the random transforms for items drawn by index; a training sampler's `Draw`s seed each item
            themselves (`datamodules.pipeline.draws`).
    """
    head = Compose(list(deterministic))
    tail = Compose(list(random)).set_random_state(seed=seed)
    # Uncached, the same two steps run on every draw, so cached and uncached items draw the same random numbers.
    if mode == "none":
        base: Dataset = TransformDataset(records, head)
    elif mode == "disk":
        assert cache_dir is not None
        base = DiskCache(records, head, Path(cache_dir))
    else:
        with compact_cache_fill():
            base = _in_memory(records, head, mode, stage, cache_rate, replace_rate, workers)
    # The random part runs on the cached item without copying it: every transform after the
    # cache returns new tensors (the cached ones are plain tensors, never modified in place).
    return DrawDataset(base, tail) if random else base


def _in_memory(
    records: list[dict[str, Any]], head: Compose, mode: str, stage: str, cache_rate: float, replace_rate: float,
    workers: int,
) -> Dataset:
    if mode == "smart" and stage == "train":
        if smart_cache_size(len(records), cache_rate) < 1:
            raise MedvolError(
                f"`dataset.cache_rate`={cache_rate} caches no subject of this rank's {len(records)}; raise it"
            )
        return SmartCacheDataset(
            records, head, replace_rate=replace_rate, cache_rate=cache_rate, num_init_workers=max(1, workers),
            num_replace_workers=max(1, workers), progress=False, shuffle=False, copy_cache=False,
        )
    return CacheDataset(
        records, head, cache_rate=cache_rate, num_workers=max(1, workers), progress=False, copy_cache=False
    )


class PartitionSampler(DistributedSampler):
    """Shuffles this rank's own partition each epoch and draws `num_samples` of it.

    A `DistributedSampler` (over a partition that already is this rank's) so Lightning does
    not wrap it again. `num_samples` is the same on every rank, which keeps their step
    counts equal; with shares of unequal size, the larger ones leave a different subject out
    each epoch.

    Args:
        dataset: this rank's dataset.
        num_samples: draws per epoch (at most `len(dataset)`).
        seed: shuffle seed; with the epoch it fixes the order.
    """

    def __init__(self, dataset: Dataset, num_samples: int, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
        self.num_samples = min(num_samples, len(dataset))  # type: ignore[arg-type]
        self.total_size = self.num_samples

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        return iter(order[: self.num_samples])

    def __len__(self) -> int:
        return self.num_samples


class SmartCacheLifecycle(pl.Callback):
    """Starts a SmartCacheDataset's replacement thread, swaps in new items after each epoch, stops it at the end.

    The datamodule adds it to the Trainer itself when `dataset.cache=smart`.

    Args:
        dataset: the training SmartCacheDataset.
    """

    def __init__(self, dataset: SmartCacheDataset) -> None:
        self.dataset = dataset

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.dataset.is_started():
            self.dataset.start()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.dataset.update_cache()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.dataset.shutdown()


def find_smart_cache(dataset: Dataset) -> SmartCacheDataset | None:
    """The SmartCacheDataset inside `dataset` (it may sit under the random-transform wrapper)."""
    while dataset is not None:
        if isinstance(dataset, SmartCacheDataset):
            return dataset
        dataset = getattr(dataset, "data", None)
    return None


def default_workers(devices: int, cpus: int | None = None) -> int:
    """Loader workers per device: the CPUs each device can have, minus one for its training process, at most 8."""
    cpus = cpus or _available_cpus()
    return max(0, min(8, cpus // max(1, devices) - 1))


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def steps_share(total: int, world_size: int, mode: str, stage: str, cache_rate: float) -> int:
    """Samples per epoch every rank draws from its partition (the smallest share, or its smart-cache window)."""
    share = smallest_share(total, world_size)
    if mode == "smart" and stage == "train":
        share = smart_cache_size(share, cache_rate)
    return max(0, share)

