"""The distribution check shared by the losslessness tests, and its negative controls.

:func:`goodness_of_fit` is a χ² test of sampled outcomes against probabilities computed exactly from a model; the
broken verifiers below are drop-in replacements for :func:`accept_head.decoding.verify` that a correct check must
reject, so a test that passes with the real verifier and fails with these says something about the decoder.
"""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from accept_head.decoding import verify as correct_verify
from accept_head.sampling import sample

ALPHA = 1e-3
"""A correct decoder passes at this level; the seeds are fixed, so the outcome is deterministic."""


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """χ² p-value of observed ``counts`` against exact ``probs`` (same shape); 0 if an impossible outcome occurred.

    Cells whose expected count is below 5 are pooled into one, as the χ² approximation requires. ``probs`` is
    renormalised in float64, so a float32 table that sums to 1 only up to rounding is fine.
    """
    observed, probs = counts.flatten().double(), probs.flatten().double()
    probs = probs / probs.sum()
    if observed[probs == 0].sum() > 0:
        return 0.0
    expected = probs * observed.sum()
    large = expected >= 5
    observed = torch.cat([observed[large], observed[~large & (probs > 0)].sum()[None]])
    expected = torch.cat([expected[large], expected[~large & (probs > 0)].sum()[None]])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def accept_every_candidate(p, q, candidates, generator):
    """A broken verifier: keeps all K candidates and samples the bonus token (the output follows the draft)."""
    k = candidates.shape[0]
    return k, int(sample(p[k : k + 1], generator)[0])


def resample_from_target_on_rejection(p, q, candidates, generator):
    """A subtly broken verifier: right acceptance test, but it redraws from p instead of Norm[(p − q)+]."""
    m, _ = correct_verify(p, q, candidates, generator)
    return m, int(sample(p[m : m + 1], generator)[0])
