"""Baseline stop policies (Heuristic, ConfidenceThreshold + HF's ROC tuning, EntropyStop, Oracle) and HF's own
assisted generation: hand-built rounds, stub models with fixed logits, greedy parity with the target, Lemma 2.1, and
the target's distribution at temperature 1 (the χ² check of ``stats_helpers``, which rejects broken verifiers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stats_helpers import ALPHA, accept_every_candidate, goodness_of_fit, resample_from_target_on_rejection
from tiny_models import SPECIAL_TOKENS, TableLM, make_llama, perturbed_copy

import accept_head.chain.decoding as decoding
from accept_head import autoregressive_generate, speculative_generate
from accept_head.chain.baselines import (
    ConfidenceThreshold,
    EntropyStop,
    Heuristic,
    Oracle,
    PathConfidenceStop,
    entropy_lower_bound,
    roc_threshold,
)
from accept_head.chain.hf_assisted import AssistedSettings, HFAssisted, rounds_from_target_passes
from accept_head.chain.policies import RoundState

EOS, PAD = SPECIAL_TOKENS.index("<eos>"), SPECIAL_TOKENS.index("<pad>")
PROMPTS = [[1, 7], [1, 12, 40, 41, 9], [1, 30, 31, 32, 33, 34, 35, 36, 37]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny random Llama target and a lightly perturbed copy as draft (greedy agreement around one half)."""
    target = make_llama(seed=0)
    return target, perturbed_copy(target, relative_noise=0.05, seed=1)


@pytest.fixture(scope="module")
def reference(pair) -> list[torch.Tensor]:
    target, _ = pair
    return [
        target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD) for p in PROMPTS
    ]


# ---- Heuristic -----------------------------------------------------------------------------------------------------


def test_heuristic_follows_hf_schedule_plus_two_on_full_acceptance_minus_one_otherwise() -> None:
    policy = Heuristic(initial_k=5)
    ks = []
    for proposed, accepted in [(5, 5), (7, 3), (6, 0), (5, 5), (7, 6)]:
        ks.append(policy.k)
        policy.update(RoundState(n=proposed), accepted)
    assert ks == [5, 7, 6, 5, 7]
    assert policy.k == 6


def test_heuristic_on_stub_models_grows_by_two_after_full_rounds_and_shrinks_by_one_after_a_rejection() -> None:
    """Greedy stub pair: the draft agrees with the target except on the token after 3, so a round that reaches
    that position is rejected there; K follows HF's schedule round by round (2, 4, 3, 5, 4)."""
    vocab = 6
    target_next = [(t + 1) % vocab for t in range(vocab)]
    draft_next = list(target_next)
    draft_next[3] = 0  # after token 3 the target writes 4, the draft proposes 0
    target = TableLM.bigram(bigram_table(vocab, target_next, [0.9] * vocab), 64)
    draft = TableLM.bigram(bigram_table(vocab, draft_next, [0.9] * vocab), 64)
    policy = Heuristic(initial_k=2)
    result = speculative_generate(target, draft, [0], policy, 16, temperature=0.0)
    assert result.sequences[0].tolist() == [t % vocab for t in range(17)]  # lossless: the target's cycle
    # Round 1 (K=2): 1 2 accepted, bonus 3 -> K=4. Round 2 from 3: 0 1 2 3 proposed, 0 rejected (the target writes 4)
    # -> K=3. Round 3 from 4: 5 0 1 accepted, bonus 2 -> K=5. Round 4 from 2: 3 0 1 2 3 proposed, 3 accepted, 0
    # rejected -> K=4. Round 5 from 4: 5 0 1 2 accepted, bonus 3 -> K=6. Round 6: one token left, no candidate.
    assert result.stats.proposed == [2, 4, 3, 5, 4, 0]
    assert result.stats.accepted == [2, 0, 3, 1, 4, 0]
    assert policy.k == 6  # a round without candidates teaches nothing


