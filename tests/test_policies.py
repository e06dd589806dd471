"""FixedK and HeadThreshold as pure functions of the round state (SpecDec++ Alg. 2)."""

from __future__ import annotations

import math

import pytest
import torch

from accept_head import AcceptanceHead, Calibration, FixedK, HeadThreshold, RoundState
from accept_head.acceptance.inputs import INPUTS
from accept_head.chain.policies import round_inputs


def head_with_accept_prob(prob: float, hidden_size: int = 4) -> AcceptanceHead:
    """A linear probe that predicts ``prob`` for every hidden state."""
    head = AcceptanceHead(hidden_size, depth=0)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(math.log(prob / (1 - prob)))
    return head


@pytest.mark.parametrize("k", [1, 3, 8])
def test_fixed_k_stops_after_exactly_k_candidates(k: int) -> None:
    policy = FixedK(k)
    assert [policy.should_stop(RoundState(n=n)) for n in range(k + 2)] == [False] * k + [True, True]
    assert policy.max_candidates == k and not policy.uses_hidden


@pytest.mark.parametrize(
    ("accept_probs", "threshold", "stop"),
    [
        ([0.4], 0.5, True),  # P(some rejection) = 0.6 > 0.5
        ([0.6], 0.5, False),  # 0.4
        ([0.8, 0.7], 0.5, False),  # 1 − 0.56 = 0.44
        ([0.8, 0.6], 0.5, True),  # 1 − 0.48 = 0.52
        ([0.99] * 10, 0.1, False),  # 1 − 0.99^10 = 0.096
        ([0.99] * 11, 0.1, True),  # 1 − 0.99^11 = 0.105
    ],
)
def test_head_threshold_stops_when_some_candidate_is_likely_rejected(
    accept_probs: list[float], threshold: float, stop: bool
) -> None:
    policy = HeadThreshold(head_with_accept_prob(0.5), threshold)
    state = RoundState(n=len(accept_probs) + 1, accept_probs=accept_probs)  # the newest candidate is unscored
    assert policy.should_stop(state) is stop


def test_head_threshold_never_stops_before_a_candidate_is_scored_or_below_min_candidates() -> None:
    policy = HeadThreshold(head_with_accept_prob(0.5), 0.01, min_candidates=3)
    assert not policy.should_stop(RoundState(n=0))
    assert not policy.should_stop(RoundState(n=1))  # y_1 drafted, no score yet
    assert not policy.should_stop(RoundState(n=2, accept_probs=[0.01]))  # below min_candidates
    assert policy.should_stop(RoundState(n=3, accept_probs=[0.01, 0.01]))


def test_unscored_confidence_lets_a_round_stop_after_one_unsure_candidate() -> None:
    plain = HeadThreshold(head_with_accept_prob(0.5), 0.5)
    hybrid = HeadThreshold(head_with_accept_prob(0.5), 0.5, unscored="confidence")
    assert hybrid.uses_confidence and not plain.uses_confidence
    unsure, sure = RoundState(n=1, token_probs=[0.3]), RoundState(n=1, token_probs=[0.9])
    assert not plain.should_stop(unsure)  # Alg. 2: y_1 has no score, so the round always goes on
    assert hybrid.should_stop(unsure)  # 1 − 0.3 > 0.5
    assert not hybrid.should_stop(sure)  # 1 − 0.9 < 0.5
    # Scored candidates use the head; only the unscored newest one uses q_n(y_n): 1 − 0.9·0.6 = 0.46 < 0.5.
    assert not hybrid.should_stop(RoundState(n=2, accept_probs=[0.9], token_probs=[0.1, 0.6]))
    assert hybrid.should_stop(RoundState(n=2, accept_probs=[0.9], token_probs=[0.99, 0.5]))  # 1 − 0.45
    assert not hybrid.should_stop(RoundState(n=0))
    assert hybrid.describe() == "HeadThreshold(h=0.5, unscored=confidence)"
    with pytest.raises(ValueError, match="unscored='entropy'"):
        HeadThreshold(head_with_accept_prob(0.5), 0.5, unscored="entropy")


