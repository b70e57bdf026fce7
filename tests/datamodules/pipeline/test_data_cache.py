"""Caching: partitioned per rank (every subject cached exactly once, equal steps), same items as uncached, smart
lifecycle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from monai.data import ThreadDataLoader

from datamodules.pipeline.cache import (
    PartitionSampler,
    SmartCacheLifecycle,
    find_smart_cache,
    partition,
    steps_share,
)
from datamodules.sources.example_data import write_nifti_folder
from datamodules.sources.nifti import NiftiDataModule
from medvol.core.errors import MedvolError
from medvol.run.training import run
from tests.conftest import ROOT
from tests.datamodules.sources.test_data_layouts import TINY_MODEL, data_cfg


def _datamodule(root: Path, **kwargs) -> NiftiDataModule:
    settings = {
        "root": str(root), "image_modalities": ["ct"],
        "transforms": {"spatial_size": [12, 12, 12], "intensity": "window"},
        "num_workers": 0, "val_fraction": 0.2, "test_fraction": 0.1, **kwargs,
    }
    return NiftiDataModule(**settings)


@pytest.fixture(scope="module")
def volumes(tmp_path_factory) -> Path:
    return write_nifti_folder(tmp_path_factory.mktemp("cache") / "ct", 11, 12, modalities=("ct",), label=False)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("total", [1, 7, 8, 13])
def test_partitions_cover_every_item_once_with_equal_steps(world, total):
    items = list(range(total))
    shares = [partition(items, world, rank) for rank in range(world)]
    assert sorted(i for share in shares for i in share) == items
    samplers = [PartitionSampler(share, steps_share(total, world, "memory", "train", 1.0), seed=3) for share in shares]
    assert len({len(s) for s in samplers}) == 1
    for epoch in range(3):
        for sampler in samplers:
            sampler.set_epoch(epoch)
            drawn = list(sampler)
            assert len(drawn) == len(sampler) and len(set(drawn)) == len(drawn)


def test_each_simulated_rank_caches_only_its_share(volumes, monkeypatch):
    seen: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    steps = set()
    for rank in range(2):
        datamodule = _datamodule(volumes, cache="memory")
        monkeypatch.setattr(datamodule, "_world", lambda rank=rank: (2, rank))
        datamodule.setup()
        for stage, members in seen.items():
            dataset = datamodule.datasets[stage]
            members += [dataset[i]["subject"] for i in range(len(dataset))]
        steps.add(len(datamodule.train_dataloader()))
    assert len(steps) == 1
    split = datamodule.split
    assert split is not None
    for stage, members in seen.items():
        assert sorted(members) == sorted(split[stage])


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_cached_items_equal_uncached_ones(volumes, tmp_path, mode):
    plain = _datamodule(volumes)
    cached = _datamodule(volumes, cache=mode, cache_dir=str(tmp_path / "cache"))
    for datamodule in (plain, cached):
        datamodule.setup()
    for stage in ("val", "test"):
        for i in range(len(plain.datasets[stage])):
            a, b = plain.datasets[stage][i], cached.datasets[stage][i]
            assert a["subject"] == b["subject"] and torch.equal(a["image"], b["image"]) and torch.equal(a["affine"],
                                                                                                        b["affine"])
    if mode == "disk":
        assert len(list((tmp_path / "cache").glob("*/val/*.pt"))) == len(plain.datasets["val"])


def test_smart_cache_replaces_items_between_epochs(volumes):
    datamodule = _datamodule(volumes, cache="smart", cache_rate=0.5, replace_rate=0.5, val_fraction=0.1,
                             test_fraction=0.0)
    datamodule.setup()
    smart = find_smart_cache(datamodule.datasets["train"])
    assert smart is not None and len(datamodule.datasets["train"]) == smart.cache_num == 5
    lifecycle = SmartCacheLifecycle(smart)
    lifecycle.on_train_epoch_start(None, None)
    first = {datamodule.datasets["train"][i]["subject"] for i in range(5)}
    lifecycle.on_train_epoch_end(None, None)
    second = {datamodule.datasets["train"][i]["subject"] for i in range(5)}
    lifecycle.teardown(None, None, "fit")
    assert first != second and len(first & second) >= 2


def test_smart_cache_refuses_persistent_workers(volumes):
    with pytest.raises(MedvolError,
                       match="`dataset.cache=smart` cannot be combined with `dataset.persistent_workers=true`"):
        _datamodule(volumes, cache="smart", num_workers=2, persistent_workers=True)
    with pytest.raises(MedvolError, match="`dataset.cache=disk` needs `dataset.cache_dir`"):
        _datamodule(volumes, cache="disk")


def _gloo_rank(rank: int, root: str, init_file: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    datamodule = _datamodule(Path(root), cache="memory")
    datamodule.setup()
    dataset = datamodule.datasets["train"]
    cached = [dataset[i]["subject"] for i in range(len(dataset))]
    report = {"cached": cached, "steps": len(datamodule.train_dataloader()), "split": datamodule.split}
    gathered: list = [None, None]
    dist.all_gather_object(gathered, report)
    if rank == 0:
        Path(result).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def test_two_gloo_ranks_cache_every_subject_exactly_once(volumes, tmp_path):
    result = tmp_path / "result.json"
    mp.start_processes(
        _gloo_rank, args=(str(volumes), str(tmp_path / "init"), str(result)), nprocs=2, start_method="fork"
    )
    reports = json.loads(result.read_text())
    cached = reports[0]["cached"] + reports[1]["cached"]
    assert sorted(cached) == sorted(reports[0]["split"]["train"]) and len(set(cached)) == len(cached)
    assert reports[0]["steps"] == reports[1]["steps"] > 0


def test_gpu_transforms_use_a_thread_loader_and_the_trainer_device(volumes):
    datamodule = _datamodule(volumes, cache="memory", gpu_transforms=True, num_workers=3,
                             transforms={"spatial_size": [12, 12, 12], "flip_prob": 0.5})
    datamodule.setup()
    loader = datamodule.train_dataloader()
    assert isinstance(loader, ThreadDataLoader) and loader.num_workers == 0
    batch = next(iter(loader))
    assert batch["image"].device == datamodule.device() and batch["image"].shape[1:] == (1, 12, 12, 12)


def test_smart_cache_lifecycle_runs_inside_training(volumes, tmp_path, monkeypatch):
    calls: list[str] = []
    for hook in ("on_train_epoch_start", "on_train_epoch_end", "teardown"):
        original = getattr(SmartCacheLifecycle, hook)

        def record(self, *args, _hook=hook, _original=original, **kwargs):
            calls.append(_hook)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(SmartCacheLifecycle, hook, record)
    run(data_cfg(
        tmp_path, "dataset=nifti", f"dataset.root={volumes}", "dataset.image_modalities=[ct]", "dataset.cache=smart",
        "dataset.cache_rate=0.5", "dataset.replace_rate=0.5", "trainer.fast_dev_run=false", "trainer.max_epochs=2",
        "trainer.limit_val_batches=1", "callbacks.model_checkpoint=null",
    ))
    assert calls == ["on_train_epoch_start", "on_train_epoch_end"] * 2 + ["teardown"]


@pytest.mark.slow  # train.py on two ranks, ~27 s; the partition itself is tested on two gloo ranks in the fast suite
def test_train_py_with_two_ddp_ranks_and_a_partitioned_cache(volumes, tmp_path):
    command = [
        sys.executable, str(ROOT / "train.py"), *TINY_MODEL, "strategy=ddp", "trainer.devices=2", "dataset=nifti",
        f"dataset.root={volumes}", "dataset.image_modalities=[ct]", "dataset.transforms.spatial_size=[16,16,16]",
        "dataset.num_workers=1", "dataset.cache=smart", "dataset.cache_rate=0.5", "dataset.batch_size=1",
        "dataset.val_fraction=0.2", "trainer.max_epochs=2", "logger=csv", f"paths.log_dir={tmp_path}",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(tmp_path.glob("vqgan/runs/*/checkpoints/last.ckpt"))


def test_disk_cache_gets_a_new_folder_when_the_transform_settings_change(volumes, tmp_path):
    cache_dir = str(tmp_path / "cache")
    first = _datamodule(volumes, cache="disk", cache_dir=cache_dir)
    changed = {"spatial_size": [12, 12, 12], "intensity": "window", "output_range": [0.0, 1.0]}
    second = _datamodule(volumes, cache="disk", cache_dir=cache_dir, transforms=changed)
    plain = _datamodule(volumes, transforms=changed)
    for datamodule in (first, second, plain):
        datamodule.setup()
    # The second settings read their own items, not the first settings' cached ones.
    assert torch.equal(second.datasets["val"][0]["image"], plain.datasets["val"][0]["image"])
    assert not torch.equal(second.datasets["val"][0]["image"], first.datasets["val"][0]["image"])
    assert len(list((tmp_path / "cache").glob("*/val"))) == 2


def test_each_loader_worker_draws_its_own_random_transforms(tmp_path):
    # Every subject holds the same volume, so only the random flips tell the draws apart.
    root = write_nifti_folder(tmp_path / "ct", 10, 12, modalities=("ct",), label=False)
    for folder in sorted(root.iterdir())[1:]:
        (folder / "ct.nii.gz").write_bytes((root / "sub-000" / "ct.nii.gz").read_bytes())
    transforms = {"spatial_size": [12, 12, 12], "intensity": "window", "flip_prob": 0.5}
    datamodule = _datamodule(root, transforms=transforms, num_workers=2, batch_size=1, val_fraction=0.1,
                             test_fraction=0.1)
    datamodule.setup()
    draws = [batch["image"][0] for batch in datamodule.train_dataloader()]
    assert len(draws) == 8
    # Workers take batches in turns (0, 1, 0, 1, ...); workers seeded alike would draw equal pairs.
    pairs = [torch.equal(draws[i], draws[i + 1]) for i in range(0, len(draws), 2)]
    assert not all(pairs), "both loader workers drew the same random flips"
