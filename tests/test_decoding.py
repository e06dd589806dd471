"""Decoders: greedy parity with HF ``generate``, exact accept counts on stub models, EOS, token budget, KV caches."""

from __future__ import annotations

import math
import random

import pytest
import torch
from tiny_models import SPECIAL_TOKENS, TableLM, make_llama, perturbed_copy

from accept_head import (
    AcceptanceHead,
    FixedK,
    HeadThreshold,
    autoregressive_generate,
    speculative_generate,
)
from accept_head.models.drafters import Drafter, DraftStep

EOS, PAD = SPECIAL_TOKENS.index("<eos>"), SPECIAL_TOKENS.index("<pad>")
PROMPTS = [[1, 7], [1, 12, 40, 41, 9], [1, 30, 31, 32, 33, 34, 35, 36, 37], [1, 50, 8, 8, 8, 20, 21]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny random Llama target and a noisy copy of it as the draft (agrees on some tokens, not all)."""
    target = make_llama(seed=0)
    return target, perturbed_copy(target, relative_noise=0.3, seed=1)


@pytest.fixture(scope="module")
def reference(pair) -> list[torch.Tensor]:
    """The target's own greedy ``generate`` output for each prompt."""
    target, _ = pair
    return [
        target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD) for p in PROMPTS
    ]


def random_head(hidden_size: int, seed: int, depth: int = 2) -> AcceptanceHead:
    torch.manual_seed(seed)
    return AcceptanceHead(hidden_size, depth).eval()


GREEDY_POLICIES = {
    "FixedK(1)": lambda draft: FixedK(1),
    "FixedK(3)": lambda draft: FixedK(3),
    "FixedK(8)": lambda draft: FixedK(8),
    **{
        f"HeadThreshold(h={h})": (
            lambda draft, h=h: HeadThreshold(random_head(draft.config.hidden_size, seed=7), threshold=h)
        )
        for h in (0.1, 0.5, 0.9)
    },
}


@pytest.mark.parametrize("policy_name", list(GREEDY_POLICIES))
def test_greedy_output_equals_target_generate(pair, reference, policy_name: str) -> None:
    target, draft = pair
    accepted = discarded = 0
    for prompt, expected in zip(PROMPTS, reference):
        policy = GREEDY_POLICIES[policy_name](draft)
        result = speculative_generate(
            target, draft, torch.tensor([prompt]), policy, max_new_tokens=MAX_NEW, temperature=0, eos_token_id=EOS
        )
        assert result.sequences.tolist() == expected.tolist(), f"prompt {prompt}"
        assert result.stats.generated == expected.shape[1] - len(prompt)
        accepted += sum(result.stats.accepted)
        discarded += result.stats.discarded
    # The pair must exercise both paths of the verifier, or equality would prove little.
    assert accepted > 0 and discarded > 0


def test_greedy_autoregressive_equals_target_generate(pair, reference) -> None:
    target, _ = pair
    for prompt, expected in zip(PROMPTS, reference):
        result = autoregressive_generate(target, prompt, max_new_tokens=MAX_NEW, temperature=0, eos_token_id=EOS)
        assert result.sequences.tolist() == expected.tolist()
        assert result.stats.target_calls == result.stats.generated == expected.shape[1] - len(prompt)


def test_greedy_stops_at_the_same_eos_as_target_generate(pair, reference) -> None:
    target, draft = pair
    prompt = PROMPTS[1]
    eos = int(reference[1][0, len(prompt) + 10])  # a token the target emits mid-way through its answer
    expected = target.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=PAD
    )
    assert expected.shape[1] < len(prompt) + MAX_NEW and int(expected[0, -1]) == eos
    for policy in (FixedK(8), HeadThreshold(random_head(draft.config.hidden_size, seed=7), 0.9)):
        result = speculative_generate(target, draft, [prompt], policy, MAX_NEW, temperature=0, eos_token_id=eos)
        assert result.sequences.tolist() == expected.tolist()


