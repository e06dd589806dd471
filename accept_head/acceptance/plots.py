"""PNG figures drawn with matplotlib's object API (no pyplot state, no display needed): the verification/discard
plane of SpecDec++'s Figure 4 and reliability diagrams of predicted acceptance. Used by the end-of-fit stages and by
``python -m eval``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from .metrics import ReliabilityBins


def new_figure(width: float = 6.4, height: float = 4.8):
    """A matplotlib ``Figure`` of ``width`` × ``height`` inches at 120 dpi."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=120)


def save_figure(fig, path: str | Path) -> Path:
    """Lay ``fig`` out tightly and write it to ``path`` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    return path


def finish_axes(ax, title: str, **settings) -> None:
    """Apply ``settings`` (``ax.set``: labels, limits), then the house title size, a light grid and a small legend."""
    ax.set(**settings)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


class ParetoSeries(NamedTuple):
    """One line of :func:`pareto_plot`: a family of policies."""

    label: str
    points: Sequence[tuple[float, float, str]]
    """(verification rate, discard rate, annotation) per policy."""
    marker: str = "o"
    color: str | None = None
    size: float = 6.0


def pareto_plot(series: Sequence[ParetoSeries], path: str | Path, title: str) -> Path:
    """Verification rate N_target/N (x) against discard rate N_discarded/N (y), one line per series — the trade-off
    plane of SpecDec++'s Figure 4. Lower-left is better on both axes; eq. 2.3 prices a point as
    t_draft·discard + (t_target − t_draft)·verification. Policies of a series that land on the same point share one
    annotation; a series of one point is drawn as a marker without annotation."""
    fig = new_figure()
    ax = fig.subplots()
    for s in series:
        points = sorted(s.points, key=lambda point: point[0])
        if not points:
            continue
        single = len(points) == 1
        xs, ys = [x for x, _, _ in points], [y for _, y, _ in points]
        linestyle = "none" if single else "-"
        ax.plot(xs, ys, marker=s.marker, color=s.color, linestyle=linestyle, label=s.label, markersize=s.size)
        if single:
            continue
        shared: dict[tuple[float, float], list[str]] = {}
        for x, y, text in points:
            shared.setdefault((x, y), []).append(text)
        for (x, y), texts in shared.items():
            ax.annotate(",".join(texts), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6, color=s.color)
    finish_axes(ax, title, xlabel="verification rate  N_target / N", ylabel="discard rate  N_discarded / N")
    return save_figure(fig, path)


def reliability_plot(panels: dict[str, dict[str, ReliabilityBins]], path: str | Path, title: str) -> Path:
    """Reliability diagrams: mean label (realised acceptance) against mean predicted probability per bin, one panel
    per data source and one curve per variant (raw, calibrated); marker area ∝ the bin's count. Points under the
    diagonal are over-confident."""
    n = max(len(panels), 1)
    fig = new_figure(4.8 * n, 4.8)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (name, curves) in zip(axes, panels.items()):
        ax.plot([0, 1], [0, 1], color="gray", linestyle=":", label="perfect")
        for (label, bins), color in zip(curves.items(), ("tab:red", "tab:blue", "tab:green", "tab:purple")):
            pts = [
                (p, y, c) for p, y, c in zip(bins.mean_pred, bins.mean_label, bins.count) if c > 0 and not math.isnan(p)
            ]
            if not pts:
                continue
            preds, realised, counts = zip(*pts)
            ax.plot(preds, realised, color=color, label=label)
            ax.scatter(preds, realised, s=[8 + 300 * c / sum(counts) for c in counts], color=color, alpha=0.6)
        finish_axes(
            ax, name, xlim=(0, 1), ylim=(0, 1), xlabel="predicted acceptance probability", ylabel="realised acceptance"
        )
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
