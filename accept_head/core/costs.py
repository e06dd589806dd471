"""The cost model of speculative decoding (SpecDec++ §2, eq. 2.1–2.3); measured by :mod:`accept_head.engine.measure`.

Total time T = t_draft · N_draft + Σ_rounds t_target(K_r), where a step after the first of a round may cost less
(t_draft_next: the draft's weights are still in the caches). With a constant t_target this is eq. 2.3 per generated
token: latency = t_draft + t_draft · N_discarded/N + (t_target − t_draft) · N_target/N. Where verifying K
candidates costs more than one token (CPU fp32, large batches) t_target grows with K: t_target(K) = a + b·K.
The tree decoders price a call by the tokens it is fed, through a measured curve (:class:`TreeCost`).

A draft step's time includes the acceptance head's call; where the head's share was measured (``t_head``,
``t_head_next``) a rule that never calls the head (FixedK, the training-free rules) is priced without it
(:meth:`CostModel.without_head`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np


@dataclass
class CostModel:
    """Seconds per draft step (head included) and per target call verifying K candidates: a + b·K."""

    t_draft: float
    t_target_a: float
    t_target_b: float = 0.0
    r2: float | None = None
    """R² of the linear fit of t_target(K), when measured."""
    measured: dict = field(default_factory=dict)
    """Raw medians/min/max per K, when measured."""
    t_draft_next: float | None = None
    """Seconds of a draft step (head included) that follows another in the same round, when measured; None: t_draft.
    A round's first step follows a target pass that pushed the draft's weights out of the CPU's caches; the steps
    after it find them there and cost less (about half, with a small draft on a CPU)."""
    t_single: float | None = None
    """Seconds of a one-token target pass (an autoregressive step, or a round that verifies no candidate), when
    measured; None: the line's intercept. The line is fitted over K ≥ 1 and need not pass through it: on a CPU a
    one-row matrix product runs a matrix-vector kernel, and two rows can cost twice as much."""
    t_head: float | None = None
    """Seconds of t_draft spent in the acceptance head (its inputs included), when measured; None: unknown, and every
    rule pays the whole t_draft (cost models measured before 2026-11-29 did not split it)."""
    t_head_next: float | None = None
    """The head's share of t_draft_next, when measured (None: t_head)."""

    def __post_init__(self) -> None:
        if self.t_draft < 0 or self.t_target_a <= 0:
            raise ValueError(
                f"cost model needs t_draft >= 0 and t_target_a > 0, got {self.t_draft}, {self.t_target_a}."
            )
        if self.t_draft_next is not None and self.t_draft_next < 0:
            raise ValueError(f"t_draft_next={self.t_draft_next} must be >= 0 seconds (or None: t_draft).")
        if self.t_single is not None and not self.t_single > 0:
            raise ValueError(f"t_single={self.t_single} must be > 0 seconds (or None: the line's intercept).")
        for name, share, whole in (
            ("t_head", self.t_head, self.t_draft),
            ("t_head_next", self.t_head_next, self.t_step),
        ):
            if share is not None and not 0 <= share <= whole:
                raise ValueError(f"{name}={share} must lie in [0, {whole}] seconds: it is the head's share of a step.")

    def t_target(self, k: int | float) -> float:
        """Seconds of a target call verifying ``k`` candidates (k + 1 tokens); k = 0 is a one-token pass."""
        if k == 0 and self.t_single is not None:
            return self.t_single
        return self.t_target_a + self.t_target_b * k

    @property
    def t_step(self) -> float:
        """Seconds of a draft step after the first of a round (t_draft_next, else t_draft)."""
        return self.t_draft if self.t_draft_next is None else self.t_draft_next

    def without_head(self) -> CostModel:
        """The same model for a rule that never calls the acceptance head: each step less the head's measured share
        (this model unchanged when the share was not measured)."""
        if self.t_head is None:
            return self
        head_next = self.t_head if self.t_head_next is None else self.t_head_next
        return replace(
            self,
            t_draft=self.t_draft - self.t_head,
            t_draft_next=None if self.t_draft_next is None else self.t_draft_next - head_next,
            t_head=0.0,
            t_head_next=0.0,
        )

    def drafting(self, steps: int | float, rounds: int | float = 1) -> float:
        """Seconds of ``steps`` draft steps spread over ``rounds`` rounds: each round's first step at t_draft (after
        a target pass), the rest at t_draft_next."""
        first = min(steps, rounds)
        return self.t_draft * first + self.t_step * (steps - first)

    def modeled_tokens_per_second(self, generated: int, draft_calls: int, proposed: Sequence[int]) -> float:
        """Tokens per second of the counted passes, timed by eq. 2.1 with t_target(K) and a round's first draft step
        priced apart from the rest (:meth:`drafting`)."""
        rounds = sum(1 for k in proposed if k > 0)
        seconds = self.drafting(draft_calls, rounds) + sum(self.t_target(k) for k in proposed)
        return generated / seconds if seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> CostModel:
        """The inverse of :meth:`to_dict`; also reads a ``costs.json`` of ``python -m eval costs`` (the model under
        its ``cost_model`` key). Unknown keys are ignored."""
        if isinstance(raw.get("cost_model"), dict):
            raw = raw["cost_model"]
        missing = [key for key in ("t_draft", "t_target_a") if key not in raw]
        if missing:
            raise ValueError(f"cost model lacks {missing}; expected t_draft, t_target_a and optionally t_target_b.")
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