def test_head_threshold_scores_hidden_states_with_its_head_and_calibration() -> None:
    hidden = torch.randn(4)
    assert HeadThreshold(head_with_accept_prob(0.8), 0.5).score(hidden) == pytest.approx(0.8)
    calibrated = HeadThreshold(head_with_accept_prob(0.8), 0.5, calibration=Calibration("temperature", 2.0))
    # sigmoid(logit(0.8) / 2) = 2 / 3
    assert calibrated.score(hidden) == pytest.approx(2 / 3)
    assert HeadThreshold(head_with_accept_prob(0.8), 0.5).uses_hidden


def test_copy_aware_rules_switch_when_a_copy_waits_below_the_chain() -> None:
    """``copy_k`` / ``copy_threshold`` apply exactly when ``state.copy_below`` (a copied row would follow the chain),
    in either direction; the plain rules never read it."""
    shorter, longer = FixedK(4, copy_k=1), FixedK(2, copy_k=5)
    assert shorter.uses_copies and shorter.max_candidates == 4 and longer.max_candidates == 5
    assert [shorter.should_stop(RoundState(n=n)) for n in range(5)] == [False] * 4 + [True]
    assert [shorter.should_stop(RoundState(n=n, copy_below=True)) for n in range(3)] == [False, True, True]
    assert [longer.should_stop(RoundState(n=n, copy_below=True)) for n in range(2, 6)] == [False] * 3 + [True]
    assert longer.should_stop(RoundState(n=2))
    assert not FixedK(4).uses_copies and not FixedK(4).should_stop(RoundState(n=1, copy_below=True))
    aware = HeadThreshold(head_with_accept_prob(0.5), 0.9, copy_threshold=0.3)
    plain = HeadThreshold(head_with_accept_prob(0.5), 0.9)
    for copy_below in (False, True):
        state = RoundState(n=2, accept_probs=[0.6], copy_below=copy_below)  # P(some rejection) = 0.4
        assert aware.should_stop(state) is copy_below
        assert not plain.should_stop(state)
    assert aware.uses_copies and not plain.uses_copies
    assert aware.describe() == "HeadThreshold(h=0.9, copy h=0.3)"
    assert FixedK(4, copy_k=1).describe() == "FixedK(k=4, copy_k=1)"
    with pytest.raises(ValueError, match="copy_k=0 must be an integer >= 1"):
        FixedK(4, copy_k=0)
    with pytest.raises(ValueError, match=r"copy_threshold=1.5 must be in \(0, 1\)"):
        HeadThreshold(head_with_accept_prob(0.5), 0.5, copy_threshold=1.5)


def test_policies_describe_their_settings() -> None:
    assert FixedK(4).describe() == "FixedK(k=4)"
    assert HeadThreshold(head_with_accept_prob(0.5), 0.7).describe() == "HeadThreshold(h=0.7)"


def test_a_head_with_scalar_inputs_is_handed_those_of_the_latest_candidate() -> None:
    """After y_3 is fed, the head scores y_3: its log q, entropy and top-1, depth 3 and log q(y_1) + ... + log q(y_3)
    — not y_2's or y_4's numbers, nor a 0-based depth or a path that leaves y_3 out."""
    state = RoundState(
        n=3,
        candidates=[5, 6, 7],
        draft_logps=[-0.5, -1.25, -2.0],
        entropies=[1.0, 2.0, 3.0],
        top1s=[0.7, 0.6, 0.5],
        accept_probs=[0.9, 0.8],
    )
    assert round_inputs(state, INPUTS[1:]) == [-2.0, 3.0, 0.5, 3.0, -3.75]
    assert round_inputs(state, ("path_logq", "logq")) == [-3.75, -2.0]
    head = AcceptanceHead(4, 0, ["hidden", "depth", "path_logq"])
    seen = []
    head.accept_prob_one = lambda hidden, scalars: seen.append(scalars) or 0.5
    policy = HeadThreshold(head, 0.5)
    assert policy.uses_draft_stats and not HeadThreshold(head_with_accept_prob(0.5), 0.5).uses_draft_stats
    assert policy.score(torch.zeros(4), state) == 0.5 and seen == [[3.0, -3.75]]
    with pytest.raises(ValueError, match=r"reads \['depth', 'path_logq'\]: score\(hidden, state\) needs the round"):
        policy.score(torch.zeros(4))
