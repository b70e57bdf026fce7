"""Survival metrics over a whole evaluation set: Harrell's and Uno's C-index, time-dependent AUC and the integrated
Brier score (torchsurv), and Breslow's baseline hazard that turns log-risks into survival probabilities.

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
from torchsurv.metrics.brier_score import BrierScore
from torchsurv.metrics.cindex import ConcordanceIndex
from torchsurv.stats.ipcw import get_ipcw

# The integrated Brier score's time grid: evenly spaced between these percentiles of the set's follow-up times,
# inside the follow-up where the censoring weights are defined (scikit-survival's examples take the same range).
BRIER_PERCENTILES = (10.0, 90.0)
BRIER_POINTS = 20


def horizon_name(horizon: float) -> str:
    """`auc@12` for 12.0, `auc@6.5` for 6.5."""
    return f"auc@{horizon:g}"


def breslow_baseline(
    risk: torch.Tensor, time: torch.Tensor, event: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Breslow's estimate of the baseline cumulative hazard for log-risks `risk` (Breslow 1972).

    At each distinct event time t: H0(t) = sum over event times s <= t of d(s) / sum_{i: T_i >= s} exp(risk_i),
    d(s) the events at s. Returns the event times (ascending) and H0 at each; empty without events.
    """
    risk, time, event = (t.detach().to("cpu", torch.float64).flatten() for t in (risk, time, event))
    observed = event > 0.5
    times = torch.unique(time[observed])
    if times.numel() == 0:
        return times, times.clone()
    # Centred for the exponential's range; the centring cancels in exp(risk) * H0.
    relative = torch.exp(risk - risk.max())
    at_risk = torch.stack([relative[time >= t].sum() for t in times])
    deaths = torch.stack([(observed & (time == t)).sum().to(torch.float64) for t in times])
    return times, torch.cumsum(deaths / at_risk, 0) * torch.exp(-risk.max())


def survival_probabilities(
    risk: torch.Tensor, baseline_time: torch.Tensor, baseline_hazard: torch.Tensor, at: torch.Tensor
) -> torch.Tensor:
    """(N, T): each subject's probability of no event by each time of `at`, exp(-H0(t) exp(risk)), H0 a right-
    continuous step function (0 before the first baseline time)."""
    risk, at = risk.detach().to("cpu", torch.float64).flatten(), at.to(torch.float64).flatten()
    index = torch.searchsorted(baseline_time.to(torch.float64), at, right=True)
    hazard = torch.cat([torch.zeros(1, dtype=torch.float64), baseline_hazard.to(torch.float64)])[index]
    return torch.exp(-torch.exp(risk)[:, None] * hazard[None, :])


def brier_grid(time: torch.Tensor) -> torch.Tensor:
    """The times the integrated Brier score averages over (`BRIER_PERCENTILES`, `BRIER_POINTS`)."""
    low, high = (float(torch.quantile(time.to(torch.float64), p / 100)) for p in BRIER_PERCENTILES)
    return torch.linspace(low, high, BRIER_POINTS, dtype=torch.float64)


def integrated_brier_score(
    survival: torch.Tensor, time: torch.Tensor, event: torch.Tensor, grid: torch.Tensor
) -> torch.Tensor:
    """Graf's integrated Brier score: the IPCW Brier score of `survival` (N, T) at each time of `grid` (torchsurv,
    censoring weights from the Kaplan-Meier estimate on the same set), averaged over the grid's range by the
    trapezoidal rule, as scikit-survival's `integrated_brier_score` averages it."""
    time, observed = time.to(torch.float64).flatten(), event.flatten() > 0.5
    scores = BrierScore()(
        survival, observed, time, new_time=grid, weight=get_ipcw(observed, time).to(torch.float64),
        weight_new_time=get_ipcw(observed, time, grid).to(torch.float64),
    )
    return torch.trapezoid(scores, grid) / (grid[-1] - grid[0])


def survival_metrics(
    risk: torch.Tensor, time: torch.Tensor, event: torch.Tensor, horizons: Sequence[float] = (),
    baseline: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Harrell's C (`cindex`), Uno's C (`uno_cindex`), cumulative/dynamic AUC at each horizon (`auc@h`) and, given
    a baseline hazard, the integrated Brier score (`ibs`).

    Higher risk means an earlier event. Uno's C, the AUC and the Brier score weight subjects by
    the inverse probability of censoring, with the censoring distribution estimated (Kaplan-Meier)
    on the same set. A metric the data cannot define is left out: no comparable pair (no event), a
    horizon before the first event or after the last follow-up, a baseline without event times.

    Args:
        risk: (N,) predicted log-risk.
        time: (N,) follow-up time.
        event: (N,) 1 event, 0 censored.
        horizons: times at which to compute the AUC.
        baseline: event times and Breslow cumulative hazard (`breslow_baseline`) of other subjects, which
            turn each log-risk into a survival curve for the Brier score.
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
        if baseline is not None and baseline[0].numel() > 0:
            grid = brier_grid(time)
            if float(grid[-1]) > float(grid[0]):
                survival = survival_probabilities(risk, *baseline, grid)
                out["ibs"] = integrated_brier_score(survival, time, event, grid)
    return {k: v for k, v in out.items() if torch.isfinite(v)}


class SurvivalMetrics(Metric):
    """Accumulates (risk, time, event) of every subject on every rank; `compute` gives `survival_metrics`.

    After `compute`, `gathered` holds the whole set's (risk, time, event), on the device the states are on (a GPU's
    in a GPU run: whoever hands them to numpy copies them to the CPU first), for what else is made of it (Breslow's
    baseline of the validation set, the test set's risk groups).

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
        # The Brier score's baseline hazard (event times, cumulative hazard), set by the owner; None: no `ibs`.
        self.baseline: tuple[torch.Tensor, torch.Tensor] | None = None
        self.gathered: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def update(self, risk: torch.Tensor, time: torch.Tensor, event: torch.Tensor) -> None:
        self.risk.append(risk.detach().flatten().to(torch.float64))
        self.time.append(time.detach().flatten().to(torch.float64))
        self.event.append(event.detach().flatten().to(torch.float64))

    def compute(self) -> dict[str, torch.Tensor]:
        self.gathered = (dim_zero_cat(self.risk), dim_zero_cat(self.time), dim_zero_cat(self.event))
        return survival_metrics(*self.gathered, self.horizons, self.baseline)
