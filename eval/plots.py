"""PNG figures of ``python -m eval``, drawn with matplotlib's object API (no pyplot state, no display needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from accept_head.cost_model import CostModel
from accept_head.metrics import ReliabilityBins

from .methods import MethodSummary

_STYLE = {
    "fixed_k": ("s", "tab:blue"),
    "specdecpp": ("o", "tab:red"),
    "heuristic": ("^", "tab:green"),
    "confidence": ("v", "tab:purple"),
    "entropy": ("D", "tab:orange"),
    "hf_assisted": ("P", "tab:brown"),
    "oracle": ("*", "gold"),
    "autoregressive": ("X", "black"),
}


def _figure(width: float = 6.4, height: float = 4.8):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=120)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    return path


def pareto_plot(summaries: Sequence[MethodSummary], path: str | Path, title: str) -> Path:
    """Verification rate N_target/N (x) against discard rate N_discarded/N (y), one series per method family —
    the trade-off plane of SpecDec++'s Figure 4. Lower-left is better on both axes; eq. 2.3 prices a point as
    t_draft·discard + (t_target − t_draft)·verification."""
    fig = _figure()
    ax = fig.subplots()
    families: dict[str, list[MethodSummary]] = {}
    for summary in summaries:
        families.setdefault(summary.spec.kind, []).append(summary)
    for kind, members in families.items():
        marker, color = _STYLE.get(kind, ("o", None))
        members = sorted(members, key=lambda s: s.pooled.verification_rate)
        xs = [s.pooled.verification_rate for s in members]
        ys = [s.pooled.discard_rate for s in members]
        single = len(members) == 1
        ax.plot(
            xs,
            ys,
            marker=marker,
            color=color,
            linestyle="none" if single else "-",
            label=members[0].spec.family,
            markersize=10 if kind in ("oracle", "autoregressive") else 6,
        )
        if not single:
            for s, x, y in zip(members, xs, ys):
                short = s.spec.name.removeprefix(s.spec.family).strip()
                ax.annotate(short, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6, color=color)
    ax.set_xlabel("verification rate  N_target / N")
    ax.set_ylabel("discard rate  N_discarded / N")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def costs_plot(cost_model: CostModel, path: str | Path, title: str = "measured costs") -> Path:
    """t_target(K) medians with min/max bars and the fitted a + b·K, against t_draft (per draft step, head incl.)."""
    fig = _figure()
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
    if ks and len(ks) <= 20:
        ax.set_xticks(ks)
    ax.set_xlabel("candidates verified per target pass  K")
    ax.set_ylabel("milliseconds")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def bench_plot(panels: dict[str, Sequence[dict]], path: str | Path, title: str) -> Path:
    """Horizontal bars of median measured tokens/s with min–max whiskers, one panel per setting (temperature)."""
    n = max(len(panels), 1)
    rows = max((len(v) for v in panels.values()), default=1)
    fig = _figure(6.4 * n, 0.8 + 0.35 * rows)
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
    return _save(fig, path)


def reliability_plot(panels: dict[str, dict[str, ReliabilityBins]], path: str | Path, title: str) -> Path:
    """Reliability diagrams: mean label (realised acceptance) against mean predicted probability per bin, one panel
    per data source and one curve per variant (raw, calibrated); marker area ∝ the bin's count."""
    n = max(len(panels), 1)
    fig = _figure(4.8 * n, 4.8)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (name, curves) in zip(axes, panels.items()):
        ax.plot([0, 1], [0, 1], color="gray", linestyle=":", label="perfect")
        for (label, bins), color in zip(curves.items(), ("tab:red", "tab:blue", "tab:green")):
            pts = [
                (p, y, c) for p, y, c in zip(bins.mean_pred, bins.mean_label, bins.count) if c > 0 and not math.isnan(p)
            ]
            if not pts:
                continue
            total = sum(c for _, _, c in pts)
            ax.plot([p for p, _, _ in pts], [y for _, y, _ in pts], color=color, label=label)
            ax.scatter(
                [p for p, _, _ in pts],
                [y for _, y, _ in pts],
                s=[8 + 300 * c / total for _, _, c in pts],
                color=color,
                alpha=0.6,
            )
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted acceptance probability")
        ax.set_ylabel("realised acceptance")
        ax.set_title(name, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
