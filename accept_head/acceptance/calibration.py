"""Calibration maps for the head's probabilities: temperature scaling and isotonic regression.

A map is stored in the bundle's ``config.json`` as plain numbers, so loading needs no pickles.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Calibration:
    """Maps a raw acceptance probability to a calibrated one.

    ``kind='temperature'``: sigmoid(logit(p) / temperature). ``kind='isotonic'``: piecewise-linear interpolation
    through the fitted (x, y) knots, clamped at both ends.
    """

    kind: str
    temperature: float = 1.0
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in ("temperature", "isotonic"):
            raise ValueError(f"calibration kind={self.kind!r} must be 'temperature' or 'isotonic'.")
        if self.kind == "temperature" and not self.temperature > 0:
            raise ValueError(f"calibration temperature={self.temperature} must be > 0.")
        if self.kind == "isotonic" and (len(self.x) != len(self.y) or not self.x):
            raise ValueError("isotonic calibration needs equally long, non-empty x and y knot lists.")

    def __call__(self, prob: float) -> float:
        if self.kind == "temperature":
            p = min(max(prob, 1e-7), 1 - 1e-7)
            return 1.0 / (1.0 + math.exp(-math.log(p / (1 - p)) / self.temperature))
        if prob <= self.x[0]:
            return self.y[0]
        if prob >= self.x[-1]:
            return self.y[-1]
        i = bisect.bisect_right(self.x, prob)
        x0, x1, y0, y1 = self.x[i - 1], self.x[i], self.y[i - 1], self.y[i]
        return y0 if x1 == x0 else y0 + (y1 - y0) * (prob - x0) / (x1 - x0)

    def to_dict(self) -> dict:
        if self.kind == "temperature":
            return {"kind": "temperature", "temperature": self.temperature}
        return {"kind": "isotonic", "x": list(self.x), "y": list(self.y)}

    @classmethod
    def from_dict(cls, raw: dict) -> Calibration:
        return cls(**raw)


# ---- fitting -------------------------------------------------------------------------------------------------------
# The maps above are applied one probability at a time by the decoder; the functions below fit them on a validation
# set of head predictions against soft labels ℓ ∈ [0, 1] (scikit-learn for isotonic regression).

LOGIT_CLIP = 16.0
"""|logit| bound used when fitting and applying a temperature, matching the 1e-7 probability clip of ``__call__``."""


def apply_calibration(calibration: Calibration | None, probs: torch.Tensor) -> torch.Tensor:
    """Vectorised :meth:`Calibration.__call__` over probabilities (...,) → calibrated (...,) float64."""
    probs = probs.detach().double()
    if calibration is None:
        return probs
    if calibration.kind == "temperature":
        p = probs.clamp(1e-7, 1 - 1e-7)
        return torch.sigmoid(torch.log(p / (1 - p)) / calibration.temperature)
    return torch.from_numpy(np.interp(probs.numpy(), calibration.x, calibration.y)).reshape(probs.shape)


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, max_iter: int = 100) -> Calibration:
    """Temperature scaling: the T > 0 minimising the soft-label BCE of sigmoid(logit / T).

    logits: (M,) raw head logits, labels: (M,) soft labels. T > 1 softens over-confident predictions. T is
    optimised as log T with L-BFGS (one parameter, convex in 1/T).
    """
    logits, labels = _fit_inputs(logits, labels)
    logits = logits.clamp(-LOGIT_CLIP, LOGIT_CLIP)
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits / log_t.exp(), labels)
        loss.backward()
        return loss

    optimizer.step(closure)
    temperature = float(log_t.detach().exp())
    if not math.isfinite(temperature) or temperature <= 0:  # degenerate data (e.g. all logits 0): keep identity
        temperature = 1.0
    return Calibration(kind="temperature", temperature=temperature)


def fit_isotonic(probs: torch.Tensor, labels: torch.Tensor) -> Calibration:
    """Isotonic regression of soft labels on predicted probabilities (M,) → a monotone piecewise-linear map.

    The knots are scikit-learn's ``X_thresholds_`` / ``y_thresholds_``; :meth:`Calibration.__call__` interpolates
    linearly between them and clamps outside, exactly like ``IsotonicRegression(out_of_bounds="clip").predict``.
    """
    from sklearn.isotonic import IsotonicRegression

    probs, labels = _fit_inputs(probs, labels)
    model = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip")
    model.fit(probs.numpy(), labels.numpy())
    return Calibration(
        kind="isotonic", x=[float(v) for v in model.X_thresholds_], y=[float(v) for v in model.y_thresholds_]
    )


def _fit_inputs(values: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, labels = values.detach().double().reshape(-1), labels.detach().double().reshape(-1)
    if values.shape != labels.shape:
        raise ValueError(f"predictions {tuple(values.shape)} and labels {tuple(labels.shape)} differ in length.")
    if values.numel() == 0:
        raise ValueError("Cannot fit a calibration map on zero predictions: the validation split holds no positions.")
    return values, labels


CALIBRATION_METHODS = ("temperature", "isotonic")


def fit_calibration(method: str, logits: torch.Tensor, labels: torch.Tensor) -> Calibration:
    """Fit one map by name (``temperature`` on logits, ``isotonic`` on probabilities)."""
    if method == "temperature":
        return fit_temperature(logits, labels)
    if method == "isotonic":
        return fit_isotonic(torch.sigmoid(logits.double()), labels)
    raise ValueError(f"calibration method={method!r} is not one of {list(CALIBRATION_METHODS)}.")


@dataclass
class CalibrationChoice:
    """Outcome of :func:`choose_calibration`: the kept map (None = raw is best) and the scores behind the choice."""

    calibration: Calibration | None
    chosen: str
    """``raw`` or one of :data:`CALIBRATION_METHODS`."""
    scores: dict[str, dict[str, float]]
    """Per candidate (``raw``, ``temperature``, ``isotonic``): held-out ``ece`` and ``brier``."""
    evaluation: str
    """How the scores were obtained (cross-fitted folds by group, or in-sample when there are too few groups)."""


def choose_calibration(
    logits: torch.Tensor,
    labels: torch.Tensor,
    groups: torch.Tensor | None = None,
    methods: tuple[str, ...] | list[str] = CALIBRATION_METHODS,
    folds: int = 2,
    seed: int = 0,
    n_bins: int = 15,
) -> CalibrationChoice:
    """Fit each calibration method, score it on held-out folds, keep the best (lowest ECE, then Brier).

    logits, labels: (M,); groups: (M,) integer group ids (the prompt of each position), so folds never split a
    prompt. Each position is scored by a map fitted on the other folds; the kept map is then refitted on all data.
    ``raw`` (no map) competes too: a map that does not help out of sample is not kept.
    """
    from .metrics import brier_score, expected_calibration_error

    logits, labels = _fit_inputs(logits, labels)
    for method in methods:
        if method not in CALIBRATION_METHODS:
            raise ValueError(f"calibration method={method!r} is not one of {list(CALIBRATION_METHODS)}.")
    groups = torch.zeros_like(labels, dtype=torch.long) if groups is None else groups.reshape(-1).long()
    unique = torch.unique(groups)
    generator = torch.Generator().manual_seed(seed)
    fold_of_group = torch.randperm(len(unique), generator=generator) % max(folds, 1)
    fold = fold_of_group[torch.searchsorted(unique, groups)]
    cross_fit = folds >= 2 and len(unique) >= folds
    raw = torch.sigmoid(logits)
    scores = {"raw": {"ece": expected_calibration_error(raw, labels, n_bins), "brier": brier_score(raw, labels)}}
    for method in methods:
        if cross_fit:
            calibrated = torch.empty_like(raw)
            for k in range(folds):
                held = fold == k
                fitted = fit_calibration(method, logits[~held], labels[~held])
                calibrated[held] = apply_calibration(fitted, raw[held])
        else:
            calibrated = apply_calibration(fit_calibration(method, logits, labels), raw)
        scores[method] = {
            "ece": expected_calibration_error(calibrated, labels, n_bins),
            "brier": brier_score(calibrated, labels),
        }
    chosen = min(scores, key=lambda name: (scores[name]["ece"], scores[name]["brier"]))
    calibration = None if chosen == "raw" else fit_calibration(chosen, logits, labels)
    evaluation = (
        f"{folds}-fold cross-fitted by prompt ({len(unique)} prompts)"
        if cross_fit
        else f"in-sample ({len(unique)} prompt(s): too few for {folds} folds)"
    )
    return CalibrationChoice(calibration=calibration, chosen=chosen, scores=scores, evaluation=evaluation)