def test_heuristic_floor_is_one_and_budget_cut_rounds_teach_nothing() -> None:
    policy = Heuristic(initial_k=2)
    for _ in range(5):
        policy.update(RoundState(n=policy.k), 0)
    assert policy.k == 1
    policy.update(RoundState(n=0), 0)  # the token budget left no room for candidates
    assert policy.k == 1


def test_heuristic_stops_after_k_candidates() -> None:
    policy = Heuristic(initial_k=3)
    assert [policy.should_stop(RoundState(n=n)) for n in range(5)] == [False, False, False, True, True]


def test_heuristic_persistent_keeps_k_across_generations_transient_restarts() -> None:
    persistent, transient = Heuristic(5, persistent=True), Heuristic(5, persistent=False)
    for policy in (persistent, transient):
        policy.update(RoundState(n=5), 5)
        policy.reset()
    assert persistent.k == 7 and transient.k == 5


def test_heuristic_respects_its_cap_and_rejects_bad_arguments() -> None:
    policy = Heuristic(initial_k=5, max_candidates=6)
    policy.update(RoundState(n=5), 5)
    assert policy.k == 6
    with pytest.raises(ValueError, match="initial_k"):
        Heuristic(initial_k=0)


# ---- ConfidenceThreshold and HF's ROC tuning -------------------------------------------------------------------------


def test_confidence_stops_after_the_first_candidate_below_tau() -> None:
    policy = ConfidenceThreshold(tau=0.5)
    assert not policy.should_stop(RoundState(n=0))
    assert not policy.should_stop(RoundState(n=1, token_probs=[0.9]))
    assert policy.should_stop(RoundState(n=2, token_probs=[0.9, 0.4]))
    assert not ConfidenceThreshold(tau=0.5, min_candidates=3).should_stop(RoundState(n=2, token_probs=[0.9, 0.1]))


def test_roc_threshold_separates_perfectly_separable_pairs() -> None:
    assert roc_threshold([0.9, 0.8, 0.7, 0.3, 0.2], [1, 1, 1, 0, 0]) == pytest.approx(0.7)


def test_roc_threshold_matches_hf_update_candidate_strategy_on_hard_labels() -> None:
    """The same computation as transformers' AssistedCandidateGenerator.update_candidate_strategy."""
    from sklearn.metrics import roc_curve

    rng = np.random.default_rng(0)
    probs = rng.uniform(size=200)
    matches = (rng.uniform(size=200) < probs).astype(int)
    fpr, tpr, thresholds = roc_curve(matches, probs)
    hf = thresholds[np.argmin(fpr + 3 * (1 - tpr))]
    assert roc_threshold(probs, matches) == pytest.approx(hf)


def test_roc_threshold_counts_a_soft_label_as_weighted_positive_and_negative() -> None:
    # At tau = 0.6: tpr = 1, fpr = 0.5 / 1.5 -> cost 1/3; at tau = 0.9: fnr = 1/3 -> cost 1; so 0.6 wins.
    assert roc_threshold([0.9, 0.6, 0.3], [1.0, 0.5, 0.0]) == pytest.approx(0.6)


