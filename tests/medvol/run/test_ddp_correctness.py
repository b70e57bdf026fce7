"""DDP on 2 CPU ranks (gloo) computes what one process computes, and behaves as one run.

Each scenario trains once on 2 ranks through `train.py` (medvol starts rank 1 itself) and
once in-process on one rank with twice the per-device batch; the data are the same, so the
weights after N optimizer steps, the batch-norm statistics and the validation metrics must
agree within float tolerance.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from medvol.run.training import run
from tests.conftest import TINY, compose_cfg
from tests.ddp_support import explain, train_cli

# 13 subjects: 7 train (odd: 4 + 3 without drop_last, so uneven ranks are exercised), 3 val, 3 test.
DATA = [
    "dataset.num_subjects=13",
    "dataset.val_fraction=0.25",
    "dataset.test_fraction=0.25",
    "trainer.limit_train_batches=3",
    "trainer.accumulate_grad_batches=2",
    "test=true",
    # Every rank samples the whole split (no partitioned cache), so the 2-rank global batches are the single process's.
    "dataset.cache=none",
]
VQGAN = [
    "model._target_=tests.ddp_support.PreinitialisedVQGAN",
    "model.random_restart=false",
    # Slice choice is random per rank; with the slice discriminator off the steps are deterministic.
    "model.image_gan_weight=0",
    "model.discriminator_iter_start=1",
    "model.optimizer._target_=torch.optim.SGD",
    "~model.optimizer.betas",
    "model.optimizer.lr=0.05",
]
REGRESSOR = [
    "~model",
    "+model={_target_:tests.ddp_support.TinyRegressor,lr:0.1}",
    "optimized_metric=val/loss",
    "optimized_mode=min",
    "callbacks.volume_slices=null",
]
# The tiny data and trainer settings without the VQ-GAN's model keys.
TINY_DATA = [item for item in TINY if not item.startswith("model.")]
DDP = ["strategy=ddp", "trainer.devices=2", "trainer.sync_batchnorm=true", "dataset.batch_size=1"]


def recorder(directory: Path) -> list[str]:
    return [
        "+callbacks.rank_recorder._target_=tests.ddp_support.RankRecorder",
        f"+callbacks.rank_recorder.directory={directory}",
    ]


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def assert_same_weights(ddp: dict[str, torch.Tensor], single: dict[str, torch.Tensor], skip: str | None = None) -> None:
    assert ddp.keys() == single.keys()
    differing = []
    for key in ddp:
        if skip and re.fullmatch(skip, key):
            continue
        same = (
            torch.allclose(ddp[key], single[key], rtol=1e-4, atol=1e-5)
            if ddp[key].is_floating_point()
            else torch.equal(ddp[key], single[key])
        )
        if not same:
            differing.append(f"{key} (max diff {(ddp[key].double() - single[key].double()).abs().max():.3g})")
    assert not differing, f"differ after DDP vs one process: {differing}"


@pytest.fixture(scope="module")
def vqgan_runs(tmp_path_factory):
    """One 2-rank DDP run and its single-process reference, shared by the checks below."""
    base = tmp_path_factory.mktemp("ddp_vqgan")
    saves = base / "saves.txt"
    ddp = train_cli(
        [*DATA, *VQGAN, *DDP, *recorder(base / "ranks"),
         "+strategy.checkpoint_io._target_=tests.ddp_support.RecordingCheckpointIO",
         f"+strategy.checkpoint_io.log_file={saves}", f"hydra.run.dir={base / 'ddp'}"],
        cwd=base,
    )
    assert ddp.returncode == 0, explain(ddp)
    single_dir = base / "single"
    single_dir.mkdir()
    metrics = run(compose_cfg(single_dir, [*DATA, *VQGAN, "dataset.batch_size=2", *recorder(single_dir / "ranks")]))
    return {"base": base, "ddp": ddp, "single_dir": single_dir, "single_metrics": metrics, "saves": saves}


@pytest.mark.slow
def test_vqgan_manual_optimization_matches_single_process(vqgan_runs):
    # Both optimizers stepped (discriminator from batch 1), accumulation 2 over 3 batches, synced batch norm.
    ddp = weights(vqgan_runs["base"] / "ddp" / "checkpoints" / "last.ckpt")
    single = weights(vqgan_runs["single_dir"] / "checkpoints" / "last.ckpt")
    # The slice discriminator sees random slices (its loss weight is 0, but its batch-norm statistics move).
    assert_same_weights(ddp, single, skip=r"image_discriminator\..*\.running_(mean|var)")
    means = [k for k in ddp if k.startswith("video_discriminator") and k.endswith("running_mean")]
    assert means, "expected batch-norm statistics in the discriminators"
    assert any(ddp[k].abs().sum() > 0 for k in means), "batch-norm statistics never updated"


@pytest.mark.slow
def test_validation_and_test_metrics_identical_on_ranks_and_single_process(vqgan_runs):
    ranks = [json.loads((vqgan_runs["base"] / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    single = json.loads((vqgan_runs["single_dir"] / "ranks" / "rank0.json").read_text())
    for stage, names in (("val", ("val/psnr", "val/ssim")), ("test", ("test/psnr", "test/ssim"))):
        for name in names:
            assert ranks[0][stage][name] == ranks[1][stage][name], f"{name} differs between ranks"
            # 3 subjects over 2 ranks (2 + 1, no padding duplicate) give the single-process mean.
            assert ranks[0][stage][name] == pytest.approx(single[stage][name], rel=1e-4), name


@pytest.mark.slow
def test_checkpoints_written_once_by_rank_zero_and_logs_printed_once(vqgan_runs):
    records = [line.split() for line in vqgan_runs["saves"].read_text().splitlines()]
    assert records and {r for r, _ in records} == {"0"}
    names = [name for _, name in records]
    files = sorted(p.name for p in (vqgan_runs["base"] / "ddp" / "checkpoints").iterdir())
    assert sorted(set(names)) == files
    assert len(names) == len(set(names)), f"a checkpoint was written twice: {names}"
    output = vqgan_runs["ddp"].stdout + vqgan_runs["ddp"].stderr
    assert output.count("medvol run summary (fit)") == 1
    assert output.count("1 per device x 2 devices x 2 accumulation = effective batch 4") == 1
    log = (vqgan_runs["base"] / "ddp" / "train.log").read_text()
    assert log.count("= effective batch 4") == 1


@pytest.mark.slow  # two gloo ranks, ~30 s
def test_automatic_optimization_with_accumulation_and_sync_batchnorm(tmp_path):
    result = train_cli([*TINY_DATA, *DATA, *REGRESSOR, *DDP, f"hydra.run.dir={tmp_path / 'ddp'}"], cwd=tmp_path,
                       tiny=False)
    assert result.returncode == 0, explain(result)
    single_dir = tmp_path / "single"
    single_dir.mkdir()
    run(compose_cfg(single_dir, [*TINY_DATA, *DATA, *REGRESSOR, "dataset.batch_size=2"], tiny=False))
    ddp = weights(tmp_path / "ddp" / "checkpoints" / "last.ckpt")
    single = weights(single_dir / "checkpoints" / "last.ckpt")
    assert_same_weights(ddp, single)
    fresh = torch.nn.BatchNorm3d(4).state_dict()
    assert not torch.allclose(ddp["norm.running_mean"], fresh["running_mean"])