# ---- stub models with fixed logits: exact accept counts -------------------------------------------------------------

VOCAB = 8
PROMPT = [0, 1, 2, 3]
TARGET_SCRIPT = PROMPT + [4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7]


def scripted_pair(draft_script: list[int]) -> tuple[TableLM, TableLM]:
    return TableLM.scripted(TARGET_SCRIPT, VOCAB), TableLM.scripted(draft_script, VOCAB)


def disagree_at(indices: set[int]) -> list[int]:
    """The target's script with a different token at the given sequence indices."""
    return [(t + 1) % VOCAB if i in indices else t for i, t in enumerate(TARGET_SCRIPT)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_equal_to_target_is_always_accepted(temperature: float) -> None:
    target, draft = scripted_pair(TARGET_SCRIPT)
    result = speculative_generate(target, draft, PROMPT, FixedK(3), max_new_tokens=12, temperature=temperature)
    stats = result.stats
    assert result.sequences[0].tolist() == TARGET_SCRIPT[:16]
    # Each round: 3 accepted candidates + the bonus token from p_{K+1}.
    assert stats.proposed == [3, 3, 3] and stats.accepted == [3, 3, 3]
    assert (stats.generated, stats.target_calls, stats.discarded) == (12, 3, 0)
    assert stats.draft_calls == 9  # the last candidate of a round is fed with the next round's first pass


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_disjoint_from_target_is_never_accepted(temperature: float) -> None:
    target, draft = scripted_pair(disagree_at(set(range(len(TARGET_SCRIPT)))))
    result = speculative_generate(target, draft, PROMPT, FixedK(3), max_new_tokens=6, temperature=temperature)
    stats = result.stats
    assert result.sequences[0].tolist() == TARGET_SCRIPT[:10]  # every token is the target's correction
    # The draft is capped by the remaining budget minus the target's own token: 3, 3, 3, 2, 1, 0.
    assert stats.proposed == [3, 3, 3, 2, 1, 0] and stats.accepted == [0] * 6
    assert (stats.generated, stats.target_calls, stats.discarded) == (6, 6, 12)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_partial_agreement_accepts_exactly_the_matching_prefix(temperature: float) -> None:
    # The draft is wrong at sequence indices 6 and 7 (the 3rd and 4th new tokens).
    target, draft = scripted_pair(disagree_at({6, 7}))
    result = speculative_generate(target, draft, PROMPT, FixedK(4), max_new_tokens=10, temperature=temperature)
    stats = result.stats
    assert result.sequences[0].tolist() == TARGET_SCRIPT[:14]
    # Round 1 drafts indices 4-7, keeps 4-5, corrects 6. Round 2 drafts 7-10, index 7 is wrong: corrects 7.
    # Round 3 drafts 8-11, all right, plus the bonus 12. Round 4 has budget for one token: the target's alone.
    assert stats.proposed == [4, 4, 4, 0]
    assert stats.accepted == [2, 0, 4, 0]
    assert (stats.generated, stats.target_calls, stats.discarded) == (10, 4, 6)


def constant_head(hidden_size: int, accept_prob: float) -> AcceptanceHead:
    """A linear probe that predicts ``accept_prob`` for every one-hot hidden state of a :class:`TableLM`."""
    head = AcceptanceHead(hidden_size, depth=0)
    with torch.no_grad():
        head.out.weight.fill_(math.log(accept_prob / (1 - accept_prob)))
        head.out.bias.zero_()
    return head


@pytest.mark.parametrize(
    ("threshold", "min_candidates", "max_candidates", "expected_k"),
    [
        # 1 − 0.9^6 = 0.469 ≤ 0.5 < 1 − 0.9^7 = 0.522: stop once 7 candidates are scored. Scores arrive one step
        # late, so the round holds 8 candidates (the 8th unscored).
        (0.5, 1, 20, 8),
        (0.05, 1, 20, 2),  # 1 − 0.9 = 0.1 > 0.05 after one score: the minimum a late score allows
        (0.05, 5, 20, 5),  # min_candidates forces more
        (0.99, 1, 4, 4),  # max_candidates caps the round
    ],
)
def test_head_threshold_stops_when_rejection_probability_exceeds_threshold(
    threshold: float, min_candidates: int, max_candidates: int, expected_k: int
) -> None:
    script = PROMPT + [4, 5, 6, 7] * 12
    target, draft = TableLM.scripted(script, VOCAB), TableLM.scripted(script, VOCAB)
    policy = HeadThreshold(constant_head(draft.config.hidden_size, 0.9), threshold, min_candidates, max_candidates)
    result = speculative_generate(target, draft, PROMPT, policy, max_new_tokens=3 * (expected_k + 1), temperature=0)
    assert result.stats.proposed == [expected_k] * 3
    assert result.sequences[0].tolist() == script[: len(PROMPT) + 3 * (expected_k + 1)]


def test_head_scores_each_candidate_from_the_pass_that_consumes_it() -> None:
    script = PROMPT + [4, 5, 6, 7] * 6
    target, draft = TableLM.scripted(script, VOCAB), TableLM.scripted(script, VOCAB)
    head = constant_head(draft.config.hidden_size, 0.99)
    doubtful = 8  # the head doubts only the candidate at sequence index 8, i.e. the hidden state of input (8, y)
    with torch.no_grad():
        head.out.weight[0, doubtful * VOCAB + script[doubtful]] = math.log(0.01 / 0.99)
    result = speculative_generate(target, draft, PROMPT, HeadThreshold(head, 0.5), max_new_tokens=7, temperature=0)
    # Candidates sit at indices 4, 5, ...; the score of index 8 arrives with the pass that drafts index 9, so the
    # round stops holding indices 4-9: six candidates, all accepted, plus the bonus token.
    assert result.stats.proposed == [6] and result.stats.accepted == [6]


# ---- EOS, budget, context ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("eos_token_id", [6, [7, 6]])
def test_eos_inside_an_accepted_run_ends_generation(eos_token_id: int | list[int]) -> None:
    target, draft = scripted_pair(TARGET_SCRIPT)  # all accepted; 6 is the 3rd new token
    result = speculative_generate(target, draft, PROMPT, FixedK(8), max_new_tokens=12, eos_token_id=eos_token_id)
    assert result.sequences[0].tolist() == PROMPT + [4, 5, 6]
    stats = result.stats
    assert (stats.generated, stats.target_calls, stats.proposed, stats.accepted) == (3, 1, [8], [3])
    assert stats.discarded == 5  # the candidates drafted after EOS


def test_autoregressive_stops_at_eos() -> None:
    target = TableLM.scripted(TARGET_SCRIPT, VOCAB)
    result = autoregressive_generate(target, PROMPT, max_new_tokens=12, eos_token_id=5)
    assert result.sequences[0].tolist() == PROMPT + [4, 5]
    assert result.stats.generated == result.stats.target_calls == 2


def random_bigram_pair(seed: int, vocab: int = 8, positions: int = 32) -> tuple[TableLM, TableLM]:
    generator = torch.Generator().manual_seed(seed)
    target_logits = 2 * torch.randn(vocab, vocab, generator=generator)
    draft_logits = target_logits + 1.5 * torch.randn(vocab, vocab, generator=generator)
    return TableLM.bigram(target_logits, positions), TableLM.bigram(draft_logits, positions)


def test_max_new_tokens_is_never_exceeded_and_stats_add_up() -> None:
    rng = random.Random(0)
    for seed in range(150):
        target, draft = random_bigram_pair(seed)
        prompt = [rng.randrange(8) for _ in range(rng.randint(1, 5))]
        max_new = rng.randint(0, 20)
        if rng.random() < 0.5:
            policy = FixedK(rng.randint(1, 10))
        else:
            head = AcceptanceHead(draft.config.hidden_size, depth=1)
            policy = HeadThreshold(head, rng.uniform(0.05, 0.95), rng.randint(1, 3), rng.randint(3, 12))
        eos = rng.randrange(8) if rng.random() < 0.3 else None
        temperature = rng.choice([0.0, 0.7, 1.0])
        result = speculative_generate(
            target, draft, prompt, policy, max_new, temperature=temperature, eos_token_id=eos,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        new = result.sequences[0, len(prompt) :].tolist()
        stats = result.stats
        case = f"seed={seed} policy={policy.describe()} max_new={max_new} eos={eos}"
        assert result.sequences[0, : len(prompt)].tolist() == prompt, case
        assert len(new) == stats.generated <= max_new, case
        if eos is None or eos not in new:
            assert len(new) == max_new, case
        else:
            assert new.index(eos) == len(new) - 1, case
        assert len(stats.proposed) == len(stats.accepted) == stats.target_calls, case
        assert all(0 <= a <= k <= policy.max_candidates for a, k in zip(stats.accepted, stats.proposed)), case
        assert stats.discarded == sum(stats.proposed) - sum(stats.accepted), case


def test_generation_is_clipped_to_the_model_context() -> None:
    target, draft = random_bigram_pair(0, positions=12)
    for decode in (
        lambda: speculative_generate(target, draft, [1, 2, 3], FixedK(4), max_new_tokens=50),
        lambda: autoregressive_generate(target, [1, 2, 3], max_new_tokens=50),
    ):
        assert decode().sequences.shape == (1, 12)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt_len", [3, 20])
def test_a_draft_with_a_shorter_context_never_shortens_the_output(temperature: float, prompt_len: int) -> None:
    """Only the target's context bounds the output: a draft that can read 16 positions drafts fewer candidates as it
    runs out of room, then none, and the target writes the rest alone (a prompt longer than the draft's context
    included). The stub draft raises IndexError if it is ever fed past its 16 positions."""
    generator = torch.Generator().manual_seed(0)
    target_logits = 2 * torch.randn(8, 8, generator=generator)
    target = TableLM.bigram(target_logits, 64)
    draft = TableLM.bigram(target_logits + 0.5 * torch.randn(8, 8, generator=generator), 16)
    prompt = [i % 8 for i in range(prompt_len)]
    result = speculative_generate(
        target, draft, prompt, FixedK(4), max_new_tokens=30, temperature=temperature,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    assert result.stats.generated == 30 and result.sequences.shape == (1, prompt_len + 30)
    if temperature == 0:
        reference = autoregressive_generate(target, prompt, max_new_tokens=30, temperature=0)
        assert torch.equal(result.sequences, reference.sequences)
    # The draft drafted while it had room and stopped exactly at its context: K candidates read length + K − 1.
    assert sum(result.stats.proposed) > 0 if prompt_len < 16 else sum(result.stats.proposed) == 0


# ---- KV caches ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [1, 6])
@pytest.mark.parametrize("policy_name", ["FixedK(3)", "HeadThreshold(h=0.5)"])
def test_kv_caches_are_extended_never_re_encoded(prompt_len: int, policy_name: str) -> None:
    target, draft = random_bigram_pair(3)
    policy = GREEDY_POLICIES[policy_name](draft)
    prompt = list(range(prompt_len))
    result = speculative_generate(
        target, draft, prompt, policy, max_new_tokens=20, generator=torch.Generator().manual_seed(0)
    )
    sequence, stats = result.sequences[0].tolist(), result.stats
    assert stats.discarded > 0 and sum(stats.accepted) > 0
    # The target sees the prompt but its last token once, then per round [last token, y_1..y_K] — nothing else.
    assert target.fed == ([prompt_len - 1] if prompt_len > 1 else []) + [k + 1 for k in stats.proposed]
    assert sum(target.fed) == prompt_len - 1 + sum(k + 1 for k in stats.proposed)
    # After the last crop the target's cache holds exactly the final sequence but its last token.
    assert target.cached_tokens() == sequence[:-1]
    # The draft consumes each kept token once; only rejected candidates it had already consumed are fed in vain.
    assert draft.cached_tokens() == sequence[: len(draft.cached_tokens())]
    assert sum(draft.fed) <= len(sequence) + stats.discarded
    assert draft.calls == stats.draft_calls


def test_kv_caches_of_hf_models_are_never_re_encoded(pair) -> None:
    target, draft = pair
    fed = {"target": [], "draft": []}
    hooks = [
        model.register_forward_pre_hook(
            lambda module, args, kwargs, name=name: fed[name].append(kwargs["input_ids"].shape[1]), with_kwargs=True
        )
        for name, model in (("target", target), ("draft", draft))
    ]
    try:
        prompt = PROMPTS[2]
        result = speculative_generate(target, draft, prompt, FixedK(3), max_new_tokens=MAX_NEW, temperature=0)
    finally:
        for hook in hooks:
            hook.remove()
    stats = result.stats
    assert fed["target"] == [len(prompt) - 1] + [k + 1 for k in stats.proposed]
    assert len(fed["draft"]) == stats.draft_calls
    assert sum(fed["draft"]) <= result.sequences.shape[1] + stats.discarded


def test_stats_report_time_split_and_rates() -> None:
    target, draft = random_bigram_pair(1)
    policy = GREEDY_POLICIES["HeadThreshold(h=0.5)"](draft)
    stats = speculative_generate(target, draft, [1, 2], policy, 16, generator=torch.Generator().manual_seed(0)).stats
    assert stats.draft_time > stats.head_time > 0 and stats.target_time > 0  # head time is part of draft time
    assert stats.total_time >= stats.draft_time + stats.target_time
    assert stats.verification_rate == stats.target_calls / stats.generated
    assert stats.discard_rate == stats.discarded / stats.generated
    assert set(stats.to_dict()) >= {"generated", "target_calls", "draft_calls", "discarded", "verification_rate"}


def test_same_seed_gives_same_sample_and_different_seeds_differ() -> None:
    target, draft = random_bigram_pair(2)

    def run(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return speculative_generate(target, draft, [1], FixedK(3), 20, generator=generator).sequences[0].tolist()

    assert run(0) == run(0)
    assert len({tuple(run(seed)) for seed in range(5)}) > 1


def test_decode_stats_add_up_into_the_pooled_counts_of_several_runs() -> None:
    from dataclasses import dataclass

    from accept_head.chain.decoding import DecodeStats
    from accept_head.engine.runner import aggregate
    from accept_head.learning_free.ouroboros import OuroborosStats
    from accept_head.trees.verify import TreeDecodeStats

    a, b = DecodeStats(), DecodeStats()
    a.record_round(proposed=4, accepted=2, committed=3)
    b.record_round(proposed=2, accepted=2, committed=3)
    b.record_round(proposed=3, accepted=0, committed=1)
    a.total_time, b.total_time, a.draft_calls = 0.5, 1.5, 5
    total = sum([a, b], DecodeStats())
    assert (total.generated, total.target_calls, total.discarded, total.draft_calls) == (7, 3, 5, 5)
    assert total.proposed == [4, 2, 3] and total.accepted == [2, 2, 0]
    assert total.total_time == pytest.approx(2.0) and total.tokens_per_second == pytest.approx(3.5)
    assert a.generated == 3 and b.proposed == [2, 3]  # the parts are left as they were
    pooled = aggregate("x", [a, b])
    assert (pooled.rounds, pooled.mean_proposed, pooled.verification_rate) == (3, 3.0, pytest.approx(3 / 7))

    # A tree decoder's per-call lists survive the sum; a plain start value takes the more specific type.
    t, o = TreeDecodeStats(), OuroborosStats()
    t.record_tree_round(fed=9, rows=3, proposed=2, accepted=1, committed=2)
    o.record_tree_round(fed=5, rows=2, proposed=1, accepted=1, committed=2)
    o.drafted.append(4)
    trees = sum([t, o], DecodeStats())
    assert type(trees) is OuroborosStats and trees.fed == [9, 5] and trees.rows == [3, 2] and trees.drafted == [4]

    @dataclass
    class OtherStats(DecodeStats):
        extra: int = 0

    with pytest.raises(TypeError, match="TreeDecodeStats and OtherStats"):
        t + OtherStats()


class _Scripted(Drafter):
    """Proposes fixed steps, each either over the whole vocabulary or over its support only."""

    def __init__(self, steps: list[DraftStep]) -> None:
        self.vocab_size, self.steps = steps[0].vocab_size, iter(steps)

    def propose(self, token):
        return next(self.steps, None)


class _AllStats(FixedK):
    uses_draft_stats = uses_confidence = True


@pytest.mark.parametrize("settings", [(0.0, None, None), (1.0, None, None), (0.7, 5, None), (1.3, None, 0.8)])
def test_a_drafter_support_draws_what_the_whole_vocabulary_draws(settings) -> None:
    """A step given over its support (ascending ids, −inf elsewhere) draws the same candidates from the same seed,
    gives verification the same q rows and the head the same inputs as the step over the whole vocabulary; greedy
    ties go to the smallest id, as a full-vocabulary argmax breaks them."""
    from accept_head.chain.decoding import DecodeStats, draft_round
    from accept_head.core.sampling import SamplingConfig

    vocab, gen = 60, torch.Generator().manual_seed(3)
    support = torch.randperm(vocab, generator=gen)[:25].sort().values
    rows = (torch.randn(4, 25, generator=gen) * 2).round()  # coarse values: many ties
    rows[0, [3, 17]] = rows[0].max() + 1  # a tie for the maximum
    full = torch.full((4, vocab), float("-inf")).index_copy(1, support, rows)
    sparse = [DraftStep(None, None, support=support, support_logits=r, vocab_size=vocab) for r in rows]
    dense = [DraftStep(f, None) for f in full]
    assert torch.equal(sparse[1].logits, full[1])
    sampling = SamplingConfig(*settings)
    results = []
    for steps in (dense, sparse):
        state, q_rows = draft_round(
            _Scripted(steps), _AllStats(4), sampling, 4, 0, torch.Generator().manual_seed(11), DecodeStats()
        )
        results.append((state, torch.stack(q_rows)))
    (a, qa), (b, qb) = results
    assert a.candidates == b.candidates and len(a.candidates) == 4
    if sampling.greedy:
        assert a.candidates[0] == int(support[3])
    torch.testing.assert_close(qa, qb, rtol=1e-6, atol=1e-7)
    for name in ("token_probs", "entropies", "draft_logps", "top1s"):
        torch.testing.assert_close(torch.tensor(getattr(a, name)), torch.tensor(getattr(b, name)), rtol=1e-5, atol=1e-5)


class _Counting(_Scripted):
    """Counts the draft forwards asked of it."""

    def __init__(self, steps: list[DraftStep]) -> None:
        super().__init__(steps)
        self.calls = 0

    def propose(self, token):
        self.calls += 1
        return super().propose(token)


def test_a_head_of_the_drafts_numbers_scores_each_candidate_as_it_is_drawn() -> None:
    """A head that reads no hidden state scores y_n as soon as y_n is drawn, from the numbers the round recorded:
    every stop decision reads every drafted candidate's score, so a round can end after its first candidate on the
    head's word alone, without the draft forward a hidden-state head would wait for."""
    from accept_head.chain.decoding import DecodeStats, draft_round
    from accept_head.core.sampling import SamplingConfig

    head = AcceptanceHead(8, 1, ["logq", "entropy", "depth"])
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(4))
    rows = torch.randn(5, 30, generator=torch.Generator().manual_seed(2)) * 2
    sampling = SamplingConfig(1.0)

    def run(threshold: float):
        policy = HeadThreshold(head, threshold, min_candidates=1)
        assert policy.scores_at_draw and not policy.uses_hidden
        policy.reset()
        drafter = _Counting([DraftStep(row, None) for row in rows])  # no hidden state at all
        state, _ = draft_round(drafter, policy, sampling, 5, 0, torch.Generator().manual_seed(9), DecodeStats())
        return state, drafter.calls

    state, calls = run(0.999999)
    assert state.n == 5 and calls == 5 and len(state.accept_probs) == 5
    for k, score in enumerate(state.accept_probs):
        inputs = [state.draft_logps[k], state.entropies[k], float(k + 1)]
        assert score == pytest.approx(head.accept_prob_one(None, inputs), abs=1e-12)
    first = state.accept_probs[0]
    state, calls = run(1.0 - first - 1e-6)  # y_1's own score already says stop
    assert state.n == 1 and calls == 1 and state.accept_probs == [first]


def test_a_head_that_reads_no_spread_costs_the_decoder_no_pass_over_the_vocabulary() -> None:
    """A head on log q, depth and path log q (no entropy, no top-1) gets from the decoder the log q the full
    computation gives, bit for bit, while the entropy and top-1 it never reads are not computed (NaN)."""
    from accept_head.acceptance.inputs import draft_stats
    from accept_head.chain.decoding import DecodeStats, draft_round
    from accept_head.core.sampling import SamplingConfig, probabilities

    head = AcceptanceHead(8, 1, ["logq", "depth", "path_logq"])
    rows = torch.randn(4, 30, generator=torch.Generator().manual_seed(6)) * 2
    for sampling in (SamplingConfig(1.0), SamplingConfig(0.0)):
        policy = HeadThreshold(head, 0.999999, min_candidates=1)
        assert policy.scores_at_draw and not policy.uses_spread
        policy.reset()
        drafter = _Counting([DraftStep(row, None) for row in rows])
        state, _ = draft_round(drafter, policy, sampling, 4, 0, torch.Generator().manual_seed(1), DecodeStats())
        assert state.n == 4 and all(math.isnan(x) for x in state.entropies + state.top1s)
        logq, _, _ = draft_stats(rows, probabilities(rows, sampling), torch.tensor(state.candidates), sampling.greedy)
        assert state.draft_logps == logq.tolist()
        path = 0.0
        for k, score in enumerate(state.accept_probs):
            path += state.draft_logps[k]
            assert score == pytest.approx(head.accept_prob_one(None, [state.draft_logps[k], k + 1.0, path]), abs=1e-12)


def test_greedy_verification_from_the_argmax_equals_speculative_sampling_over_one_hot_distributions() -> None:
    """The chain's greedy rounds verify from the target's argmax alone (``verify_argmax``): the same accepted count
    and next token as ``verify`` over the one-hot p and q greedy decoding defines — ties (the first maximum wins)
    and rounds accepted whole, rejected at once or without candidates included."""
    from accept_head.chain.decoding import verify, verify_argmax
    from accept_head.core.sampling import SamplingConfig, probabilities

    g = torch.Generator().manual_seed(0)
    greedy = SamplingConfig(0.0)
    outcomes = set()
    for trial in range(300):
        k, vocab = trial % 5, 7
        logits = torch.randint(0, 4, (k + 1, vocab), generator=g).to(torch.bfloat16)  # small ints: many ties
        picks = logits.float().argmax(-1).tolist()
        keep = int(torch.randint(0, k + 1, (1,), generator=g))  # candidates equal the argmax up to here, then not
        candidates = [picks[i] if i < keep else (picks[i] + 1) % vocab for i in range(k)]
        q = torch.nn.functional.one_hot(torch.tensor(candidates, dtype=torch.long), vocab).float()
        want = verify(probabilities(logits, greedy), q, torch.tensor(candidates, dtype=torch.long), g)
        assert verify_argmax(logits, candidates) == want
        outcomes.add((want[0] == k, want[0] == 0))
    assert outcomes == {(True, True), (True, False), (False, True), (False, False)}