@pytest.mark.parametrize(
    ("probs", "labels", "match"),
    [([0.5], [1, 0], "one label per probability"), ([0.5, 0.6], [1, 1], "only accepted"), ([], [], "at least one")],
)
def test_roc_threshold_rejects_unusable_pairs(probs, labels, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        roc_threshold(probs, labels)


def test_confidence_auto_tune_learns_from_judged_candidates_like_hf() -> None:
    policy = ConfidenceThreshold(tau=0.4, auto_tune=True)
    rounds = [([0.9, 0.8, 0.2, 0.1], 2), ([0.95, 0.3], 1), ([0.7, 0.85, 0.25], 2)]
    for probs, accepted in rounds:
        state = RoundState(n=len(probs), token_probs=list(probs))
        policy.should_stop(state)
        policy.update(state, accepted)
    # Judged pairs: accepted candidates plus the first rejected one of each round (0.1 was never judged).
    assert policy.probs == [0.9, 0.8, 0.2, 0.95, 0.3, 0.7, 0.85, 0.25]
    assert policy.matches == [1, 1, 0, 1, 0, 1, 1, 0]
    assert policy.tau == pytest.approx(0.7)
    policy.reset()
    assert policy.tau == 0.4 and policy.probs == []


def bigram_table(vocab: int, next_token: list[int], confidence: list[float]) -> torch.Tensor:
    """(V, V) logits: after token t the model puts probability ``confidence[t]`` on ``next_token[t]`` and spreads the
    rest evenly."""
    probs = torch.empty(vocab, vocab)
    for t in range(vocab):
        probs[t] = (1 - confidence[t]) / (vocab - 1)
        probs[t, next_token[t]] = confidence[t]
    return probs.log()


def test_confidence_on_stub_models_submits_up_to_the_first_unsure_candidate() -> None:
    """Greedy, draft == target (all accepted): rounds end right after the candidate proposed with q < tau."""
    vocab = 6
    next_token = [(t + 1) % vocab for t in range(vocab)]
    confidence = [0.9, 0.9, 0.3, 0.9, 0.9, 0.9]  # the token after 2 (token 3) is proposed with q = 0.3
    table = bigram_table(vocab, next_token, confidence)
    target, draft = TableLM.bigram(table, 64), TableLM.bigram(table, 64)
    result = speculative_generate(target, draft, [0], ConfidenceThreshold(tau=0.5), 13, temperature=0.0)
    # Sequence 0 1 2 3 4 5 0 1 2 3 ...: candidate 3 is unsure; each round ends with it plus the target's bonus.
    assert result.sequences[0].tolist() == [t % vocab for t in range(14)]
    assert result.stats.proposed == [3, 5, 2]  # the budget cuts the last round
    assert result.stats.accepted == result.stats.proposed
    assert result.stats.discarded == 0


# ---- EntropyStop ---------------------------------------------------------------------------------------------------


def test_entropy_lower_bound_is_one_minus_sqrt_gamma_entropy() -> None:
    assert entropy_lower_bound(1.25, gamma=0.2) == pytest.approx(0.5)
    assert entropy_lower_bound(0.0, gamma=0.2) == 1.0


def test_entropy_stop_stops_when_the_bound_falls_below_lambda() -> None:
    policy = EntropyStop(threshold=0.6, gamma=0.2)
    assert not policy.should_stop(RoundState(n=0))
    assert not policy.should_stop(RoundState(n=1, entropies=[0.5]))  # bound 1 - sqrt(0.1) = 0.684
    assert policy.should_stop(RoundState(n=2, entropies=[0.5, 1.25]))  # bound 0.5
    with pytest.raises(ValueError, match="threshold"):
        EntropyStop(threshold=1.5)


def test_entropy_stop_on_stub_models_reads_the_drafts_entropy() -> None:
    vocab = 6
    next_token = [(t + 1) % vocab for t in range(vocab)]
    confidence = [0.99, 0.99, 0.99, 0.99, 0.4, 0.99]  # the distribution after token 4 is flat-ish
    table = bigram_table(vocab, next_token, confidence)
    high = -(table[4].exp() * table[4]).sum().item()
    low = -(table[0].exp() * table[0]).sum().item()
    # A lambda between the two bounds stops exactly after the candidate drawn from the flat distribution.
    lam = (entropy_lower_bound(high, 0.2) + entropy_lower_bound(low, 0.2)) / 2
    target, draft = TableLM.bigram(table, 64), TableLM.bigram(table, 64)
    result = speculative_generate(target, draft, [0], EntropyStop(lam, gamma=0.2), 13, temperature=0.0)
    assert result.stats.proposed == [5, 5, 0]  # up to token 5 (drawn after 4); the budget leaves no candidate


# ---- PathConfidenceStop ---------------------------------------------------------------------------------------------


def test_path_confidence_stops_once_the_path_probability_falls_below_one_minus_h() -> None:
    policy = PathConfidenceStop(threshold=0.3)
    assert not policy.should_stop(RoundState(n=0))
    assert not policy.should_stop(RoundState(n=1, token_probs=[0.9]))  # 1 - 0.9 = 0.1
    assert not policy.should_stop(RoundState(n=3, token_probs=[0.9, 0.9, 0.9]))  # 1 - 0.729 = 0.271
    assert policy.should_stop(RoundState(n=4, token_probs=[0.9, 0.9, 0.9, 0.9]))  # 1 - 0.656 = 0.344
    assert policy.should_stop(RoundState(n=1, token_probs=[0.5]))
    assert not PathConfidenceStop(0.3, min_candidates=2).should_stop(RoundState(n=1, token_probs=[0.5]))
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="threshold"):
            PathConfidenceStop(threshold=bad)


