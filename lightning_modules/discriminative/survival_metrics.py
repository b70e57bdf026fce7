"""Survival metrics over a whole evaluation set: Harrell's and Uno's C-index and time-dependent AUC (torchsurv).

`SurvivalMetrics` keeps every subject's risk, time and event; torchmetrics concatenates them
from all ranks before `compute`, so the metrics are those of the whole set, never a mean of
per-batch or per-rank values (a C-index does not average).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat
from torchsurv.metrics.auc import Auc
from torchsurv.metrics.cindex import ConcordanceIndex
from torchsurv.stats.ipcw import get_ipcw


def horizon_name(horizon: float) -> str:
    """`auc@12` for 12.0, `auc@6.5` for 6.5."""
    return f"auc@{horizon:g}"


def survival_metrics(
    risk: torch.Tensor, time: torch.Tensor, event: torch.Tensor, horizons: Sequence[float] = ()
) -> dict[str, torch.Tensor]:
    """Harrell's C (`cindex`), Uno's C (`uno_cindex`) and cumulative/dynamic AUC at each horizon (`auc@h`).

    Higher risk means an earlier event. Uno's C and the AUC weight subjects by the inverse
    probability of censoring, with the censoring distribution estimated (Kaplan-Meier) on the
    same set. A metric the data cannot define is left out: no comparable pair (no event), or a
    horizon before the first event or after the last follow-up.

    Args:
        risk: (N,) predicted log-risk.
        time: (N,) follow-up time.
        event: (N,) 1 event, 0 censored.
        horizons: times at which to compute the AUC.
    """
    risk, time, event = (t.detach().to("cpu", torch.float64).flatten() for t in (risk, time, event))
    event = event > 0.5
    out: dict[str, torch.Tensor] = {}
    comparable = bool(event.any()) and bool((time[None, :] > time[event][:, None]).any())
    if not comparable:
        return out
    with warnings.catch_warnings():
        # torchsurv warns about ties in `time`; ties are expected and handled as Harrell/Uno define.
        warnings.simplefilter("ignore")
        out["cindex"] = ConcordanceIndex()(risk, event, time)
        ipcw = get_ipcw(event, time).to(torch.float64)
        out["uno_cindex"] = ConcordanceIndex()(risk, event, time, weight=ipcw)
        for horizon in horizons:
            if not (bool((event & (time <= horizon)).any()) and bool((time > horizon).any())):
                continue
            new_time = torch.tensor([float(horizon)], dtype=torch.float64)
            auc = Auc()(risk, event, time, weight=ipcw, new_time=new_time,
                        weight_new_time=get_ipcw(event, time, new_time).to(torch.float64))
            out[horizon_name(horizon)] = auc[0]
    return {k: v for k, v in out.items() if torch.isfinite(v)}


class SurvivalMetrics(Metric):
    """Accumulates (risk, time, event) of every subject on every rank; `compute` gives `survival_metrics`.

    Args:
        horizons: times at which to compute the time-dependent AUC.
    """

    full_state_update = False

    def __init__(self, horizons: Sequence[float] = ()) -> None:
        super().__init__()
        self.horizons = [float(h) for h in horizons]
        self.add_state("risk", default=[], dist_reduce_fx="cat")
        self.add_state("time", default=[], dist_reduce_fx="cat")
        self.add_state("event", default=[], dist_reduce_fx="cat")

    def update(self, risk: torch.Tensor, time: torch.Tensor, event: torch.Tensor) -> None:
        self.risk.append(risk.detach().flatten().to(torch.float64))
        self.time.append(time.detach().flatten().to(torch.float64))
        self.event.append(event.detach().flatten().to(torch.float64))

    def compute(self) -> dict[str, torch.Tensor]:
        return survival_metrics(
            dim_zero_cat(self.risk), dim_zero_cat(self.time), dim_zero_cat(self.event), self.horizons
        )
