"""Checkpoints are read as data: a pickle that runs a command is refused by name before any of it runs."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from medvol.core.checkpoint_read import are_trusted, asked_for, checkpoints_trusted, load_checkpoint
from medvol.core.errors import MedvolError
from tests.payloads import crafted_checkpoint


def test_a_pickle_that_runs_a_command_is_refused_naming_the_file_and_the_call(tmp_path):
    marker = tmp_path / "ran"
    path = crafted_checkpoint(tmp_path / "evil.ckpt", marker)
    with pytest.raises(MedvolError) as err:
        load_checkpoint(path, "ckpt_path", "a medvol checkpoint")
    line = str(err.value)
    assert "\n" not in line
    assert str(path) in line and "`posix.system`" in line and "trust_checkpoints=true" in line
    assert not marker.exists()


def test_the_same_file_runs_its_command_when_trusted_so_the_refusal_above_is_what_stops_it(tmp_path):
    marker = tmp_path / "ran"
    path = crafted_checkpoint(tmp_path / "evil.ckpt", marker)
    with checkpoints_trusted(True):
        load_checkpoint(path, "ckpt_path", "a medvol checkpoint")
    assert marker.exists()
    assert not are_trusted()


def test_a_checkpoint_of_tensors_and_plain_values_reads_as_data_memory_mapped_or_not(tmp_path):
    saved = {"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "loops": {}, "epoch": 3,
             "hyper_parameters": {"lr": 1e-3, "sizes": [16, 16, 8], "name": "x", "off": None, "pair": (1, 2.5)}}
    torch.save(saved, tmp_path / "good.ckpt")
    for mmap in (False, True):
        read = load_checkpoint(tmp_path / "good.ckpt", "ckpt_path", "a checkpoint", mmap=mmap)
        assert read["hyper_parameters"] == saved["hyper_parameters"] and read["epoch"] == 3
        torch.testing.assert_close(read["state_dict"]["w"], saved["state_dict"]["w"])


def test_an_older_checkpoint_holding_config_nodes_is_refused_with_the_opt_in_and_reads_with_it(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {}, "loops": {}, "hyper_parameters": {"sizes": OmegaConf.create([4, 4])}}, path)
    with pytest.raises(MedvolError, match=r"asks to load `omegaconf\.listconfig\.ListConfig`.*trust_checkpoints=true"):
        load_checkpoint(path, "model.first_stage_ckpt", "a checkpoint")
    with checkpoints_trusted(True):
        assert list(load_checkpoint(path, "ckpt_path", "a checkpoint")["hyper_parameters"]["sizes"]) == [4, 4]


def test_a_damaged_file_is_unreadable_not_untrusted(tmp_path):
    path = tmp_path / "cut.ckpt"
    torch.save({"state_dict": {"w": torch.ones(64)}, "loops": {}}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(MedvolError, match=r"is not a readable checkpoint .*; expected a checkpoint") as err:
        load_checkpoint(path, "ckpt_path", "a checkpoint")
    assert "trust_checkpoints" not in str(err.value)


def test_what_a_refused_pickle_asked_for_is_read_from_torchs_message():
    assert asked_for(RuntimeError("Unsupported global: GLOBAL omegaconf.nodes.AnyNode was not an allowed")) == (
        "omegaconf.nodes.AnyNode"
    )
    assert asked_for(RuntimeError("Weights only load failed. Unsupported operand 149")) is None


def test_trust_is_a_boolean_from_the_command_line():
    with pytest.raises(MedvolError, match=r"`trust_checkpoints` is 'yes'; expected true or false"):
        with checkpoints_trusted("yes"):  # type: ignore[arg-type]
            pass