def test_path_confidence_on_stub_models_multiplies_the_rounds_draft_probabilities() -> None:
    """Greedy, draft == target (all accepted), q = 0.9 everywhere: at h = 0.3 a round stops at its fourth candidate
    (0.9^3 = 0.729 stays above 0.7, 0.9^4 = 0.656 does not); a product of the last q alone would never stop."""
    vocab = 6
    table = bigram_table(vocab, [(t + 1) % vocab for t in range(vocab)], [0.9] * vocab)
    target, draft = TableLM.bigram(table, 64), TableLM.bigram(table, 64)
    result = speculative_generate(target, draft, [0], PathConfidenceStop(0.3), 13, temperature=0.0)
    assert result.sequences[0].tolist() == [t % vocab for t in range(14)]
    assert result.stats.proposed == [4, 4, 2]  # the budget cuts the last round
    assert result.stats.accepted == result.stats.proposed


def test_the_chat_names_path_confidence_and_refuses_a_bad_h() -> None:
    from accept_head.specdecpp.chat import parse_policy

    assert parse_policy("path:0.7", None).threshold == 0.7
    assert parse_policy("path", None).threshold == 0.8
    with pytest.raises(ValueError, match="--policy 'path:1.5'.*threshold=1.5"):
        parse_policy("path:1.5", None)


# ---- Oracle --------------------------------------------------------------------------------------------------------


def test_oracle_stops_right_before_each_mismatch() -> None:
    oracle = Oracle(prompt_length=3, continuation=[10, 11, 12, 13, 14, 15], mismatches=[5, 6])
    decisions = [oracle.should_stop(RoundState(n=n, position=3 + n)) for n in range(6)]
    assert decisions == [False, False, True, True, False, True]
    assert oracle.should_stop(RoundState(n=1, position=8))  # the final token is always the target's
    assert oracle.limit_stats().target_calls == 3  # Lemma 2.1: |S| + 1
    # A decoding that drifted past the continuation (bf16) gets no candidates, not an error.
    assert oracle.should_stop(RoundState(n=0, position=9)) and oracle.should_stop(RoundState(n=0, position=40))


def test_oracle_refuses_another_prompt_and_sampling(pair) -> None:
    target, draft = pair
    oracle = Oracle.from_models(target, draft, PROMPTS[1], MAX_NEW, eos_token_id=EOS)
    with pytest.raises(ValueError, match="built for a prompt of 5 tokens"):
        speculative_generate(target, draft, PROMPTS[0], oracle, MAX_NEW, temperature=0.0, eos_token_id=EOS)
    with pytest.raises(ValueError, match="only defined for greedy decoding"):
        speculative_generate(target, draft, PROMPTS[1], oracle, MAX_NEW, temperature=1.0, eos_token_id=EOS)
    with pytest.raises(ValueError, match="outside"):
        Oracle(prompt_length=3, continuation=[1, 2, 3], mismatches=[5])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_oracle_reaches_lemma_2_1_target_calls_with_zero_discards(pair, prompt: list[int]) -> None:
    target, draft = pair
    oracle = Oracle.from_models(target, draft, prompt, MAX_NEW, eos_token_id=EOS)
    result = speculative_generate(target, draft, prompt, oracle, MAX_NEW, temperature=0.0, eos_token_id=EOS)
    reference = autoregressive_generate(target, prompt, MAX_NEW, temperature=0.0, eos_token_id=EOS)
    assert result.sequences.tolist() == reference.sequences.tolist()
    assert 0 < len(oracle.mismatches) < MAX_NEW - 1  # the pair agrees on some tokens, not all
    assert result.stats.target_calls == len(oracle.mismatches) + 1
    assert result.stats.discarded == 0
    assert sum(result.stats.accepted) == result.stats.generated - result.stats.target_calls
    # Decoding with the oracle costs exactly what Lemma 2.1 counts: one draft step per candidate (a round that starts
    # on a mismatch runs no draft pass), the same rounds, nothing discarded.
    limit = oracle.limit_stats()
    assert 0 in limit.proposed  # these prompts have rounds that submit no candidate
    for field in ("generated", "target_calls", "draft_calls", "discarded", "proposed", "accepted"):
        assert getattr(result.stats, field) == getattr(limit, field), field


