"""Survival and classification: the Cox loss, whole-set metrics against lifelines/torchsurv, and runs on CSV data."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torchsurv.loss.cox import neg_partial_log_likelihood
from torchsurv.metrics.cindex import ConcordanceIndex
from torchsurv.stats.ipcw import get_ipcw

from datamodules.sources.example_data import write_mace_csv
from lightning_modules.discriminative.cox_loss import cox_loss
from lightning_modules.discriminative.survival_metrics import SurvivalMetrics, survival_metrics
from medvol.core.errors import MedvolError
from medvol.run.training import run
from tests.conftest import compose_cfg

TINY_NET = ["model.backbone=resnet10", "model.widen_factor=0.125"]


def tied_censored_data(n: int = 41, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer times (many ties), about half censored, risks rounded to one decimal (tied risks too)."""
    rng = np.random.default_rng(seed)
    time = torch.tensor(rng.integers(1, 12, n), dtype=torch.float64)
    event = torch.tensor(rng.integers(0, 2, n), dtype=torch.float64)
    risk = torch.tensor(np.round(rng.normal(size=n) - 0.1 * time.numpy(), 1), dtype=torch.float64)
    return risk, time, event


@pytest.mark.parametrize(
    ("ties", "hand_sum"),
    # exp(risk) = 1, 2, 1, 3; times 1, 1, 2, 3; events 1, 1, 0, 1. At t=1 both events share the
    # risk set {all} (sum 7): Breslow log1+log2-2log7; Efron log1+log2-log7-log(7-(1+2)/2).
    # At t=3 the only subject left has the event: log3-log3 = 0.
    [("breslow", 2 * math.log(7) - math.log(2)), ("efron", math.log(7) + math.log(5.5) - math.log(2))],
)
def test_cox_loss_equals_hand_computed_ties_and_torchsurv(ties, hand_sum):
    log_risk = torch.log(torch.tensor([1.0, 2.0, 1.0, 3.0]))
    time, event = torch.tensor([1.0, 1.0, 2.0, 3.0]), torch.tensor([1.0, 1.0, 0.0, 1.0])
    # torchsurv's mean is over the distinct event times (2 here).
    assert float(cox_loss(log_risk, time, event, ties)) == pytest.approx(hand_sum / 2, abs=1e-6)
    risk, time, event = tied_censored_data(23, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = neg_partial_log_likelihood(risk.float(), event.bool(), time.float(), ties_method=ties)
    assert float(cox_loss(risk, time, event, ties)) == pytest.approx(float(reference), abs=1e-6)


def test_cox_loss_without_events_is_zero_with_zero_gradients_through_the_network():
    weight = torch.nn.Parameter(torch.ones(3))
    log_risk = torch.randn(5, 3) @ weight
    loss = cox_loss(log_risk, torch.arange(5.0), torch.zeros(5))
    loss.backward()
    assert float(loss) == 0.0 and weight.grad is not None and torch.equal(weight.grad, torch.zeros(3))


def test_cox_loss_of_a_single_subject_with_an_event_is_zero_as_its_own_risk_set_gives():
    # An epoch's last batch can hold one subject (83 training subjects, batch 2): torchsurv refuses it.
    weight = torch.nn.Parameter(torch.ones(3))
    loss = cox_loss(torch.randn(1, 3) @ weight, torch.tensor([4.0]), torch.ones(1))
    loss.backward()
    assert float(loss) == 0.0 and torch.equal(weight.grad, torch.zeros(3))
    # Two subjects: the partial likelihood of the earlier event over both, as torchsurv computes it.
    two = cox_loss(torch.tensor([0.3, -0.2]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0]))
    assert float(two) == pytest.approx(-(0.3 - math.log(math.exp(0.3) + math.exp(-0.2))), abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cindex_equals_lifelines_and_uno_equals_torchsurv_on_ties_and_censoring(seed):
    concordance_index = pytest.importorskip("lifelines.utils").concordance_index
    risk, time, event = tied_censored_data(seed=seed)
    metrics = survival_metrics(risk, time, event, horizons=[4.0, 8.0])
    # lifelines takes a predicted survival time: higher risk = shorter survival, so pass -risk.
    assert float(metrics["cindex"]) == pytest.approx(concordance_index(time, -risk, event), abs=1e-9)
    ipcw = get_ipcw(event.bool(), time).double()
    uno = ConcordanceIndex()(risk, event.bool(), time, weight=ipcw)
    assert float(metrics["uno_cindex"]) == pytest.approx(float(uno), abs=1e-9)
    assert float(metrics["uno_cindex"]) != pytest.approx(float(metrics["cindex"]), abs=1e-6)
    assert 0 < float(metrics["auc@4"]) < 1 and 0 < float(metrics["auc@8"]) < 1
    # Far beyond the last follow-up nobody is at risk: the AUC is left out, not invented.
    assert "auc@1000" not in survival_metrics(risk, time, event, horizons=[1000.0])


def test_metric_over_batches_is_the_whole_set_metric_not_a_batch_mean():
    risk, time, event = tied_censored_data(seed=4)
    metric = SurvivalMetrics(horizons=[6.0])
    for start in range(0, len(risk), 4):
        metric.update(risk[start:start + 4].float(), time[start:start + 4].float(), event[start:start + 4].float())
    whole = survival_metrics(risk, time, event, horizons=[6.0])
    computed = metric.compute()
    assert computed.keys() == whole.keys()
    for key, value in whole.items():
        assert float(computed[key]) == pytest.approx(float(value), abs=1e-6), key


def _rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _write_rows(path, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _csv_overrides(table, *extra):
    return [
        "model=survival", "dataset=csv", f"dataset.csv_path={table}", "dataset.transforms.spatial_size=[16,16,16]",
        "dataset.batch_size=2", "hardware=cpu", "callbacks.progress_bar=null", "callbacks.model_summary=null",
        "callbacks.volume_slices=null", "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0",
        "dataset.val_fraction=0.25", "dataset.test_fraction=0.25", *TINY_NET, *extra,
    ]


def test_covariate_statistics_come_from_the_training_split_and_survive_resume(tmp_path):
    table = write_mace_csv(tmp_path / "mace", 12, 16)
    run_dir = tmp_path / "run"
    run(compose_cfg(run_dir, _csv_overrides(table, "dataset.covariate_columns=[age,sex]", "test=true"), tiny=False))
    split = json.loads((run_dir / "split.json").read_text())
    train = [r for r in _rows(table) if r["subject"] in set(split["train"])]
    expected = torch.tensor([[float(r["age"]), float(r["sex"])] for r in train], dtype=torch.float64)
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert torch.allclose(state["net.covariates.mean"], expected.mean(0))
    assert torch.allclose(state["net.covariates.std"], expected.std(0, unbiased=False))
    everyone = torch.tensor([[float(r["age"]), float(r["sex"])] for r in _rows(table)], dtype=torch.float64)
    assert not torch.allclose(state["net.covariates.mean"], everyone.mean(0))

    # The risk table: every test subject once, with its outcome, its covariates, its survival at the horizons
    # (the validation set's baseline hazard) and split.
    risks = _rows(run_dir / "predictions" / "risks.csv")
    assert sorted(r["subject"] for r in risks) == sorted(split["test"])
    assert list(risks[0]) == ["subject", "risk", "time", "event", "age", "sex", "survival@12", "survival@24",
                              "survival@36", "split"]
    assert "test/cindex" in json.loads((run_dir / "summary.json").read_text())["metrics"] or all(
        r["event"] == "0" for r in risks
    )

    # New covariate values in the table: a resumed run keeps the statistics it trained with.
    rows = _rows(table)
    for row in rows:
        row["age"] = str(float(row["age"]) + 100)
    _write_rows(table, rows)
    run(compose_cfg(run_dir, _csv_overrides(
        table, "dataset.covariate_columns=[age,sex]", "trainer.max_epochs=2",
        f"ckpt_path={run_dir}/checkpoints/last.ckpt",
    ), tiny=False))
    resumed = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["epoch"] == 1
    assert torch.allclose(resumed["state_dict"]["net.covariates.mean"], expected.mean(0))


def test_classifier_trains_on_the_class_column_and_writes_probabilities(tmp_path):
    table = write_mace_csv(tmp_path / "mace", 12, 16)
    rows = _rows(table)
    for i, row in enumerate(rows):
        row["label"] = str(i % 2)
    _write_rows(table, rows)
    metrics = run(compose_cfg(tmp_path / "run", [
        *_csv_overrides(table, "test=true"), "model=classifier", "dataset.class_column=label",
        "model.class_weights=[1.0,2.0]",
    ], tiny=False))
    assert {"val/auroc", "val/accuracy", "val/balanced_accuracy", "test/auroc"} <= set(metrics)
    probabilities = _rows(tmp_path / "run" / "predictions" / "probabilities.csv")
    assert len(probabilities) == 3 and set(probabilities[0]) == {"subject", "class_label", "predicted", "p0", "p1",
                                                                 "split"}
    assert all(float(r["p0"]) + float(r["p1"]) == pytest.approx(1.0, abs=1e-5) for r in probabilities)


def test_a_validation_set_without_a_comparable_pair_checkpoints_the_latest_epoch_and_the_run_goes_on(tmp_path):
    # Every validation subject censored: no C-index exists there (it used to stop the run: ModelCheckpoint
    # "could not find the monitored key val/cindex").
    table = write_mace_csv(tmp_path / "mace", 12, 16)
    rows = _rows(table)
    subjects = [r["subject"] for r in rows]
    split = {"train": subjects[:6], "val": subjects[6:9], "test": subjects[9:]}
    for row in rows:
        row["event"] = "0" if row["subject"] in split["val"] else row["event"]
    assert any(r["event"] == "1" for r in rows if r["subject"] in split["train"])
    _write_rows(table, rows)
    (tmp_path / "split.json").write_text(json.dumps(split))
    run_dir = tmp_path / "run"
    metrics = run(compose_cfg(run_dir, _csv_overrides(
        table, f"dataset.split_file={tmp_path / 'split.json'}", "trainer.max_epochs=2", "test=true"
    ), tiny=False))
    assert math.isnan(metrics["val/cindex"]) and math.isnan(metrics["val/uno_cindex"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_by"] == "epoch"
    assert torch.load(summary["best_checkpoint"], weights_only=True)["epoch"] == 1
    assert sorted(r["subject"] for r in _rows(run_dir / "predictions" / "risks.csv")) == split["test"]


@pytest.mark.parametrize(
    ("edit", "extra", "message"),
    [
        ("no_events", [], "`dataset.event_column`: none of the"),
        ("one_class", ["model=classifier", "dataset.class_column=label"], "`dataset.class_column`: all"),
        ("nan_covariate", ["dataset.covariate_columns=[age,sex]"], "mace.csv:4: age='nan': expected a number"),
        ("negative_time", [], "mace.csv:4: time='-1': expected a number >= 0"),
        ("event_two", [], "mace.csv:4: event='2': expected 0 or 1"),
    ],
)
def test_bad_outcome_tables_stop_with_one_clear_line(tmp_path, edit, extra, message):
    table = write_mace_csv(tmp_path / "mace", 8, 16)
    rows = _rows(table)
    for row in rows:
        row["event"] = "0" if edit == "no_events" else row["event"]
        row["label"] = "1" if edit == "one_class" else row["label"]
    rows[2] |= {"nan_covariate": {"age": "nan"}, "negative_time": {"time": "-1"}, "event_two": {"event": "2"}}.get(edit,
                                                                                                                   {})
    _write_rows(table, rows)
    with pytest.raises(MedvolError) as error:
        run(compose_cfg(tmp_path / "run", [*_csv_overrides(table), *extra], tiny=False))
    assert message in str(error.value)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The trainable floating-point weights of a run's last checkpoint (batch-norm running statistics left out)."""
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    return {k: v.double() for k, v in state.items() if v.is_floating_point() and "running_" not in k}


@pytest.mark.slow
def test_two_gloo_ranks_train_and_evaluate_as_one_process(tmp_path):
    concordance_index = pytest.importorskip("lifelines.utils").concordance_index
    from tests.conftest import TINY_COMMON, TINY_MODEL
    from tests.ddp_support import explain, train_cli
    from tests.medvol.run.test_ddp_correctness import recorder

    # 15 subjects: 5 validation and 5 test subjects split 3 + 2 over the ranks, so a padding duplicate would show.
    common = [
        *TINY_COMMON, "model=survival", *TINY_MODEL["survival"], "dataset.num_subjects=15", "dataset.val_fraction=0.34",
        "dataset.test_fraction=0.34", "trainer.limit_train_batches=2", "test=true", "callbacks.volume_slices=null",
        "model.optimizer._target_=torch.optim.SGD", "~model.optimizer.weight_decay", "model.optimizer.lr=0.01",
        "model.horizons=[20]",
        # Every rank samples the whole split (no partitioned cache), so the 2-rank batches are the single process's.
        "dataset.cache=none",
    ]
    ddp = train_cli(
        [*common, "strategy=ddp", "trainer.devices=2", "trainer.sync_batchnorm=true", "dataset.batch_size=1",
         *recorder(tmp_path / "ranks"), f"hydra.run.dir={tmp_path / 'ddp'}"],
        cwd=tmp_path, tiny=False,
    )
    assert ddp.returncode == 0, explain(ddp)
    single_dir = tmp_path / "single"
    single_dir.mkdir()
    run(compose_cfg(single_dir, [*common, "dataset.batch_size=2", *recorder(single_dir / "ranks")], tiny=False))

    # The Cox risk set is the global batch (log-risks gathered with their gradients): the SGD steps of 2 ranks
    # equal one process's with the same global batch. Compared as updates from the initial weights, since
    # the synced batch norm sums in another order (float32 differences of up to ~0.2% of an update).
    initial_dir = tmp_path / "initial"
    initial_dir.mkdir()
    run(compose_cfg(initial_dir, [*common, "dataset.batch_size=2", "model.optimizer.lr=0.0"], tiny=False))
    initial = _weights(initial_dir)
    ddp_update = torch.cat([(w - initial[k]).flatten() for k, w in _weights(tmp_path / "ddp").items()])
    single_update = torch.cat([(w - initial[k]).flatten() for k, w in _weights(single_dir).items()])
    assert float(ddp_update.norm() / single_update.norm()) == pytest.approx(1.0, abs=0.02)
    assert float(torch.nn.functional.cosine_similarity(ddp_update, single_update, dim=0)) > 0.99
    ranks = [json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for stage in ("val", "test"):
        assert f"{stage}/cindex" in ranks[0][stage]
        assert ranks[0][stage] == ranks[1][stage], f"{stage} metrics differ between ranks"

    # The test metrics and risks of the 2-rank run's weights equal one process's on the same weights
    # (1 epoch: the tested best checkpoint is the last one).
    evaluated = tmp_path / "evaluated"
    evaluated.mkdir()
    run(compose_cfg(evaluated, [*common, "dataset.batch_size=2", "train=false",
                                f"ckpt_path={tmp_path / 'ddp' / 'checkpoints' / 'last.ckpt'}",
                                *recorder(evaluated / "ranks")], tiny=False))
    single = json.loads((evaluated / "ranks" / "rank0.json").read_text())
    for name, value in single["test"].items():
        assert ranks[0]["test"][name] == pytest.approx(value, abs=1e-6), name

    ddp_risks = _rows(tmp_path / "ddp" / "predictions" / "risks.csv")
    single_risks = _rows(evaluated / "predictions" / "risks.csv")
    split = json.loads((single_dir / "split.json").read_text())
    assert [r["subject"] for r in ddp_risks] == sorted(split["test"]) == [r["subject"] for r in single_risks]
    for a, b in zip(ddp_risks, single_risks, strict=True):
        assert float(a["risk"]) == pytest.approx(float(b["risk"]), rel=1e-4, abs=1e-5)
    risk, time, event = (np.array([float(r[k]) for r in ddp_risks]) for k in ("risk", "time", "event"))
    assert ranks[0]["test"]["test/cindex"] == pytest.approx(concordance_index(time, -risk, event), abs=1e-6)
