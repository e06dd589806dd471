"""The measured cost line t_target(K) = a + b·K never falls: a noisy, flat timing curve must not price the wide calls
of the learning-free decoders (tens of tokens, extrapolated) at nothing or below nothing."""

from __future__ import annotations

import pytest

from accept_head.core.costs import CostModel, fit_linear


def test_a_falling_fit_becomes_the_flat_line_through_the_mean() -> None:
    ks, times = [1, 2, 4], [1.02e-3, 0.99e-3, 0.93e-3]  # flat up to noise (a tiny model, or a GPU)
    a, b, r2 = fit_linear(ks, times)
    assert b == 0.0 and r2 == 0.0 and a == pytest.approx(sum(times) / 3)
    cost = CostModel(t_draft=1e-3, t_target_a=a, t_target_b=b)
    wide = [cost.modeled_tokens_per_second(30, 0, [fed - 1] * 20) for fed in (5, 45, 81)]
    assert all(w > 0 for w in wide) and wide[0] == wide[1] == wide[2]  # a tree of 81 tokens is not free


def test_a_rising_fit_is_the_least_squares_line() -> None:
    a, b, r2 = fit_linear([1, 2, 3, 4], [1.0, 1.1, 1.2, 1.3])
    assert a == pytest.approx(0.9) and b == pytest.approx(0.1) and r2 == pytest.approx(1.0)
