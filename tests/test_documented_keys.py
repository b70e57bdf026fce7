"""Every key of an entry point's root config is a row of its guide's key table (issue 63 item 9): a key added to
conf/predict.yaml or conf/export.yaml without a line in docs/predict.md or docs/export.md fails here."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.doc_commands import ROOT

GUIDES = {"conf/predict.yaml": "docs/predict.md", "conf/export.yaml": "docs/export.md"}
# What the root config holds that is not a key a user sets: Hydra's own and the group list.
NOT_KEYS = {"defaults", "hydra"}
# A table row's first cell: one key or several, each in backticks (`overlap`, `mode`).
FIRST_CELL = re.compile(r"^\|\s*((?:`[\w.]+`(?:,\s*)?)+)\s*\|", re.MULTILINE)


def documented_keys(guide: str) -> set[str]:
    text = (ROOT / guide).read_text()
    return {key for cell in FIRST_CELL.findall(text) for key in re.findall(r"`([\w.]+)`", cell)}


@pytest.mark.parametrize(("config", "guide"), sorted(GUIDES.items()))
def test_every_key_of_the_root_config_is_a_row_of_its_guides_table(config, guide):
    keys = set(yaml.safe_load((ROOT / config).read_text())) - NOT_KEYS
    missing = sorted(keys - documented_keys(guide))
    assert not missing, f"{guide}'s key table lacks {missing} (keys of {config})"