def expected_fixed_k_speedup(step_acceptance: Sequence[float], k: int, cost: CostModel) -> float:
    """Modeled speed-up over the target alone of drafting exactly ``k`` candidates per round, when candidate j is
    accepted with probability ``step_acceptance[j-1]`` given the earlier ones were (independent across rounds).

    Tokens per round: 1 + Σ_{j≤k} Π_{i≤j} α_i (accepted run plus the target's own token); seconds per round:
    t_draft + (k − 1)·t_draft_next + t_target(k); the target alone writes one token per t_target(0). This is the
    ceiling the measured α and c allow a fixed-K rule, to print beside a measured speed-up.
    """
    if not 1 <= k <= len(step_acceptance):
        raise ValueError(f"k={k} needs 1..{len(step_acceptance)} per-step acceptance values.")
    run, tokens = 1.0, 1.0
    for alpha in step_acceptance[:k]:
        run *= alpha
        tokens += run
    return (tokens / (cost.drafting(k) + cost.t_target(k))) * cost.t_target(0)


def latency_per_token(t_draft: float, t_target: float, verification_rate: float, discard_rate: float) -> float:
    """Eq. 2.3: t_draft + t_draft · N_discarded/N + (t_target − t_draft) · N_target/N (seconds per token)."""
    return t_draft + t_draft * discard_rate + (t_target - t_draft) * verification_rate


