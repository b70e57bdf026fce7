"""Kaplan-Meier curves of the predicted risk groups (split at the median risk) and their log-rank test (scipy).

What a survival paper shows for a risk model: the subjects above the median predicted risk should
have their events sooner, and the log-rank test says how surely the two curves differ. `km_figure`
draws the curves with Pillow (censored subjects as ticks on their curve).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from scipy import stats

GROUPS = ("low risk", "high risk")
COLOURS = {"low risk": (31, 119, 180), "high risk": (214, 39, 40)}


@dataclass
class RiskGroup:
    """One group's Kaplan-Meier curve: `times` from 0 and the survival from each on (a right-continuous step
    function), its censoring times, and its size."""

    times: np.ndarray
    survival: np.ndarray
    censored: np.ndarray
    subjects: int
    events: int

    def at(self, when: np.ndarray) -> np.ndarray:
        """The curve's value at each time of `when`."""
        return self.survival[np.searchsorted(self.times, when, side="right") - 1]


@dataclass
class RiskGroups:
    """The two groups, the median risk that splits them, the log-rank p-value (NaN where undefined)."""

    groups: dict[str, RiskGroup]
    median_risk: float
    p_value: float


def censored_data(time: np.ndarray, event: np.ndarray) -> stats.CensoredData:
    return stats.CensoredData(uncensored=time[event], right=time[~event])


def kaplan_meier(time: np.ndarray, event: np.ndarray) -> RiskGroup:
    """The Kaplan-Meier estimate of the survival of subjects with follow-up `time` and `event` (True: event)."""
    time, event = np.asarray(time, dtype=np.float64), np.asarray(event, dtype=bool)
    times, survival = np.zeros(1), np.ones(1)
    if event.any():
        curve = stats.ecdf(censored_data(time, event)).sf
        # scipy lists the censoring times too (the curve flat there); the steps are at the event times.
        steps = np.isin(curve.quantiles, time[event])
        times = np.concatenate([times, curve.quantiles[steps]])
        survival = np.concatenate([survival, curve.probabilities[steps]])
    return RiskGroup(times, survival, np.sort(time[~event]), int(time.size), int(event.sum()))


def risk_groups(risk: np.ndarray, time: np.ndarray, event: np.ndarray) -> RiskGroups:
    """Subjects above the median risk (`high risk`) against the others (`low risk`), and the log-rank p-value
    of the two (two-sided; NaN where a group is empty or no event happened)."""
    risk, time = np.asarray(risk, dtype=np.float64), np.asarray(time, dtype=np.float64)
    event = np.asarray(event) > 0.5
    median = float(np.median(risk))
    high = risk > median
    members = {"low risk": ~high, "high risk": high}
    groups = {name: kaplan_meier(time[m], event[m]) for name, m in members.items()}
    p_value = float("nan")
    if high.any() and (~high).any() and event.any():
        p_value = float(stats.logrank(censored_data(time[high], event[high]),
                                      censored_data(time[~high], event[~high])).pvalue)
    return RiskGroups(groups, median, p_value)


def _nice_step(span: float, ticks: int = 6) -> float:
    """A round tick step (1, 2 or 5 times a power of ten) giving about `ticks` ticks over `span`."""
    raw = max(span, 1e-9) / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def km_figure(result: RiskGroups, title: str, width: int = 760, height: int = 520) -> np.ndarray:
    """The two Kaplan-Meier curves on white, with axes, censoring ticks, a legend and the log-rank p-value:
    an (H, W, 3) uint8 image."""
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=15)
    left, right, top, bottom = 70, width - 24, 84, height - 56
    end = max([float(g.times[-1]) for g in result.groups.values()]
              + [float(g.censored[-1]) for g in result.groups.values() if g.censored.size] + [1.0])
    step = _nice_step(end)
    end = math.ceil(end / step) * step

    def xy(t: float, s: float) -> tuple[float, float]:
        return left + (right - left) * t / end, bottom - (bottom - top) * s

    p_text = f"log-rank p = {result.p_value:.3g}" if math.isfinite(result.p_value) else "log-rank p undefined"
    draw.text((left - 60, 16), title, fill="black", font=font, anchor="lm")
    draw.text((right, 16), p_text, fill="black", font=font, anchor="rm")
    for value in np.arange(0.0, end + step / 2, step):
        x, _ = xy(float(value), 0.0)
        draw.line([(x, bottom), (x, bottom + 5)], fill="black")
        draw.text((x, bottom + 8), f"{value:g}", fill="black", font=font, anchor="mt")
    for value in (0.0, 0.25, 0.5, 0.75, 1.0):
        _, y = xy(0.0, value)
        draw.line([(left, y), (right, y)], fill=(225, 225, 225))
        draw.text((left - 8, y), f"{value:.2f}", fill="black", font=font, anchor="rm")
    draw.line([(left, top), (left, bottom), (right, bottom)], fill="black", width=2)
    draw.text(((left + right) / 2, height - 18), "time", fill="black", font=font, anchor="mm")
    draw.text((left - 60, top - 18), "event-free probability", fill="black", font=font, anchor="lm")
    for rank, name in enumerate(GROUPS):
        group, colour = result.groups[name], COLOURS[name]
        points = []
        for i, (t, s) in enumerate(zip(group.times, group.survival, strict=True)):
            if i:
                points.append(xy(float(t), float(group.survival[i - 1])))
            points.append(xy(float(t), float(s)))
        points.append(xy(end, float(group.survival[-1])))
        draw.line(points, fill=colour, width=3)
        for t, s in zip(group.censored, group.at(group.censored), strict=True):
            x, y = xy(float(t), float(s))
            draw.line([(x, y - 6), (x, y + 6)], fill=colour, width=2)
        x = left + rank * (right - left) / 2
        draw.line([(x, 42), (x + 30, 42)], fill=colour, width=3)
        draw.text((x + 38, 42), f"{name}: {group.subjects} subjects, {group.events} events", fill="black", font=font,
                  anchor="lm")
    return np.asarray(image)
