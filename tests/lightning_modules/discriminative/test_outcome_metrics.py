"""Classifier and survival metrics pinned to references that are not the code under test.

The classifier's AUROC, accuracy and balanced accuracy go through the module's own evaluation
steps (its network replaced by one that returns the batch's logits) and are compared with
scikit-learn on the same probabilities, in one process and gathered from 2 gloo ranks with
uneven shares. The time-dependent AUC is a case small enough to work out by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy.special import softmax

from lightning_modules.discriminative.classifier import ClassifierModel, set_auroc
from lightning_modules.discriminative.survival_metrics import SurvivalMetrics, survival_metrics

# The modules' steps run outside a Trainer here: their self.log calls have nowhere to go.
pytestmark = pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")


class LogitsNet(torch.nn.Module):
    """Stands in for the image network: each subject's `image` is its logit vector."""

    covariates = None

    def forward(self, image: torch.Tensor, covariates: torch.Tensor | None) -> torch.Tensor:
        return image.flatten(1)


def classification_set(num_classes: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Imbalanced labels (class 0 the largest) and logits that lean towards the label and towards class 0."""
    rng = np.random.default_rng(seed)
    shares = np.arange(num_classes, 0, -1, dtype=float)
    labels = rng.choice(num_classes, size=30, p=shares / shares.sum())
    labels[:num_classes] = np.arange(num_classes)  # every class present
    logits = rng.normal(size=(30, num_classes)) + 1.5 * np.eye(num_classes)[labels]
    logits[:, 0] += 1.0
    return logits, labels


def classifier(num_classes: int) -> ClassifierModel:
    module = ClassifierModel(num_classes=num_classes, backbone="resnet10", widen_factor=0.125)
    module.net = LogitsNet()
    return module.eval()


def epoch_metrics(module: ClassifierModel) -> dict[str, float]:
    """What the module logs at a validation epoch's end (AUROC over the classes present, the accuracies), without a
    Trainer."""
    auroc = set_auroc(module.val_auroc.compute(), module.val_counts.compute())
    return {"auroc": float(auroc),
            **{k.removeprefix("val/"): float(v) for k, v in module.val_metrics.compute().items()}}


def batches(logits: np.ndarray, labels: np.ndarray, first: int, size: int = 4):
    for start in range(0, len(labels), size):
        yield {
            "image": torch.tensor(logits[start:start + size], dtype=torch.float32),
            "class_label": torch.tensor(labels[start:start + size], dtype=torch.int64),
            "subject": [f"s{first + i:02d}" for i in range(start, min(start + size, len(labels)))],
        }


def sklearn_metrics(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    sklearn = pytest.importorskip("sklearn.metrics")
    probabilities = softmax(logits.astype(np.float64), axis=1)
    # Binary: scikit-learn's AUROC takes the positive class's probability; torchmetrics' macro one-vs-rest
    # of two classes averages two identical AUROCs.
    scores = probabilities[:, 1] if probabilities.shape[1] == 2 else probabilities
    return {
        "auroc": sklearn.roc_auc_score(labels, scores, multi_class="ovr", average="macro"),
        "accuracy": sklearn.accuracy_score(labels, probabilities.argmax(1)),
        "balanced_accuracy": sklearn.balanced_accuracy_score(labels, probabilities.argmax(1)),
    }


@pytest.mark.parametrize("num_classes", [2, 3])
def test_classifier_auroc_and_accuracies_equal_scikit_learn_on_the_same_probabilities(num_classes):
    logits, labels = classification_set(num_classes)
    module = classifier(num_classes)
    with torch.no_grad():
        for batch in batches(logits, labels, 0):
            module.validation_step(batch, 0)
    computed = epoch_metrics(module)
    expected = sklearn_metrics(logits, labels)
    assert computed == pytest.approx(expected, abs=1e-6)
    # The imbalance makes plain and balanced accuracy differ, so neither can stand in for the other.
    assert abs(expected["accuracy"] - expected["balanced_accuracy"]) > 0.02


def test_classifier_test_rows_hold_the_softmax_and_its_argmax():
    logits, labels = classification_set(3, seed=2)
    module = classifier(3)
    module.on_test_epoch_start()
    with torch.no_grad():
        for batch in batches(logits, labels, 0):
            module.test_step(batch, 0)
    rows = module._rows
    probabilities = softmax(logits.astype(np.float64), axis=1)
    assert [r["subject"] for r in rows] == [f"s{i:02d}" for i in range(30)]
    assert [r["class_label"] for r in rows] == labels.tolist()
    assert [r["predicted"] for r in rows] == probabilities.argmax(1).tolist()
    table = np.array([[r[f"p{c}"] for c in range(3)] for r in rows])
    assert np.allclose(table, probabilities, atol=1e-6)


# The ranks are spawned, not forked: a child forked from a pytest process whose earlier tests started
# OpenMP threads can hang in its first parallel torch operation (it did, building the network, under
# make test). Spawning two interpreters takes tens of seconds on a loaded machine: these tests are slow.


def _classifier_rank(rank: int, init_file: str, result: str, num_classes: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    logits, labels = classification_set(num_classes)
    # Uneven shares (17 and 13 subjects), each fed in batches of 4 as a rank's loader would.
    share = slice(0, 17) if rank == 0 else slice(17, 30)
    module = classifier(num_classes)
    with torch.no_grad():
        for batch in batches(logits[share], labels[share], share.start):
            module.validation_step(batch, 0)
    computed = epoch_metrics(module)
    gathered: list = [None, None]
    dist.all_gather_object(gathered, computed)
    if rank == 0:
        Path(result).write_text(json.dumps(gathered))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("num_classes", [2, 3])
def test_classifier_metrics_gathered_from_two_gloo_ranks_equal_scikit_learn_on_the_whole_set(tmp_path, num_classes):
    result = tmp_path / "result.json"
    mp.start_processes(
        _classifier_rank, args=(str(tmp_path / "init"), str(result), num_classes), nprocs=2, start_method="spawn"
    )
    expected = sklearn_metrics(*classification_set(num_classes))
    for rank, computed in enumerate(json.loads(result.read_text())):
        assert computed == pytest.approx(expected, abs=1e-6), f"rank {rank}"


# Six subjects; subject 2 is censored before both horizons, so it is neither a case nor a control.
HAND_TIME = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
HAND_EVENT = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
HAND_RISK = [0.5, 3.0, 2.0, 1.0, 0.0, 1.0]


def test_time_dependent_auc_equals_the_hand_worked_ipcw_estimate():
    # torchsurv's cumulative/dynamic AUC with inverse-probability-of-censoring weights (Uno 2007):
    #   AUC(t) = sum_i sum_j d_i w_i 1(T_i <= t) 1(T_j > t) c(r_i, r_j) / (sum_i d_i w_i 1(T_i <= t) * #{j: T_j > t})
    # with c = 1 for r_i > r_j, 1/2 for a tie, 0 otherwise, and w_i = 1 / G(T_i), G the Kaplan-Meier
    # estimate of the censoring distribution P(C > t), evaluated at T_i itself (censorings at T_i counted).
    # G: 1 until t=2; at t=2 one of the 5 subjects still followed is censored, G = 4/5; the next censoring
    # is at t=5 (1 of 2), G = 2/5. So w(1) = 1, w(3) = w(4) = 5/4.
    #
    # t = 2.5: cases {1 (risk 0.5, w 1)}; controls {3, 4, 5, 6} (risks 2, 1, 0, 1).
    #   subject 1 outranks only subject 5: AUC = 1 * 1 / (1 * 4) = 1/4.
    # t = 4.5: cases {1 (0.5, w 1), 3 (2, w 5/4), 4 (1, w 5/4)}; controls {5, 6} (risks 0, 1).
    #   case 1: beats 5, loses to 6 -> 1;  case 3: beats both -> 2;  case 4: beats 5, ties 6 -> 1.5
    #   AUC = (1 * 1 + 5/4 * 2 + 5/4 * 1.5) / ((1 + 5/4 + 5/4) * 2) = 5.375 / 7
    # Unweighted it would be (1 + 2 + 1.5) / 6 = 0.75; on -risk, 1.625 / 7.
    concordance_index = pytest.importorskip("lifelines.utils").concordance_index
    risk, time, event = (torch.tensor(v, dtype=torch.float64) for v in (HAND_RISK, HAND_TIME, HAND_EVENT))
    metrics = survival_metrics(risk, time, event, horizons=[2.5, 4.5])
    assert float(metrics["auc@2.5"]) == pytest.approx(1 / 4, abs=1e-9)
    assert float(metrics["auc@4.5"]) == pytest.approx(5.375 / 7, abs=1e-9)
    # Harrell's C of the same case, against lifelines (which takes a predicted survival time: -risk).
    assert float(metrics["cindex"]) == pytest.approx(concordance_index(time, -risk, event), abs=1e-9)


def _survival_rank(rank: int, init_file: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    risk, time, event = survival_set()
    share = slice(0, 11) if rank == 0 else slice(11, None)
    metric = SurvivalMetrics(horizons=[4.0, 8.0])
    for start in range(share.start, share.stop or len(risk), 3):
        stop = min(start + 3, share.stop or len(risk))
        metric.update(risk[start:stop].float(), time[start:stop].float(), event[start:stop].float())
    computed = {k: float(v) for k, v in metric.compute().items()}
    gathered: list = [None, None]
    dist.all_gather_object(gathered, computed)
    if rank == 0:
        Path(result).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def survival_set() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """19 subjects: integer times (ties), about half censored, risks that fall with time plus noise."""
    rng = np.random.default_rng(5)
    time = torch.tensor(rng.integers(1, 12, 19), dtype=torch.float64)
    event = torch.tensor(rng.integers(0, 2, 19), dtype=torch.float64)
    risk = torch.tensor(rng.normal(size=19) - 0.2 * time.numpy(), dtype=torch.float64)
    return risk, time, event


@pytest.mark.slow
def test_survival_metrics_gathered_from_two_gloo_ranks_are_the_whole_sets(tmp_path):
    concordance_index = pytest.importorskip("lifelines.utils").concordance_index
    result = tmp_path / "result.json"
    mp.start_processes(_survival_rank, args=(str(tmp_path / "init"), str(result)), nprocs=2, start_method="spawn")
    risk, time, event = survival_set()
    whole = {k: float(v) for k, v in survival_metrics(risk, time, event, horizons=[4.0, 8.0]).items()}
    assert {"cindex", "uno_cindex", "auc@4", "auc@8"} <= set(whole)
    for rank, computed in enumerate(json.loads(result.read_text())):
        assert computed == pytest.approx(whole, abs=1e-6), f"rank {rank}"
        assert computed["cindex"] == pytest.approx(concordance_index(time, -risk, event), abs=1e-9)
