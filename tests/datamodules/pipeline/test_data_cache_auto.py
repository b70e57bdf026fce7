"""`dataset.cache=auto` and the disk cache: the budget picks memory, disk or none on the estimate; a disk cache is
reused only for the same transforms and files and never holds a half-written item; cached batches equal uncached
ones."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from monai.data import CacheDataset, ThreadDataLoader

from datamodules.pipeline import volume_datamodule
from datamodules.pipeline.cache_budget import MEMORY_OVERHEAD, parse_budget
from datamodules.pipeline.disk_cache import DiskCache, code_version
from datamodules.sources.brats import BratsDataModule
from datamodules.sources.csv_table import CsvDataModule
from datamodules.sources.example_data import write_brats, write_mace_csv, write_nifti_folder
from datamodules.sources.nifti import NiftiDataModule
from datamodules.sources.patches import PatchesDataModule
from datamodules.sources.synthetic import SyntheticDataModule
from datamodules.sources.xray_ct import XrayCtDataModule
from medvol.core.errors import MedvolError
from tests.datamodules.pipeline.test_data_cache import _datamodule
from tests.test_refusals import FAST, _cli, _one_error_line

GIB = 2**30
# One 12^3 float32 channel: the bulk of each item (the rest: affines, source grid, intensity bounds).
IMAGE_BYTES = 12**3 * 4


@pytest.fixture(scope="module")
def volumes(tmp_path_factory) -> Path:
    return write_nifti_folder(tmp_path_factory.mktemp("auto") / "ct", 10, 12, modalities=("ct",), label=False)


@pytest.fixture
def memory(monkeypatch):
    """Sets the memory the machine has available (the decision reads it; nothing is allocated)."""

    def set_available(available: int) -> None:
        monkeypatch.setattr(volume_datamodule, "available_memory", lambda: available)

    return set_available


def _all_items(datamodule: NiftiDataModule) -> list[dict]:
    return [dataset[i] for dataset in datamodule.datasets.values() for i in range(len(dataset))]  # type: ignore[arg-type]


def test_auto_takes_memory_disk_or_none_on_the_estimate_against_the_budget(volumes, tmp_path, memory, monkeypatch):
    memory(4 * GIB)
    roomy = _datamodule(volumes, cache="auto", cache_dir=str(tmp_path / "cache"))
    roomy.setup()
    plan = roomy.cache_plan
    assert plan is not None and plan.mode == "memory" and plan.subjects == 10
    assert isinstance(roomy.datasets["train"], CacheDataset)
    # 10 subjects of one 12^3 float32 channel, plus a few hundred bytes of affines and bounds each.
    assert 10 * IMAGE_BYTES <= plan.estimate <= 1.1 * 10 * IMAGE_BYTES
    assert plan.budget == GIB  # 25% of 4 GiB
    assert not (tmp_path / "cache").exists()

    # Just enough for the estimate with the allocator's overhead: memory; just under: disk.
    enough = _datamodule(volumes, cache="auto", cache_dir=str(tmp_path / "cache"),
                         cache_budget=f"{int(plan.estimate * MEMORY_OVERHEAD) + 1}B")
    enough.setup()
    assert enough.cache_mode == "memory"
    tight = _datamodule(volumes, cache="auto", cache_dir=str(tmp_path / "cache"), cache_budget=f"{plan.estimate}B")
    tight.setup()
    assert tight.cache_mode == "disk" and tight.cache_plan.estimate == plan.estimate
    items = _all_items(tight)
    assert len(list((tmp_path / "cache").glob("*/*/*.pt"))) == len(items) == 10

    # No folder for a disk cache, or no room on the disk: not cached, and the reason says so.
    nowhere = _datamodule(volumes, cache="auto", cache_dir=None, cache_budget="1KB")
    nowhere.setup()
    assert nowhere.cache_mode == "none" and "no `dataset.cache_dir`" in nowhere.cache_plan.reason
    monkeypatch.setattr(volume_datamodule, "free_disk", lambda folder: 0)
    full = _datamodule(volumes, cache="auto", cache_dir=str(tmp_path / "other"), cache_budget="1KB")
    full.setup()
    assert full.cache_mode == "none" and "free disk space" in full.cache_plan.reason
    assert full.summary_fields()["cache"]["mode"] == "none"


def test_the_budget_is_shared_by_the_ranks_of_a_node(volumes, memory, monkeypatch):
    memory(4 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    datamodule = _datamodule(volumes, cache="auto", cache_dir=None)
    monkeypatch.setattr(datamodule, "_world", lambda: (2, 1))
    datamodule.setup()
    # Rank 1 of 10 subjects, per split.
    assert datamodule.cache_plan.budget == GIB // 2 and datamodule.cache_plan.subjects == 4


def test_the_estimate_scales_one_item_by_the_voxels_of_each_subject(tmp_path, memory):
    memory(4 * GIB)
    root = tmp_path / "mixed"
    shapes = [(32, 32, 32), (80, 80, 80)] * 3
    for i, shape in enumerate(shapes):
        (root / f"sub-{i}").mkdir(parents=True)
        volume = np.random.default_rng(i).normal(size=shape).astype(np.float32)
        nib.save(nib.Nifti1Image(volume, np.eye(4)), str(root / f"sub-{i}" / "ct.nii.gz"))
    transforms = {"spatial_size": None, "spacing": [2.0, 2.0, 2.0], "intensity": "window"}
    datamodule = _datamodule(root, cache="auto", cache_dir=None, transforms=transforms, val_fraction=0.0,
                             test_fraction=0.0)
    datamodule.setup()
    actual = sum(item["image"].numel() * 4 for item in _all_items(datamodule))
    # Resampled to 2 mm: 16^3 and 40^3 voxels, i.e. 15.6x apart; one item alone would be off by up to 8x.
    assert actual == 3 * (16**3 + 40**3) * 4
    assert abs(datamodule.cache_plan.estimate - actual) < 0.05 * actual


@pytest.mark.parametrize(
    "budget", ["lots", 0, 1.5, -0.25, "0%", "150%", "12XB", "GiB", True, None],
)
def test_a_budget_that_is_neither_a_fraction_nor_a_size_is_refused(budget):
    with pytest.raises(MedvolError, match=r"`dataset.cache_budget` is .*; expected a fraction of the available memory"):
        parse_budget(budget)


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(0.25, 250), ("25%", 250), (1, 1000), ("2KiB", 2048), ("2KB", 2000), ("1.5 G", int(1.5 * GIB)),
     ("3mb", 3 * 10**6)],
)
def test_budgets_are_fractions_of_the_available_memory_or_sizes(budget, expected):
    assert parse_budget(budget).bytes(1000) == expected


def test_a_cache_folder_that_cannot_be_written_is_refused(volumes, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for mode in ("auto", "disk"):
        with pytest.raises(MedvolError, match=r"`dataset.cache_dir`: .*a-file/cache cannot be a folder"):
            _datamodule(volumes, cache=mode, cache_dir=str(blocker / "cache"))
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(MedvolError, match=r"`dataset.cache_dir`: .* is not writable"):
            _datamodule(volumes, cache="auto", cache_dir=str(locked / "cache"))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("dataset.cache_budget=lots", "`dataset.cache_budget` is 'lots'"),
        # The same path to the same one line; a Python start-up more, so with `make test-slow`.
        pytest.param("dataset.cache_dir=FILE/cache", "cannot be a folder", marks=pytest.mark.slow),
    ],
)
def test_bad_cache_settings_on_the_command_line_are_one_line(tmp_path, override, expected):
    (tmp_path / "FILE").write_text("")
    done = _cli([*FAST, override.replace("FILE", str(tmp_path / "FILE"))], tmp_path)
    _one_error_line(done, expected)


def test_a_disk_cache_is_reused_only_for_the_same_transforms_and_files(tmp_path):
    root = write_nifti_folder(tmp_path / "ct", 4, 12, modalities=("ct",), label=False)
    cache = str(tmp_path / "cache")
    changed = {"spatial_size": [12, 12, 12], "intensity": "window", "output_range": [0.0, 1.0]}

    def first_val_image(**kwargs) -> torch.Tensor:
        datamodule = _datamodule(root, val_fraction=0.25, test_fraction=0.25, **kwargs)
        datamodule.setup()
        return datamodule.datasets["val"][0]["image"]

    first_val_image(cache="disk", cache_dir=cache)
    (item_file,) = Path(cache).glob("*/val/*.pt")
    # Mark the cached item: whoever reads the cache from now on gets sevens.
    item = torch.load(item_file, weights_only=True)
    torch.save({**item, "image": torch.full_like(item["image"], 7.0)}, item_file)
    assert bool((first_val_image(cache="disk", cache_dir=cache) == 7).all()), "an unchanged run did not reuse the cache"

    # Other transform settings: their own items, equal to uncached ones.
    assert torch.equal(first_val_image(cache="disk", cache_dir=cache, transforms=changed),
                       first_val_image(transforms=changed))

    # A source file rewritten in place: the same settings no longer reuse the old items.
    subject = item["subject"]
    shutil.copyfile(root / "sub-000" / "ct.nii.gz" if subject != "sub-000" else root / "sub-001" / "ct.nii.gz",
                    root / subject / "ct.nii.gz")
    assert torch.equal(first_val_image(cache="disk", cache_dir=cache), first_val_image())
    folders = sorted(p.parent for p in Path(cache).glob("*/fingerprint.json"))
    assert len(folders) == 3
    record = json.loads((folders[0] / "fingerprint.json").read_text())
    assert {"settings", "files", "code", "monai"} <= set(record)


def test_a_cache_folder_whose_fingerprint_differs_is_refused_not_read(volumes, tmp_path):
    _datamodule(volumes, cache="disk", cache_dir=str(tmp_path / "cache")).setup()
    (record,) = (tmp_path / "cache").glob("*/fingerprint.json")
    record.write_text(json.dumps({**json.loads(record.read_text()), "settings": "edited by hand"}))
    with pytest.raises(MedvolError, match="holds items made from other settings"):
        _datamodule(volumes, cache="disk", cache_dir=str(tmp_path / "cache")).setup()


def test_the_code_fingerprint_changes_with_the_data_code_and_not_with_other_code(tmp_path):
    for name in ("datamodules/pipeline/transforms.py", "medvol/volumes/intensity.py", "lightning_modules/net.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("SCALE = 1\n")
    copies = [tmp_path / f"copy{k}" for k in range(4)]
    for copy in copies:
        shutil.copytree(tmp_path, copy, ignore=shutil.ignore_patterns("copy*"))
    (copies[1] / "datamodules/pipeline/transforms.py").write_text("SCALE = 2\n")
    (copies[2] / "medvol/volumes/intensity.py").write_text("SCALE = 2\n")
    (copies[3] / "lightning_modules/net.py").write_text("SCALE = 2\n")
    base, transforms, intensity, network = (code_version(copy)["code"] for copy in copies)
    assert transforms != base and intensity != base
    assert network == base


def test_a_full_disk_leaves_no_item_file_and_a_truncated_item_is_made_again(volumes, tmp_path, monkeypatch):
    expected = _datamodule(volumes)
    expected.setup()
    want = expected.datasets["val"][0]["image"]
    datamodule = _datamodule(volumes, cache="disk", cache_dir=str(tmp_path / "cache"))
    datamodule.setup()
    dataset = datamodule.datasets["val"]
    assert isinstance(dataset, DiskCache)
    save = torch.save

    def disk_fills_up(obj, target, *args, **kwargs):
        stream = open(target, "wb") if isinstance(target, (str, os.PathLike)) else target  # noqa: SIM115
        stream.write(b"PK\x03\x04 the first bytes of an item")
        stream.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_fills_up)
    assert torch.equal(dataset[0]["image"], want)  # served, uncached
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.name != "fingerprint.json"]

    monkeypatch.setattr(torch, "save", save)
    dataset[0]
    (item_file,) = (tmp_path / "cache").glob("*/val/*.pt")
    # A truncated file under the item's name (e.g. copied by hand) is never served: it is made again.
    item_file.write_bytes(item_file.read_bytes()[:200])
    assert torch.equal(dataset[0]["image"], want)
    assert torch.equal(torch.load(item_file, weights_only=True)["image"], want)


@pytest.mark.parametrize("mode", ["memory", "disk", "auto"])
def test_cached_training_batches_equal_uncached_ones_bitwise_with_the_random_transforms(volumes, tmp_path, mode,
                                                                                        memory):
    memory(4 * GIB)
    transforms = {"spatial_size": [12, 12, 12], "intensity": "percentile", "flip_prob": 0.5, "random_crop": [8, 8, 8]}
    drawn = {}
    for cache in ("none", mode):
        datamodule = _datamodule(volumes, cache=cache, cache_dir=str(tmp_path / "cache"), transforms=transforms,
                                 batch_size=2)
        datamodule.setup()
        loader = datamodule.train_dataloader()
        drawn[cache] = []
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            drawn[cache] += [(batch["subject"], batch["image"]) for batch in loader]
    assert len(drawn["none"]) == len(drawn[mode]) == 8  # 7 training subjects in batches of 2, two epochs
    for (subjects, image), (cached_subjects, cached_image) in zip(drawn["none"], drawn[mode], strict=True):
        assert subjects == cached_subjects and torch.equal(image, cached_image)

    # The random crops and flips ran: the subjects are drawn differently in the two epochs.
    def by_subject(batches: list) -> dict:
        return {subject: image[i] for subjects, image in batches for i, subject in enumerate(subjects)}

    first, second = by_subject(drawn["none"][:4]), by_subject(drawn["none"][4:])
    assert any(not torch.equal(first[s], second[s]) for s in first)


@pytest.mark.parametrize("kind", ["brats", "csv", "patches", "xray_ct"])
def test_every_file_dataset_reads_its_disk_items_back_instead_of_making_them_again(tmp_path, kind):
    common = {"num_workers": 0, "val_fraction": 0.2, "test_fraction": 0.2, "cache": "disk",
              "cache_dir": str(tmp_path / "cache")}
    cube = {"spatial_size": [16, 16, 16]}
    if kind == "brats":
        datamodule = BratsDataModule(root=str(write_brats(tmp_path / "b", 5, 2021, 16)),
                                     label_regions=["WT", "TC", "ET"],
                                     transforms=cube, **common)
    elif kind == "csv":
        table = write_mace_csv(tmp_path / "mace", 5, 16)
        datamodule = CsvDataModule(csv_path=str(table), covariate_columns=["age", "sex"], class_column="label",
                                   transforms=cube,
                                   **common)
    else:
        folder = str(write_nifti_folder(tmp_path / "ct", 5, 16, modalities=("ct",), label=False))
        if kind == "patches":
            datamodule = PatchesDataModule(root=folder, image_modalities=["ct"], patch_size=[8, 8, 8],
                                           patches_per_volume=2, **common)
        else:
            datamodule = XrayCtDataModule(root=folder, image_modalities=["ct"], xray_size=[8, 8], transforms=cube,
                                          **common)
    datamodule.setup()
    dataset = datamodule.datasets["val"]
    disk = dataset if isinstance(dataset, DiskCache) else dataset.data
    first = dataset[0]
    disk.transform = lambda record: pytest.fail(f"{kind}: a cached item was made again")
    again = dataset[0]
    for a, b in zip(first if isinstance(first, list) else [first], again if isinstance(again, list) else [again],
                    strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
        assert all(type(a[k]) is torch.Tensor for k in a if isinstance(a[k], torch.Tensor))  # plain, no MONAI metadata


def test_a_memory_cache_with_nothing_to_compute_per_draw_is_served_by_a_thread(volumes):
    cached = _datamodule(volumes, cache="memory", num_workers=2)
    plain = _datamodule(volumes, cache="none", num_workers=2)
    for datamodule in (cached, plain):
        datamodule.setup()
    loader = cached.train_dataloader()
    assert isinstance(loader, ThreadDataLoader) and loader.num_workers == 0
    assert cached.summary_fields()["cache"]["loader"] == "thread"
    assert not isinstance(plain.train_dataloader(), ThreadDataLoader)
    batches = [(b["subject"], b["image"]) for b in loader]
    assert len(batches) == 7
    for (subjects, image), reference in zip(batches, plain.train_dataloader(), strict=True):
        assert subjects == reference["subject"] and torch.equal(image, reference["image"])

    # Random flips after the cache: worker processes compute them; validation still reads through a thread.
    flips = _datamodule(volumes, cache="memory", num_workers=2,
                        transforms={"spatial_size": [12, 12, 12], "flip_prob": 0.5})
    flips.setup()
    loader = flips.train_dataloader()
    assert not isinstance(loader, ThreadDataLoader) and loader.num_workers == 2
    assert isinstance(flips.val_dataloader(), ThreadDataLoader)
    assert flips.summary_fields()["cache"]["loader"] == "2 worker processes"


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_cached_phantoms_equal_generated_ones(tmp_path, mode):
    datamodules = [
        SyntheticDataModule(num_subjects=6, size=16, image_modalities=["ct"], views=["ap"], xray_size=[8, 8],
                            cache=cache,
                            cache_dir=str(tmp_path / "cache"), val_fraction=0.2, test_fraction=0.2)
        for cache in ("none", mode)
    ]
    for datamodule in datamodules:
        datamodule.setup()
    plain, cached = (_all_items(d) for d in datamodules)
    for a, b in zip(plain, cached, strict=True):
        assert a.keys() == b.keys() and a["subject"] == b["subject"]
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    if mode == "memory":
        # The phantoms themselves are what the cache holds, not the records they are made from.
        assert all("image" in item for item in datamodules[1].datasets["train"]._cache)
    else:
        assert len(list((tmp_path / "cache").glob("*/*/*.pt"))) == 6


def _gloo_rank(rank: int, root: str, cache_dir: str, budget: str, init_file: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    datamodule = _datamodule(Path(root), cache="auto", cache_dir=cache_dir, cache_budget=budget)
    datamodule.setup()
    dataset = datamodule.datasets["train"]
    report = {
        "mode": datamodule.cache_mode, "held": [dataset[i]["subject"] for i in range(len(dataset))],
        "steps": len(datamodule.train_dataloader()), "train": datamodule.split["train"],
    }
    gathered: list = [None, None]
    dist.all_gather_object(gathered, report)
    if rank == 0:
        Path(result).write_text(json.dumps(gathered))
    dist.destroy_process_group()


@pytest.mark.parametrize(("budget", "mode"), [("1GiB", "memory"), ("1KB", "disk")])
def test_two_gloo_ranks_each_cache_their_own_share(volumes, tmp_path, budget, mode):
    result, cache = tmp_path / "result.json", tmp_path / "cache"
    mp.start_processes(
        _gloo_rank, args=(str(volumes), str(cache), budget, str(tmp_path / "init"), str(result)), nprocs=2,
        start_method="fork",
    )
    reports = json.loads(result.read_text())
    assert [r["mode"] for r in reports] == [mode, mode]
    held = reports[0]["held"] + reports[1]["held"]
    assert sorted(held) == sorted(reports[0]["train"]) and not set(reports[0]["held"]) & set(reports[1]["held"])
    assert reports[0]["steps"] == reports[1]["steps"] > 0
    if mode == "disk":
        # Each train item written once, by the rank that holds it.
        assert len(list(cache.glob("*/train/*.pt"))) == len(held)
