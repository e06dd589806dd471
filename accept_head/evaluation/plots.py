"""PNG figures of ``python -m eval``, over :mod:`accept_head.acceptance.plots`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..acceptance import plots
from ..acceptance.plots import ParetoSeries, finish_axes, new_figure, save_figure
from ..core.costs import CostModel
from ..engine.runner import MethodSummary

_STYLE = {
    "fixed_k": ("s", "tab:blue"),
    "specdecpp": ("o", "tab:red"),
    "heuristic": ("^", "tab:green"),
    "confidence": ("v", "tab:purple"),
    "entropy": ("D", "tab:orange"),
    "path_confidence": ("h", "tab:pink"),
    "hf_assisted": ("P", "tab:brown"),
    "oracle": ("*", "gold"),
    "autoregressive": ("X", "black"),
}


def pareto_plot(summaries: Sequence[MethodSummary], path: str | Path, title: str) -> Path:
    """Verification rate N_target/N (x) against discard rate N_discarded/N (y), one series per method family
    (:func:`accept_head.acceptance.plots.pareto_plot`)."""
    families: dict[str, list[MethodSummary]] = {}
    for summary in summaries:
        families.setdefault(summary.spec.kind, []).append(summary)
    series = []
    for kind, members in families.items():
        marker, color = _STYLE.get(kind, ("o", None))
        points = [
            (s.pooled.verification_rate, s.pooled.discard_rate, s.spec.name.removeprefix(s.spec.family).strip())
            for s in members
        ]
        size = 10 if kind in ("oracle", "autoregressive") else 6
        series.append(ParetoSeries(members[0].spec.family, points, marker, color, size))
    return plots.pareto_plot(series, path, title)


def costs_plot(cost_model: CostModel, path: str | Path, title: str = "measured costs") -> Path:
    """t_target(K) medians with min/max bars and the fitted a + b·K, against t_draft (per draft step, head incl.) and
    t_draft_next (a step after the first of a round)."""
    fig = new_figure()
    ax = fig.subplots()
    measured = {int(k): v for k, v in cost_model.measured.get("target", {}).items()}  # JSON keys are strings
    ks = sorted(measured)
    if ks:
        rows = [measured[k] for k in ks]
        med = [r["median"] * 1e3 for r in rows]
        low = [m - r["min"] * 1e3 for m, r in zip(med, rows)]
        high = [r["max"] * 1e3 - m for m, r in zip(med, rows)]
        ax.errorbar(
            ks, med, yerr=[low, high], fmt="o", color="tab:blue", capsize=2, label="target pass (median, min–max)"
        )
        fit = [cost_model.t_target(k) * 1e3 for k in ks]
        r2 = f", R²={cost_model.r2:.3f}" if cost_model.r2 is not None else ""
        ax.plot(
            ks,
            fit,
            color="tab:blue",
            alpha=0.6,
            label=f"fit {cost_model.t_target_a * 1e3:.1f} + {cost_model.t_target_b * 1e3:.2f}·K ms{r2}",
        )
    ax.axhline(
        cost_model.t_draft * 1e3, color="tab:red", linestyle="--", label=f"t_draft {cost_model.t_draft * 1e3:.2f} ms"
    )
    if cost_model.t_draft_next is not None:
        label = f"t_draft_next {cost_model.t_draft_next * 1e3:.2f} ms (a round's later steps)"
        ax.axhline(cost_model.t_draft_next * 1e3, color="tab:orange", linestyle=":", label=label)
    if ks and len(ks) <= 20:
        ax.set_xticks(ks)
    finish_axes(ax, title, xlabel="candidates verified per target pass  K", ylabel="milliseconds", ylim=(0, None))
    return save_figure(fig, path)


def bench_plot(panels: dict[str, Sequence[dict]], path: str | Path, title: str) -> Path:
    """Horizontal bars of median measured tokens/s with min–max whiskers, one panel per setting (temperature)."""
    n = max(len(panels), 1)
    rows = max((len(v) for v in panels.values()), default=1)
    fig = new_figure(6.4 * n, 0.8 + 0.35 * rows)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (name, methods) in zip(axes, panels.items()):
        labels = [m["name"] for m in methods]
        med = [m["tokens_per_second"]["median"] for m in methods]
        low = [m["tokens_per_second"]["median"] - m["tokens_per_second"]["min"] for m in methods]
        high = [m["tokens_per_second"]["max"] - m["tokens_per_second"]["median"] for m in methods]
        colors = [_STYLE.get(m["kind"], ("o", "gray"))[1] for m in methods]
        ys = list(range(len(methods)))[::-1]
        ax.barh(ys, med, xerr=[low, high], color=colors, alpha=0.8, capsize=2)
        ax.set_yticks(ys)
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xlabel("tokens / s (median, min–max over repeats)")
        ax.set_title(name, fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
