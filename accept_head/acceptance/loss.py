"""The acceptance head's training loss: binary cross-entropy on soft labels with class weights (SpecDec++ §3.3).

With σ_i = sigmoid(logit_i) and soft label ℓ_i = min(1, p_i(Y_i) / q_i(Y_i)):

    L = Σ_i [w_acc·ℓ_i·(−log σ_i) + w_rej·(1−ℓ_i)·(−log(1−σ_i))] / Σ_i [w_acc·ℓ_i + w_rej·(1−ℓ_i)]

Most labels sit near 1 (the draft usually agrees with the target), so w_rej > w_acc up-weights the rare rejections.
The normaliser is the total weight, not the number of positions, so the loss is a weighted mean of the two BCE terms.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def check_weights(w_acc: float, w_rej: float) -> None:
    """Raise ValueError unless both class weights are positive (the offending flag is named)."""
    for name, value in (("w_acc", w_acc), ("w_rej", w_rej)):
        if not value > 0:
            raise ValueError(
                f"{name}={value} must be > 0: it weights the {'accepted' if name == 'w_acc' else 'rejected'} class "
                f"of the BCE loss. Set --model.{name} to a positive number (the paper uses w_acc=1, w_rej in 1..12)."
            )


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, w_acc: float = 1.0, w_rej: float = 1.0) -> torch.Tensor:
    """Weighted BCE of acceptance logits against soft labels, normalised by the total weight.

    logits: (M,) raw head outputs; labels: (M,) soft labels in [0, 1]. Returns a scalar. With no positions (M = 0)
    the loss is 0 and still connected to ``logits`` so distributed gradient reduction sees every parameter.
    """
    check_weights(w_acc, w_rej)
    logits = logits.float()
    labels = labels.to(logits.dtype)
    # −log σ(x) = softplus(−x) and −log(1 − σ(x)) = softplus(x), stable for any logit.
    accept_term = w_acc * labels * F.softplus(-logits)
    reject_term = w_rej * (1.0 - labels) * F.softplus(logits)
    total_weight = (w_acc * labels + w_rej * (1.0 - labels)).sum()
    return (accept_term + reject_term).sum() / total_weight.clamp_min(torch.finfo(logits.dtype).tiny)