@pytest.mark.parametrize("prompt", PROMPTS)
def test_oracle_mismatch_set_matches_a_step_by_step_greedy_draft(pair, prompt: list[int]) -> None:
    """S recomputed independently: the draft run one position at a time (no cache, no batching) on the target's own
    greedy continuation; S holds exactly the positions where its argmax is not the target's next token."""
    target, draft = pair
    oracle = Oracle.from_models(target, draft, prompt, MAX_NEW, eos_token_id=EOS)
    sequence = autoregressive_generate(target, prompt, MAX_NEW, temperature=0.0, eos_token_id=EOS).sequences[0]
    assert sequence[len(prompt) :].tolist() == oracle.continuation
    expected = set()
    with torch.no_grad():
        for position in range(len(prompt), len(sequence) - 1):  # the final token is the target's, never judged
            logits = draft(input_ids=sequence[None, :position]).logits[0, -1]
            if int(logits.argmax()) != int(sequence[position]):
                expected.add(position)
    assert oracle.mismatches == expected


def test_oracle_beats_every_fixed_k_on_target_calls_and_discards(pair) -> None:
    from accept_head import FixedK

    target, draft = pair
    prompt = PROMPTS[2]
    oracle = Oracle.from_models(target, draft, prompt, MAX_NEW, eos_token_id=EOS)
    best = speculative_generate(target, draft, prompt, oracle, MAX_NEW, temperature=0.0, eos_token_id=EOS).stats
    for k in (1, 2, 4, 8):
        stats = speculative_generate(target, draft, prompt, FixedK(k), MAX_NEW, temperature=0.0, eos_token_id=EOS).stats
        assert best.target_calls <= stats.target_calls and best.discarded <= stats.discarded


# ---- losslessness: greedy parity with the target for every new policy ------------------------------------------------

NEW_POLICIES = {
    "Heuristic": lambda: Heuristic(initial_k=5),
    "Heuristic(transient)": lambda: Heuristic(initial_k=2, persistent=False),
    "ConfidenceThreshold(0.5)": lambda: ConfidenceThreshold(tau=0.5),
    "ConfidenceThreshold(auto)": lambda: ConfidenceThreshold(tau=0.4, auto_tune=True),
    "EntropyStop(0.3)": lambda: EntropyStop(threshold=0.3),
    "EntropyStop(0.8)": lambda: EntropyStop(threshold=0.8, gamma=0.5),
    "PathConfidenceStop(0.7)": lambda: PathConfidenceStop(threshold=0.7),
}


@pytest.mark.parametrize("policy_name", list(NEW_POLICIES))
def test_greedy_output_of_new_policies_equals_target_generate(pair, reference, policy_name: str) -> None:
    target, draft = pair
    policy = NEW_POLICIES[policy_name]()
    for prompt, expected in zip(PROMPTS, reference):
        result = speculative_generate(target, draft, prompt, policy, MAX_NEW, temperature=0.0, eos_token_id=EOS)
        assert result.sequences.tolist() == expected.tolist()


