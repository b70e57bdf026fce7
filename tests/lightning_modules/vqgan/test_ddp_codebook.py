"""Every DDP rank holds the same VQ-GAN codebook: initialisation from data and dead-code restarts come from rank 0."""

from __future__ import annotations

import pytest
import torch

from tests.ddp_support import explain, train_cli


@pytest.mark.slow  # two gloo ranks and restarts, ~27 s
def test_both_ranks_hold_the_same_codebook_after_data_initialisation_and_restarts(tmp_path):
    records = tmp_path / "codebooks"
    result = train_cli(
        [
            "strategy=ddp", "trainer.devices=2", "dataset.batch_size=1", "dataset.num_subjects=10",
            "trainer.limit_train_batches=3", "trainer.limit_val_batches=0",
            # The real codebook: initialised from each rank's own encoder outputs unless broadcast;
            # every code below one use restarts on every step, so restarts happen until the end.
            "model.random_restart=true", "model.restart_threshold=1.0", "model.n_codes=32",
            "+callbacks.codebook._target_=tests.ddp_support.CodebookRecorder",
            f"+callbacks.codebook.directory={records}", f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, explain(result)
    rank0, rank1 = (torch.load(records / f"codebook_rank{r}.pt") for r in (0, 1))
    assert bool(rank0["initialized"]) and bool(rank1["initialized"])
    # Restarts did happen (some codes below the threshold were replaced at the last update).
    assert (rank0["cluster_size"] < 1.0).any()
    for key in ("embeddings", "embedding_sum", "cluster_size"):
        assert torch.equal(rank0[key], rank1[key]), f"codebook `{key}` differs between the ranks"
