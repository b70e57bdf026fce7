"""What medvol writes into a checkpoint reads back with PyTorch's `weights_only` unpickler and no allowlist."""

from __future__ import annotations

import enum
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import OmegaConf

from medvol.core.plain_values import plain


class Mode(enum.Enum):
    FAST = "fast"


def test_config_nodes_partials_numpy_and_paths_become_values_weights_only_reads(tmp_path):
    optimizer = hydra.utils.instantiate({"_target_": "torch.optim.Adam", "_partial_": True, "lr": 3e-4,
                                         "betas": [0.5, 0.9]})
    record = {
        "sizes": OmegaConf.create([16, 16, 8]),
        "net": OmegaConf.create({"channels": [8, 16], "dropout": 0.1}),
        "optimizer": optimizer,
        "keys": np.arange(4, dtype=np.uint32),
        "spacing": np.float32(1.5),
        "count": np.int64(7),
        "root": Path("/data/brats"),
        "mode": Mode.FAST,
        "names": {"b", "a"},
        "pair": (1, "x"),
        "weights": torch.ones(2),
    }
    torch.save(plain(record), tmp_path / "record.pt")
    read = torch.load(tmp_path / "record.pt", weights_only=True)
    assert read["sizes"] == [16, 16, 8] and read["net"] == {"channels": [8, 16], "dropout": 0.1}
    assert read["optimizer"] == {"_target_": "torch.optim.adam.Adam", "_partial_": True, "lr": 3e-4,
                                 "betas": [0.5, 0.9]}
    assert read["keys"].tolist() == [0, 1, 2, 3]
    assert read["spacing"] == 1.5 and type(read["spacing"]) is float
    assert read["count"] == 7 and type(read["count"]) is int
    assert read["root"] == "/data/brats" and read["mode"] == "fast" and read["names"] == ["a", "b"]
    assert read["pair"] == (1, "x")
    torch.testing.assert_close(read["weights"], torch.ones(2))


def test_the_partial_written_builds_the_same_optimizer_again():
    optimizer = hydra.utils.instantiate({"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 2e-4,
                                         "weight_decay": 0.05})
    rebuilt = hydra.utils.instantiate(plain(optimizer))
    params = [torch.nn.Parameter(torch.zeros(1))]
    assert rebuilt(params).defaults == optimizer(params).defaults


def test_tensors_pass_as_they_are_without_a_copy():
    tensor = torch.randn(3)
    assert plain({"w": tensor})["w"] is tensor
