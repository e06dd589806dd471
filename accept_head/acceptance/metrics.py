"""Quality metrics of predicted acceptance probabilities against soft labels ℓ_i = min(1, p_i(Y_i)/q_i(Y_i)).

Every metric treats the label as a probability, never as a hard class, except ``auc_binary``:

* ``weighted_bce`` — the training loss (:func:`accept_head.acceptance.loss.weighted_bce`).
* ``bce`` — plain BCE against the soft labels, −[ℓ log p + (1−ℓ) log(1−p)]; its minimum is the labels' entropy.
* ``brier`` — mean (p − ℓ)².
* ``ece`` — expected calibration error with equal-width bins over p: Σ_b (n_b/N)·|mean p_b − mean ℓ_b|.
* ``auc`` — soft-weighted ROC AUC: each position counts as a positive with weight ℓ and as a negative with weight
  1 − ℓ (for hard labels this is the usual AUC). It is the probability that a random accepted token is scored above
  a random rejected one, with acceptance drawn from the labels.
* ``auc_binary`` — ROC AUC with labels binarised at ℓ ≥ 0.5 (comparable with papers that report hard labels).
* ``mean_pred`` / ``mean_label`` — over-confidence shows as mean_pred > mean_label.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .loss import weighted_bce

ECE_BINS = 15


def _check(probs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs, labels = probs.detach().double().reshape(-1), labels.detach().double().reshape(-1)
    if probs.shape != labels.shape:
        raise ValueError(f"probs {tuple(probs.shape)} and labels {tuple(labels.shape)} must have the same length.")
    return probs, labels


def brier_score(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean squared error between predicted probabilities (M,) and soft labels (M,)."""
    probs, labels = _check(probs, labels)
    return float(((probs - labels) ** 2).mean()) if probs.numel() else math.nan


def soft_bce(probs: torch.Tensor, labels: torch.Tensor, eps: float = 1e-7) -> float:
    """Mean −[ℓ log p + (1−ℓ) log(1−p)] over (M,) probabilities and soft labels (p clipped to [eps, 1−eps])."""
    probs, labels = _check(probs, labels)
    if not probs.numel():
        return math.nan
    p = probs.clamp(eps, 1 - eps)
    return float(-(labels * p.log() + (1 - labels) * (1 - p).log()).mean())


@dataclass
class ReliabilityBins:
    """Per-bin statistics of a reliability diagram over equal-width bins of the predicted probability."""

    edges: list[float]
    """n_bins + 1 bin edges from 0 to 1."""
    count: list[int]
    mean_pred: list[float]
    """Mean predicted probability per bin (nan for empty bins)."""
    mean_label: list[float]
    """Mean soft label per bin (nan for empty bins)."""


def reliability_bins(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = ECE_BINS) -> ReliabilityBins:
    """Bin (M,) predictions into ``n_bins`` equal-width bins on [0, 1] (the last bin includes 1)."""
    if n_bins < 1:
        raise ValueError(f"n_bins={n_bins} must be >= 1.")
    probs, labels = _check(probs, labels)
    index = (probs * n_bins).long().clamp(0, n_bins - 1)
    count = torch.bincount(index, minlength=n_bins)
    sum_pred = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, index, probs)
    sum_label = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, index, labels)
    safe = count.clamp_min(1).double()
    empty = count == 0
    mean_pred = torch.where(empty, torch.full_like(safe, math.nan), sum_pred / safe)
    mean_label = torch.where(empty, torch.full_like(safe, math.nan), sum_label / safe)
    return ReliabilityBins(
        edges=torch.linspace(0, 1, n_bins + 1).tolist(),
        count=count.tolist(),
        mean_pred=mean_pred.tolist(),
        mean_label=mean_label.tolist(),
    )


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = ECE_BINS) -> float:
    """ECE against soft labels: Σ_b (n_b / N)·|mean p_b − mean ℓ_b| over equal-width bins of p."""
    bins = reliability_bins(probs, labels, n_bins)
    total = sum(bins.count)
    if total == 0:
        return math.nan
    return sum(
        n / total * abs(p - y) for n, p, y in zip(bins.count, bins.mean_pred, bins.mean_label, strict=True) if n > 0
    )


def soft_auc(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC where each position is a positive with weight ℓ and a negative with weight 1 − ℓ (nan if a class has
    no weight)."""
    from sklearn.metrics import roc_auc_score

    probs, labels = _check(probs, labels)
    if labels.sum() <= 0 or (1 - labels).sum() <= 0:
        return math.nan
    scores = torch.cat([probs, probs]).numpy()
    truth = torch.cat([torch.ones_like(probs), torch.zeros_like(probs)]).numpy()
    weights = torch.cat([labels, 1 - labels]).numpy()
    return float(roc_auc_score(truth, scores, sample_weight=weights))


def binary_auc(probs: torch.Tensor, labels: torch.Tensor, threshold: float = 0.5) -> float:
    """ROC AUC with labels binarised at ℓ >= ``threshold`` (nan when only one class is present)."""
    from sklearn.metrics import roc_auc_score

    probs, labels = _check(probs, labels)
    truth = (labels >= threshold).numpy()
    if truth.all() or not truth.any():
        return math.nan
    return float(roc_auc_score(truth, probs.numpy()))


def acceptance_metrics(
    logits: torch.Tensor, labels: torch.Tensor, w_acc: float = 1.0, w_rej: float = 1.0, n_bins: int = ECE_BINS
) -> dict[str, float]:
    """All metrics of the module docstring for (M,) head logits against (M,) soft labels, as plain floats."""
    logits, labels = logits.detach().float().reshape(-1), labels.detach().float().reshape(-1)
    probs = torch.sigmoid(logits)
    if not logits.numel():
        return {key: math.nan for key in METRIC_NAMES} | {"positions": 0.0}
    return {
        "weighted_bce": float(weighted_bce(logits, labels, w_acc, w_rej)),
        "bce": soft_bce(probs, labels),
        "brier": brier_score(probs, labels),
        "ece": expected_calibration_error(probs, labels, n_bins),
        "auc": soft_auc(probs, labels),
        "auc_binary": binary_auc(probs, labels),
        "mean_pred": float(probs.double().mean()),
        "mean_label": float(labels.double().mean()),
        "positions": float(logits.numel()),
    }


METRIC_NAMES = ("weighted_bce", "bce", "brier", "ece", "auc", "auc_binary", "mean_pred", "mean_label")