# ---- losslessness at temperature 1: the χ² check of test_lossless.py, with its broken-verifier controls --------------

SAMPLED_VOCAB, SAMPLED_TOKENS, SAMPLED_RUNS, CONTROL_RUNS = 4, 3, 2000, 500


@pytest.fixture(scope="module")
def sampled_pair() -> tuple[TableLM, TableLM, torch.Tensor]:
    """A bigram stub pair over 4 tokens whose draft overlaps the target's but differs markedly (candidates are both
    accepted and rejected), and the target's exact law of the first three tokens after token 0, (V, V, V) float64."""
    vocab = SAMPLED_VOCAB
    generator = torch.Generator().manual_seed(0)
    target_table = torch.randn(vocab, vocab, generator=generator)
    draft_table = target_table + 1.5 * torch.randn(vocab, vocab, generator=generator)
    p = target_table.double().softmax(-1)
    exact = p[0][:, None, None] * p[:, :, None] * p[None, :, :]  # P(x1, x2, x3 | token 0) = p(x1|0) p(x2|x1) p(x3|x2)
    return TableLM.bigram(target_table, 8), TableLM.bigram(draft_table, 8), exact


def sampled_counts(target, draft, policy, runs: int) -> tuple[torch.Tensor, set[tuple[int, ...]]]:
    """(V, V, V) counts of the first three sampled tokens over ``runs`` seeded generations (one policy object for all,
    so persistent state such as Heuristic's K carries over), and the distinct per-round candidate counts seen."""
    counts = torch.zeros((SAMPLED_VOCAB,) * SAMPLED_TOKENS)
    rounds = set()
    for i in range(runs):
        generator = torch.Generator().manual_seed(1000 + i)
        result = speculative_generate(target, draft, [0], policy, SAMPLED_TOKENS, temperature=1.0, generator=generator)
        counts[tuple(result.sequences[0, 1:].tolist())] += 1
        rounds.add(tuple(result.stats.proposed))
    return counts, rounds


@pytest.mark.parametrize(
    "policy_name", ["Heuristic", "ConfidenceThreshold(0.5)", "EntropyStop(0.8)", "PathConfidenceStop(0.7)"]
)
def test_sampled_tokens_follow_the_target_distribution(sampled_pair, policy_name: str) -> None:
    """Losslessness at temperature 1: the empirical law of the first three tokens matches p (χ² goodness of fit
    against the law computed exactly from the target's table)."""
    target, draft, exact = sampled_pair
    counts, rounds = sampled_counts(target, draft, NEW_POLICIES[policy_name](), SAMPLED_RUNS)
    assert len(rounds) > 1  # rounds differ between runs: rejections and the policy's stops depend on the draws
    p_value = goodness_of_fit(counts, exact)
    assert p_value > ALPHA, p_value


@pytest.mark.parametrize("broken_verify", [accept_every_candidate, resample_from_target_on_rejection])
def test_the_distribution_check_rejects_a_broken_verifier(sampled_pair, monkeypatch, broken_verify) -> None:
    """Negative controls: the same check, with the baseline that submits the fewest candidates per round here (so the
    verifier's mistakes reach the fewest tokens) and a quarter of the runs, fails a verifier that keeps every candidate
    and one that redraws from p instead of the residual."""
    target, draft, exact = sampled_pair
    monkeypatch.setattr(decoding, "verify", broken_verify)
    counts, _ = sampled_counts(target, draft, NEW_POLICIES["EntropyStop(0.8)"](), CONTROL_RUNS)
    assert goodness_of_fit(counts, exact) < 1e-6


# ---- HF's own assisted generation -----------------------------------------------------------------------------------

HF_SETTINGS = {
    "constant": AssistedSettings(num_assistant_tokens=4),
    "heuristic": AssistedSettings(num_assistant_tokens=5, schedule="heuristic"),
    "confidence": AssistedSettings(num_assistant_tokens=20, confidence_threshold=0.4),
}


