"""The other documented DDP strategies on 2 CPU ranks: `ddp_spawn` and `ddp_find_unused` train what one process
trains."""

from __future__ import annotations

import pytest

from medvol.run.training import run
from tests.conftest import compose_cfg
from tests.ddp_support import explain, train_cli
from tests.medvol.run.test_ddp_correctness import DDP, TINY_DATA, assert_same_weights, weights

# cache=none: every rank samples the whole split, so the 2-rank global batches are the single process's.
DATA = [
    "dataset.num_subjects=13", "dataset.val_fraction=0.25", "dataset.test_fraction=0.25",
    "trainer.limit_train_batches=3",
    "dataset.cache=none",
]


def regressor(name: str) -> list[str]:
    return [
        "~model", f"+model={{_target_:tests.ddp_support.{name},lr:0.1}}",
        "optimized_metric=val/loss", "optimized_mode=min", "callbacks.volume_slices=null",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "model"),
    [
        ("ddp_spawn", "TinyRegressor"),
        # A layer outside the loss: plain `ddp` stops at the second step, `ddp_find_unused` trains.
        ("ddp_find_unused", "RegressorWithUnusedBranch"),
    ],
)
def test_strategy_on_two_ranks_matches_one_process(tmp_path, strategy, model):
    ddp_args = [*DDP[1:], f"strategy={strategy}"]
    result = train_cli(
        [*TINY_DATA, *DATA, *regressor(model), *ddp_args, f"hydra.run.dir={tmp_path / 'ddp'}"], cwd=tmp_path, tiny=False
    )
    assert result.returncode == 0, explain(result)
    single_dir = tmp_path / "single"
    single_dir.mkdir()
    run(compose_cfg(single_dir, [*TINY_DATA, *DATA, *regressor(model), "dataset.batch_size=2"], tiny=False))
    assert_same_weights(weights(tmp_path / "ddp" / "checkpoints" / "last.ckpt"),
                        weights(single_dir / "checkpoints" / "last.ckpt"))
