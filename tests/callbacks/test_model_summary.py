"""`BlockSummary`: one row per top-level block, with columns for frozen parameters and buffers only when needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from callbacks.model_summary import BlockSummary, _count, block_rows


class Blocks(nn.Module):
    def __init__(self, freeze: bool = False, norm: bool = True) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, 4)
        self.activation = nn.ReLU()
        self.norm = nn.BatchNorm1d(4) if norm else nn.Identity()
        self.head = nn.Sequential(nn.Linear(4, 300), nn.Linear(300, 5))
        self.head.requires_grad_(not freeze)


def test_each_block_holding_something_is_one_row_with_hand_counted_sizes():
    assert block_rows(Blocks(freeze=True)) == [
        ("encoder", "Linear", 3 * 4 + 4, 3 * 4 + 4, 0),
        # Weight and bias; running mean, running variance and the batch counter.
        ("norm", "BatchNorm1d", 4 + 4, 4 + 4, 4 + 4 + 1),
        ("head", "Sequential", 4 * 300 + 300 + 300 * 5 + 5, 0, 0),
    ]


def printed_table(capsys, module: nn.Module) -> str:
    BlockSummary().on_fit_start(SimpleNamespace(is_global_zero=True), module)
    return capsys.readouterr().out


def test_a_frozen_block_and_buffers_add_their_columns_and_totals(capsys):
    table = printed_table(capsys, Blocks(freeze=True))
    assert "Blocks: parameters per block" in table
    header = next(line for line in table.splitlines() if "block" in line and "type" in line)
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == [
        "block", "type", "parameters", "trainable", "buffers"]
    # 3,005 in the head plus 16 and 8: 3.0 K parameters, 24 trainable, 9 buffer values.
    total = next(line for line in table.splitlines() if "total" in line)
    assert [cell.strip() for cell in total.split("│")[1:-1]] == ["total", "", "3.0 K", "24", "9"]


def test_without_frozen_parameters_or_buffers_only_the_parameter_column_is_shown(capsys):
    table = printed_table(capsys, Blocks(norm=False))
    header = next(line for line in table.splitlines() if "block" in line and "type" in line)
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == ["block", "type", "parameters"]


def test_other_ranks_print_nothing(capsys):
    BlockSummary().on_fit_start(SimpleNamespace(is_global_zero=False), Blocks())
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(("count", "shown"),
                         [(999, "999"), (1_000, "1.0 K"), (2_345_678, "2.3 M"), (7_100_000_000, "7.1 G")])
def test_counts_are_shown_with_one_decimal_and_a_unit(count, shown):
    assert _count(count) == shown