@pytest.mark.parametrize("setting", list(HF_SETTINGS))
def test_hf_assisted_greedy_equals_target_generate_and_reports_rounds(pair, reference, setting: str) -> None:
    target, draft = pair
    runner = HFAssisted(target, draft, HF_SETTINGS[setting])
    own = draft.generation_config.to_dict()
    for prompt, expected in zip(PROMPTS, reference):
        result = runner.generate(prompt, MAX_NEW, temperature=0.0, eos_token_id=EOS)
        stats = result.stats
        assert result.sequences.tolist() == expected.tolist()
        assert stats.target_calls == len(stats.proposed)
        # Every round adds its accepted candidates plus one target token.
        assert sum(stats.accepted) + stats.target_calls == stats.generated
        assert stats.discarded == sum(stats.proposed) - sum(stats.accepted)
        if setting == "constant":
            assert max(stats.proposed) <= 4
    assert draft.generation_config.to_dict() == own  # the draft's own config is restored


def test_hf_assisted_matches_our_fixed_k_round_by_round(pair) -> None:
    """Same pair, greedy, constant K: HF's rounds (reconstructed from its target passes) equal our decoder's."""
    from accept_head import FixedK

    target, draft = pair
    ours = speculative_generate(target, draft, PROMPTS[1], FixedK(3), MAX_NEW, temperature=0.0, eos_token_id=EOS)
    theirs = HFAssisted(target, draft, AssistedSettings(3)).generate(PROMPTS[1], MAX_NEW, 0.0, eos_token_id=EOS)
    # HF's assistant also stops drafting at its own EOS; compare the rounds before the first such cut.
    cut = next((i for i, k in enumerate(theirs.stats.proposed) if k < 3), len(theirs.stats.proposed))
    assert cut >= 5
    assert theirs.stats.proposed[:cut] == ours.stats.proposed[:cut]
    assert theirs.stats.accepted[:cut] == ours.stats.accepted[:cut]
    assert theirs.sequences.tolist() == ours.sequences.tolist()


def test_hf_assisted_sampling_is_seeded_by_the_generator_and_leaves_global_rng_alone(pair) -> None:
    target, draft = pair
    runner = HFAssisted(target, draft, AssistedSettings(4))
    state = torch.random.get_rng_state()
    first = runner.generate(PROMPTS[0], 12, temperature=1.0, generator=torch.Generator().manual_seed(3)).sequences
    again = runner.generate(PROMPTS[0], 12, temperature=1.0, generator=torch.Generator().manual_seed(3)).sequences
    assert torch.equal(first, again)
    assert torch.equal(state, torch.random.get_rng_state())


def test_hf_heuristic_k_persists_across_calls_in_the_runner(pair) -> None:
    target, draft = pair
    runner = HFAssisted(target, draft, AssistedSettings(num_assistant_tokens=5, schedule="heuristic"))
    first = runner.generate(PROMPTS[2], MAX_NEW, temperature=0.0).stats.proposed[0]
    second = runner.generate(PROMPTS[2], MAX_NEW, temperature=0.0).stats.proposed[0]
    assert first == 5 and second != 5
    runner.reset()
    assert runner.generate(PROMPTS[2], MAX_NEW, temperature=0.0).stats.proposed[0] == 5


def test_rounds_from_target_passes_reconstructs_proposed_and_accepted() -> None:
    # Prompt of 4; round 1 feeds prompt + 3 candidates and accepts 1 (sequence 4 -> 6); round 2 feeds the last
    # token + 3 candidates from a cache of 5, accepts 3 (6 -> 10); round 3 feeds 1 + 2 and ends at 11 (0 accepted).
    proposed, accepted = rounds_from_target_passes([(0, 7), (5, 4), (9, 3)], prompt_length=4, final_length=11)
    assert proposed == [3, 3, 2] and accepted == [1, 3, 0]


@pytest.mark.parametrize("bad", [{"num_assistant_tokens": 0}, {"schedule": "adaptive"}, {"confidence_threshold": 1}])
def test_assisted_settings_reject_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        AssistedSettings(**bad)
