"""Cox negative partial log-likelihood (torchsurv), defined for batches without events."""

from __future__ import annotations

import warnings

import torch
from torchsurv.loss.cox import neg_partial_log_likelihood

TIES = ("efron", "breslow")


def cox_loss(log_risk: torch.Tensor, time: torch.Tensor, event: torch.Tensor, ties: str = "efron") -> torch.Tensor:
    """Mean negative partial log-likelihood per event of a batch (torchsurv, Efron or Breslow ties).

    A batch without events has no partial likelihood. It then gives 0 through the network
    (every gradient exactly zero, the graph intact so DDP's gradient sync still runs), so the
    step changes nothing but momentum decay; callers count such batches. So does a batch of one
    subject (an epoch's last, short batch): its event's risk set is itself, log(e^r / e^r) = 0
    (torchsurv refuses a single subject).

    Args:
        log_risk: (N,) predicted log relative hazard.
        time: (N,) follow-up time.
        event: (N,) 1 event, 0 censored.
        ties: `efron` or `breslow`.
    """
    log_risk = log_risk.flatten().float()
    observed = event.flatten() > 0.5
    if not bool(observed.any()) or log_risk.numel() < 2:
        return log_risk.sum() * 0.0
    with warnings.catch_warnings():
        # torchsurv warns whenever times tie; ties are what `ties` is for.
        warnings.simplefilter("ignore")
        return neg_partial_log_likelihood(
            log_risk, observed, time.flatten().float(), ties_method=ties, reduction="mean"
        )