def fit_linear(ks: Sequence[float], times: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares fit times ≈ a + b·k with b >= 0; returns (a, b, R²).

    A pass over more tokens never costs less: a falling line is timing noise over a flat curve (a GPU, or a tiny model
    on a CPU), and extrapolated to the tens of tokens a learning-free decoder's tree feeds it would price wide calls at
    nothing or below nothing. Such a fit becomes the flat line through the mean (b = 0, R² = 0)."""
    from sklearn.linear_model import LinearRegression

    x, y = np.asarray(ks, dtype=np.float64)[:, None], np.asarray(times, dtype=np.float64)
    fit = LinearRegression().fit(x, y)
    if fit.coef_[0] < 0:
        return float(y.mean()), 0.0, 0.0
    return float(fit.intercept_), float(fit.coef_[0]), _r2(fit, x, y)


def _r2(fit, x: np.ndarray, y: np.ndarray) -> float:
    """R² of a fitted scikit-learn regression on (x, y); 1 for a single point (scikit-learn leaves it undefined)."""
    return float(fit.score(x, y)) if len(y) > 1 else 1.0


@dataclass
class DecodeCostFit:
    """Costs read back from real decoding runs: wall time ≈ intercept(prompt set) + per_round · target calls +
    per_candidate · drafted candidates (see :func:`fit_decode_costs`)."""

    per_round: float
    """Seconds per target call (the verification pass and the round's bookkeeping)."""
    per_candidate: float
    """Seconds per drafted candidate (the draft step, the head, and the candidate's share of verification)."""
    r2: float
    runs: int

    def to_dict(self) -> dict:
        return asdict(self)


def fit_decode_costs(runs: Sequence[tuple[str, float, int, float]]) -> DecodeCostFit:
    """Least-squares fit of decoding wall times to the counts that the cost model prices.

    ``runs``: (group, seconds, target calls, drafted candidates) per decoding run, a group being one prompt set
    decoded by every run in it (it gets its own intercept: prompt prefill and per-prompt overhead). With a draft step
    per candidate, per_candidate compares with t_draft + t_target_b of :class:`CostModel` and per_round with
    t_target_a — the check that a synthetic measurement prices real decoding. Needs more runs than groups + 2.
    """
    groups = sorted({group for group, *_ in runs})
    if len(runs) < len(groups) + 3:
        raise ValueError(
            f"fit_decode_costs needs at least {len(groups) + 3} runs for {len(groups)} group(s), got {len(runs)}."
        )
    rows = [
        [1.0 if group == g else 0.0 for g in groups] + [float(calls), float(cand)] for group, _, calls, cand in runs
    ]
    from sklearn.linear_model import LinearRegression

    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray([float(seconds) for _, seconds, *_ in runs], dtype=np.float64)
    fit = LinearRegression(fit_intercept=False).fit(x, y)  # the group columns are the intercepts
    return DecodeCostFit(
        per_round=float(fit.coef_[-2]), per_candidate=float(fit.coef_[-1]), r2=_r2(fit, x, y), runs=len(runs)
    )


@dataclass
class TreeCost:
    """Seconds of one target call as a function of the tokens it is fed (the root, every guessed row and any
    window): piecewise-linear through measured medians, extended past the last size by the slope of the last two.

    Where :class:`CostModel`'s straight line a + b·K misprices the flat start of the curve (on a CPU in bf16, feeding
    up to ~20 tokens costs about as much as feeding one), the tree decoders' stop rules and benchmarks price a call
    by this curve instead.
    """

    sizes: list[int]
    """Tokens fed, strictly increasing, all >= 1."""
    seconds: list[float]
    """Median seconds of a call fed ``sizes[i]`` tokens."""

    def __post_init__(self) -> None:
        self.sizes, self.seconds = [int(n) for n in self.sizes], [float(t) for t in self.seconds]
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError(f"TreeCost needs equally long, non-empty sizes and seconds (got {self.sizes}).")
        if self.sizes[0] < 1 or any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError(f"TreeCost sizes={self.sizes} must be strictly increasing and >= 1.")
        if any(not t > 0 for t in self.seconds):
            raise ValueError(f"TreeCost seconds={self.seconds} must all be > 0.")

    def __call__(self, fed: int | float) -> float:
        sizes, seconds = self.sizes, self.seconds
        if len(sizes) == 1 or fed <= sizes[0]:
            return seconds[0]
        i = min(max(bisect.bisect_right(sizes, fed), 1), len(sizes) - 1)  # the segment holding fed (or the last)
        slope = (seconds[i] - seconds[i - 1]) / (sizes[i] - sizes[i - 1])
        return max(seconds[i - 1] + slope * (fed - sizes[i - 1]), seconds[0])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> TreeCost:
        return cls(sizes=raw["sizes"], seconds=raw["seconds"])
