"""The threshold sweep: pick SpecDec++'s h against the cost model, with fixed-K speculative decoding as the baseline.

Thm 3.1 makes a constant threshold on P(some candidate is rejected) the optimal stopping rule, with the best h
depending on the cost ratio and the pair; it is found by decoding held-out prompts for a grid of h (and of K for the
fixed-K baseline) and keeping the h with the lowest modeled latency per token (eq. 2.3, or eq. 2.1 with
t_target(K) = a + b·K). The sweep decodes through :mod:`accept_head.engine.runner`, as ``python -m eval``'s comparisons
do: every policy decodes the same prompts with the same per-prompt seeds, interleaved prompt by prompt. With
``ablated`` thresholds it also decodes the same rule with the head ablated
(:class:`~accept_head.chain.baselines.PathConfidenceStop`: the draft's own 1 − Π q(y_j) in the head's place), so that
a fit can say whether its head pays over what the draft already knows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..acceptance import plots
from ..acceptance.calibration import Calibration
from ..acceptance.head import AcceptanceHead
from ..core import tables
from ..core.costs import CostModel
from ..core.prompts import EncodedPrompt
from ..core.sampling import SamplingConfig
from ..trees.growth import check_context_row
from .pair_loading import Pair
from .runner import MethodSpec, PolicyResult, Runner, TrainedHead, run_interleaved, summarize

THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
FIXED_K = (1, 2, 3, 4, 6, 8, 10, 12)


def check_thresholds(thresholds: Sequence[float]) -> list[float]:
    """Validate a grid of thresholds h: each strictly inside (0, 1), since h bounds P(some candidate is rejected)."""
    for h in thresholds:
        if not isinstance(h, int | float) or not 0.0 < float(h) < 1.0:
            raise ValueError(
                f"sweep threshold h={h!r} is outside (0, 1): h bounds the probability that some candidate is "
                "rejected, so h <= 0 stops after every token and h >= 1 never stops. Use values like "
                "--sweep.thresholds=[0.1,0.3,0.5,0.7,0.9]."
            )
    return [float(h) for h in thresholds]


def check_fixed_k(ks: Sequence[int]) -> list[int]:
    """Validate a grid of fixed candidate counts K >= 1."""
    for k in ks:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"fixed-K baseline K={k!r} must be an integer >= 1; e.g. --sweep.fixed_k=[1,2,4,8].")
    return [int(k) for k in ks]


@dataclass
class SweepRow:
    """One policy of the sweep and its aggregate over the prompts."""

    family: str
    """``autoregressive``, ``fixed_k``, ``threshold`` or ``ablated`` (the threshold rule on the draft's own q)."""
    param: float | None
    """K for ``fixed_k``, h for ``threshold`` and ``ablated``, None for ``autoregressive``."""
    result: PolicyResult
    variant: str | None = None
    """For ``threshold``: HeadThreshold's ``unscored`` setting (None: Alg. 2 as in the paper)."""
    candidates: tuple[int, int] = (1, 20)
    """For ``ablated``: (min_candidates, max_candidates), those of the head's rule it is compared with."""
    context_row: int = 0
    """Tokens copied from the text verified beside each chain
    (:func:`~accept_head.trees.chain_copies.chain_copy_generate`; 0: the plain chain). The label stays the rule's:
    every chain row of one sweep copies alike."""

    @property
    def label(self) -> str:
        if self.family == "autoregressive":
            return "autoregressive"
        if self.family == "fixed_k":
            return f"FixedK K={int(self.param)}"
        if self.family == "ablated":
            return f"head ablated (path confidence) h={self.param:g}"
        return f"SpecDec++ h={self.param:g}" + (f" unscored={self.variant}" if self.variant else "")

    @property
    def method(self) -> MethodSpec:
        """The engine's method for this row, named :attr:`label`."""
        if self.family == "autoregressive":
            return MethodSpec("autoregressive", label=self.label)
        copies = {"context_row": self.context_row} if self.context_row else {}
        if self.family == "fixed_k":
            return MethodSpec("fixed_k", {"k": int(self.param), **copies}, label=self.label)
        if self.family == "ablated":
            low, high = self.candidates
            params = {"threshold": self.param, "min_candidates": low, "max_candidates": high, **copies}
            return MethodSpec("path_confidence", params, label=self.label)
        params = {"threshold": self.param, "unscored": self.variant, **copies}
        return MethodSpec("specdecpp", params, label=self.label)

    def latency(self, by: str = "modeled") -> float:
        """Seconds per generated token under the cost model (``modeled``) or as measured (``measured``)."""
        rate = self.result.modeled_tokens_per_second if by == "modeled" else self.result.tokens_per_second
        return 1.0 / rate if rate else math.inf

    def to_dict(self) -> dict:
        return {
            "family": self.family,
            "param": self.param,
            "variant": self.variant,
            "label": self.label,
            **self.result.to_dict(),
        }


@dataclass
class SweepResult:
    rows: list[SweepRow]
    prompts: int
    max_new_tokens: int

    def family(self, name: str) -> list[SweepRow]:
        return [row for row in self.rows if row.family == name]

    def best(self, family: str, by: str = "modeled") -> SweepRow:
        """The row of ``family`` with the lowest latency (``by`` = ``modeled`` or ``measured``)."""
        if by not in ("modeled", "measured"):
            raise ValueError(f"by={by!r} must be 'modeled' or 'measured'.")
        rows = self.family(family)
        if not rows:
            raise ValueError(f"The sweep has no {family!r} rows to choose from.")
        if by == "modeled" and any(row.result.modeled_tokens_per_second is None for row in rows):
            raise ValueError("The sweep ran without a cost model: choose by='measured' or pass a cost model.")
        return min(rows, key=lambda row: row.latency(by))

    def to_records(self) -> list[dict]:
        return [row.to_dict() for row in self.rows]


def run_sweep(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    head: AcceptanceHead,
    prompts: Sequence[Sequence[int]],
    *,
    thresholds: Sequence[float] = THRESHOLDS,
    fixed_k: Sequence[int] = FIXED_K,
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos_token_id: int | Sequence[int] | None,
    cost_model: CostModel | None = None,
    min_candidates: int = 2,
    max_candidates: int = 20,
    calibration: Calibration | None = None,
    unscored: Sequence[str | None] = (None,),
    ablated: Sequence[float] = (),
    autoregressive: bool = True,
    context_row: int = 0,
    seed: int = 0,
    progress: bool = False,
    desc: str = "threshold sweep",
) -> SweepResult:
    """Decode ``prompts`` (token id lists, batch size 1) with every policy and aggregate each one.

    Policies: the target alone (if ``autoregressive``), FixedK for each K in ``fixed_k`` and SpecDec++'s
    HeadThreshold for each h in ``thresholds`` and each ``unscored`` setting (with ``calibration`` applied to the
    head's probabilities; the first setting only for a head that reads no hidden state, which leaves no candidate
    unscored), then the same rule with the head ablated for each h in ``ablated`` (``ablated`` rows:
    :class:`~accept_head.chain.baselines.PathConfidenceStop` with the same candidate bounds). They run through
    :func:`~accept_head.engine.runner.run_interleaved` (prompt ``i`` seeded with ``seeded_generator(seed, 0, i)`` in
    every policy) and are priced by :func:`~accept_head.engine.runner.summarize`. With ``context_row`` > 0 every
    chain (FixedK, SpecDec++, the ablated rule) also verifies that many tokens copied from the text, as a bundle with
    that ``context_row`` decodes, so h* is chosen for the decoder it ships. ``progress`` shows a bar labelled ``desc``.
    """
    context_row = check_context_row(context_row)
    thresholds, fixed_k, ablated = check_thresholds(thresholds), check_fixed_k(fixed_k), check_thresholds(ablated)
    if not prompts:
        raise ValueError("The sweep needs at least one prompt; raise --sweep.prompts or the validation split size.")
    rows = [SweepRow("autoregressive", None, None)] if autoregressive else []  # type: ignore[arg-type]
    rows += [SweepRow("fixed_k", k, None) for k in fixed_k]  # type: ignore[arg-type]
    if not head.reads_hidden:  # it scores every candidate as drawn: ``unscored`` changes nothing, decode h once
        unscored = list(unscored)[:1]
    rows += [SweepRow("threshold", h, None, u) for u in unscored for h in thresholds]  # type: ignore[arg-type]
    bounds = (min_candidates, max_candidates)
    rows += [SweepRow("ablated", h, None, candidates=bounds) for h in ablated]  # type: ignore[arg-type]
    for row in rows:
        row.context_row = context_row
    methods = [row.method for row in rows]
    head.eval()
    stop_ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    pair = Pair(target, draft, tokenizer=None, stop_ids=list(stop_ids))
    trained = TrainedHead(head, calibration, min_candidates, max_candidates)
    runner = Runner(pair, max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p, head=trained)
    encoded = [EncodedPrompt(str(i), "sweep", list(ids)) for i, ids in enumerate(prompts)]
    runs = run_interleaved(runner, methods, encoded, seed, progress=progress, desc=f"{desc} ({len(prompts)} prompts)")
    for row, summary in zip(rows, summarize(methods, runs, cost_model)):
        row.result = summary.pooled
    return SweepResult(rows=rows, prompts=len(prompts), max_new_tokens=max_new_tokens)


# ---- reporting -----------------------------------------------------------------------------------------------------

COLUMNS = ("policy", "tok/s", "modeled tok/s", "speedup", "verif. rate", "discard rate", "accepted/round")


def _cells(row: SweepRow, baseline: SweepRow | None) -> list[str]:
    r = row.result
    modeled = f"{r.modeled_tokens_per_second:.1f}" if r.modeled_tokens_per_second is not None else "-"
    speedup = "-"
    if baseline is not None and baseline.result.tokens_per_second > 0:
        speedup = f"{r.tokens_per_second / baseline.result.tokens_per_second:.2f}x"
    accepted = "-" if row.family == "autoregressive" else f"{r.mean_accepted:.2f}/{r.mean_proposed:.2f}"
    return [
        row.label,
        f"{r.tokens_per_second:.1f}",
        modeled,
        speedup,
        f"{r.verification_rate:.3f}",
        f"{r.discard_rate:.3f}",
        accepted,
    ]


def format_table(rows: Sequence[SweepRow], baseline: SweepRow | None = None, title: str | None = None) -> str:
    """A fixed-width text table for terminals (speedup = measured tokens/s relative to ``baseline``)."""
    return tables.text_table(COLUMNS, [_cells(row, baseline) for row in rows], title)


def markdown_table(rows: Sequence[SweepRow], baseline: SweepRow | None = None) -> str:
    """The same table as :func:`format_table` in Markdown (for model cards)."""
    return tables.markdown_table(COLUMNS, [_cells(row, baseline) for row in rows])


def pareto_plot(result: SweepResult, path: str | Path, title: str = "SpecDec++ threshold sweep") -> Path:
    """Save verification rate N_target/N (x) vs discard rate N_discarded/N (y) of every policy as a PNG
    (:func:`~accept_head.acceptance.plots.pareto_plot`)."""
    styles = {  # family: legend, annotation prefix, marker, colour, marker size
        "fixed_k": ("fixed K", "K=", "s", "tab:blue", 6.0),
        "threshold": ("SpecDec++ threshold h", "h=", "o", "tab:red", 6.0),
        "autoregressive": ("autoregressive", "", "*", "black", 11.0),
    }
    series = []
    for family, (label, prefix, marker, color, size) in styles.items():
        points = [
            (row.result.verification_rate, row.result.discard_rate, f"{prefix}{row.param:g}" if prefix else "")
            for row in result.family(family)
        ]
        series.append(plots.ParetoSeries(label, points, marker, color, size))
    title = f"{title}\n{result.prompts} prompts, up to {result.max_new_tokens} new tokens"
    return plots.pareto_plot(series, path, title)
