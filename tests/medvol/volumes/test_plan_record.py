"""plan.json's schema: every plan medvol makes passes it unchanged; a value of the wrong type or out of its range, or
a key it does not know, is one line naming the key."""

from __future__ import annotations

import json

import numpy as np
import pytest

from medvol.core.errors import MedvolError
from medvol.volumes.plan import DataFingerprint, make_plan
from medvol.volumes.plan_record import checked_plan, read_plan_file
from medvol.volumes.survival_plan import make_survival_plan


def _fingerprint(kind: str = "mr") -> DataFingerprint:
    channel = {"kind": kind, "mean": 40.0, "std": 200.0, "low": -900.0, "high": 1500.0}
    return DataFingerprint(np.asarray([[0.8, 0.8, 4.0]] * 3), np.asarray([[120, 110, 30]] * 3), np.full(3, 0.9),
                           [channel], {0: 1000, 1: 10, 2: 5})


@pytest.mark.parametrize("kind", ["mr", "ct"])
def test_every_plan_medvol_makes_passes_the_schema_as_it_is(kind, tmp_path):
    plans = [make_plan(_fingerprint(kind), 512, 16, kinds=[kind]),
             make_plan(_fingerprint(kind), 512, 16, {"augmentation": False}, [kind], {"WT": [1, 2], "TC": [2]}),
             make_survival_plan(_fingerprint(kind), [1, 0, 1], 100_000, kinds=[kind])]
    plans[1]["regions"], plans[1]["class_names"], plans[1]["channel_files"] = {"WT": [1, 2], "TC": [2]}, None, 4
    for plan in plans:
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(plan))
        assert read_plan_file(path) == json.loads(json.dumps(plan))


@pytest.mark.parametrize(("change", "key"), [
    (lambda p: p.update(features=[{"_target_": "torch.load"}]), "features.0"),
    (lambda p: p.update(patch_size=[64, 64, 10**6]), "patch_size.2"),
    (lambda p: p.update(spacing=[1.0, 1.0, -1.0]), "spacing.2"),
    (lambda p: p.update(batch_size=True), "batch_size"),
    (lambda p: p.update(evil=1), "evil"),
    (lambda p: p["normalization"][0].update(kind="pet"), "normalization.0.kind"),
])
def test_a_plan_outside_the_schema_is_one_line_naming_the_key(change, key):
    plan = make_plan(_fingerprint(), 512, 16)
    change(plan)
    with pytest.raises(MedvolError, match=rf"^plan\.json: `{key}` .*; expected a plan written by medvol"):
        checked_plan(plan, "plan.json")
