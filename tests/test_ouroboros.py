"""Ouroboros: phrase-by-phrase drafting, lengthening with pool phrases, one-pass tree verification.

Greedy output must equal the target's autoregressive greedy output for drafts unlike the target, close to it and
identical to it; the draft's phrase-level drafting must reproduce the draft's own greedy continuation whatever the
pool holds; the pool's LRU, inspiration, refinement and warm start are checked on hand-built examples; sampled
decoding must keep the target's distribution (χ², slow) and a broken acceptance must be caught. Tiny float32 Llamas
only, no network.
"""

from __future__ import annotations

import copy

import pytest
import torch
from stats_helpers import ALPHA, accept_first_guess, exact_joint, pair_p_values, sampled_tokens
from tiny_models import make_llama, make_tokenizer, near_bigram, perturbed_copy, small_vocab_llama
from transformers import LlamaForCausalLM

import accept_head.learning_free.ouroboros as ouroboros
from accept_head import (
    ModelDrafter,
    PhrasePool,
    TreeDecodeStats,
    autoregressive_generate,
    ouroboros_generate,
)
from accept_head.learning_free.ouroboros import (
    PhraseDraft,
    candidate_tree,
    inspiration_phrases,
    lengthening_phrases,
    refine_pool,
    vocab_fingerprint,
)

PROMPTS = [[1, 12, 40, 41, 9, 12, 40, 41, 9, 12, 40], [2, 30, 31, 32, 30, 31, 32, 30, 31], [5, 7, 7, 7, 7, 8, 9, 7]]
MAX_NEW = 32
V = len(make_tokenizer())  # 88: the tiny models' vocabulary


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    """Near-bigram (see ``tiny_models.near_bigram``): phrases seen once recur and the pool's guesses are often right."""
    return near_bigram(make_llama(seed=0))


@pytest.fixture(scope="module")
def drafts(target) -> dict[str, torch.nn.Module]:
    return {
        "other": make_llama(seed=1, num_layers=1, hidden_size=16),  # an unrelated draft: almost nothing accepted
        "noisy": perturbed_copy(target, relative_noise=0.1),  # agrees with the target often, not always
        "copy": copy.deepcopy(target),  # agrees always: every sentence draft is accepted whole
    }


@pytest.fixture(scope="module")
def references(target) -> list[list[int]]:
    return [autoregressive_generate(target, p, MAX_NEW, temperature=0).sequences[0].tolist() for p in PROMPTS]


# ----------------------------------------------------------------------------------------------------------------
# Greedy equality with autoregressive greedy decoding

SETTINGS = {
    "γ=1 β=2 W=1 K=1": dict(gamma=1, phrase_length=2, phrases_per_token=1, candidates=1),
    "γ=4 β=3 W=4 K=3": dict(gamma=4, phrase_length=3, phrases_per_token=4, candidates=3),
    "γ=8 β=4 W=5 K=6 prompt": dict(gamma=8, phrase_length=4, phrases_per_token=5, candidates=6, prompt_phrases=True),
    "γ=6 β=6 W=2 K=2": dict(gamma=6, phrase_length=6, phrases_per_token=2, candidates=2),
}


def check_stats(stats, budget: int = MAX_NEW) -> None:
    assert isinstance(stats, TreeDecodeStats)
    assert stats.generated == budget == stats.target_calls + sum(stats.accepted)  # no EOS: m + 1 per call
    calls = stats.target_calls
    assert (
        len(stats.proposed) == len(stats.accepted) == len(stats.fed) == len(stats.rows) == len(stats.drafted) == calls
    )
    assert all(0 <= a <= p for a, p in zip(stats.accepted, stats.proposed))
    assert stats.discarded == sum(stats.proposed) - sum(stats.accepted)
    assert 0 < stats.draft_calls <= sum(stats.drafted)  # each draft forward yields at least one token


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("draft_name", ["other", "noisy", "copy"])
def test_greedy_equals_autoregressive(target, drafts, references, draft_name: str, setting: str) -> None:
    pool = PhrasePool(SETTINGS[setting]["phrase_length"], SETTINGS[setting]["phrases_per_token"], V)
    accepted = 0
    for prompt, reference in zip(PROMPTS, references):  # one pool across prompts: warm start as it is used
        result = ouroboros_generate(target, drafts[draft_name], prompt, MAX_NEW, 0, pool=pool, **SETTINGS[setting])
        assert result.sequences[0].tolist() == reference, prompt
        check_stats(result.stats)
        accepted += sum(result.stats.accepted)
        if draft_name == "copy":  # the draft is the target: the whole sentence draft is accepted every round
            stats = result.stats
            assert all(a >= d for a, d in zip(stats.accepted, stats.drafted)), (stats.accepted, stats.drafted)
    if draft_name != "other":
        assert accepted > 0  # the accept path ran, not only the target's own token


def test_a_draft_with_a_shorter_context_does_not_shorten_the_output(target, drafts, references) -> None:
    """The target's context alone bounds the output: a draft that reads 12 positions drafts while it has room and
    the target writes the rest alone, still its own greedy text."""
    draft = copy.deepcopy(drafts["copy"])
    draft.config.max_position_embeddings = 12
    for prompt, reference in zip(PROMPTS, references):
        result = ouroboros_generate(target, draft, prompt, max_new_tokens=MAX_NEW, temperature=0)
        assert result.sequences[0].tolist() == reference, prompt


def test_copy_draft_gains_from_phrases_and_lengthening(target, drafts, references) -> None:
    """With draft = target and a pool warmed on the same prompt, phrases both speed up drafting (fewer draft
    forwards than drafted tokens) and lengthen drafts beyond γ (a row longer than the sentence draft wins)."""
    pool = PhrasePool(3, 4, V)
    settings = dict(gamma=4, phrase_length=3, phrases_per_token=4, candidates=3, pool=pool)
    cold = ouroboros_generate(target, drafts["copy"], PROMPTS[1], MAX_NEW, 0, **settings)
    warm = ouroboros_generate(target, drafts["copy"], PROMPTS[1], MAX_NEW, 0, **settings)
    assert cold.sequences[0].tolist() == warm.sequences[0].tolist() == references[1]
    assert warm.stats.draft_calls < sum(warm.stats.drafted)
    assert warm.stats.draft_calls < cold.stats.draft_calls
    assert any(a > d for a, d in zip(warm.stats.accepted, warm.stats.drafted))
    assert warm.stats.target_calls < MAX_NEW / 4  # more than γ tokens per target call on average


def test_broken_acceptance_is_caught(target, drafts, references) -> None:
    """Control: a verifier that accepts one token more than it should must break greedy equality."""
    real = ouroboros.verify_greedy

    def one_too_many(argmax, rows, nodes):
        row, m, next_token = real(argmax, rows, nodes)
        if row >= 0 and m < len(rows[row]):
            m += 1
            last = nodes[row][m - 1]
            next_token = int(argmax[last])
        return row, m, next_token

    settings = SETTINGS["γ=4 β=3 W=4 K=3"]
    mismatched = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ouroboros, "verify_greedy", one_too_many)
        for prompt, reference in zip(PROMPTS, references):
            result = ouroboros_generate(target, drafts["other"], prompt, MAX_NEW, 0, **settings)
            mismatched += result.sequences[0].tolist() != reference
    assert mismatched == len(PROMPTS)


def test_eos_and_short_budgets(target, drafts, references) -> None:
    prompt, reference = PROMPTS[0], references[0]
    generated = reference[len(prompt) :]
    eos = generated[len(generated) // 2]
    settings = SETTINGS["γ=4 β=3 W=4 K=3"]
    result = ouroboros_generate(target, drafts["copy"], prompt, MAX_NEW, 0, eos_token_id=[eos, 10_000], **settings)
    assert result.sequences[0].tolist() == prompt + generated[: generated.index(eos) + 1]
    for budget in (0, 1, 2, 5):
        result = ouroboros_generate(target, drafts["noisy"], prompt, budget, 0, **settings)
        assert result.sequences[0].tolist() == reference[: len(prompt) + budget]
        assert result.stats.generated == budget


def test_sampling_with_top_k_1_is_greedy(target, drafts, references) -> None:
    """top_k = 1 makes every target distribution a point mass on its argmax: the sampled verification path must then
    reproduce greedy output exactly (a cheap check of that path; the χ² test below is the real one)."""
    generator = torch.Generator().manual_seed(0)
    for prompt, reference in zip(PROMPTS, references):
        result = ouroboros_generate(
            target, drafts["noisy"], prompt, MAX_NEW, 1.0, top_k=1, generator=generator, **SETTINGS["γ=4 β=3 W=4 K=3"]
        )
        assert result.sequences[0].tolist() == reference


# ----------------------------------------------------------------------------------------------------------------
# Phrase-level drafting


@torch.inference_mode()
def test_phrase_drafting_is_the_drafts_greedy_continuation(drafts) -> None:
    """Whatever the pool holds, the sentence draft is the draft model's own greedy continuation; phrases that agree
    with it only save forward passes."""
    model, prompt, gamma = drafts["other"], PROMPTS[2], 9
    greedy = autoregressive_generate(model, prompt, gamma, temperature=0).sequences[0, len(prompt) :].tolist()
    text = prompt + greedy
    right = PhrasePool(4, 2, V)
    right.add_sequence(text[len(prompt) - 1 :])  # windows of the draft's own continuation
    wrong = PhrasePool(4, 2, V)
    absent = next(t for t in range(V) if t not in text)  # never drafted, so never accepted by the draft
    for token in set(text):
        wrong.add((token, absent, token, absent))
    calls = {}
    for name, pool in (("empty", PhrasePool(4, 2, V)), ("right", right), ("wrong", wrong)):
        drafter = PhraseDraft(model)
        assert drafter.draft(prompt, pool, gamma) == greedy, name
        calls[name] = drafter.calls
        # The cache now holds the prompt and every drafted token but the last: a commit of the first 3 drafted
        # tokens then a target token keeps exactly the agreeing part; the next draft continues correctly.
        drafter.commit(len(prompt), greedy, [*greedy[:3], V - 1])
        assert drafter.cache.get_seq_length() == len(prompt) + 3
        follow = autoregressive_generate(model, [*prompt, *greedy[:3], V - 1], 4, temperature=0).sequences[0]
        assert drafter.draft([*prompt, *greedy[:3], V - 1], pool, 4) == follow[-4:].tolist(), name
    assert calls["empty"] == calls["wrong"] == gamma
    assert calls["right"] == 3  # each forward: a 3-token phrase accepted, then the draft's own next token


# ----------------------------------------------------------------------------------------------------------------
# The phrase pool: LRU, inspiration, refinement, warm start


def test_pool_lru() -> None:
    pool = PhrasePool(phrase_length=3, phrases_per_token=2, vocab_size=50)
    pool.add((1, 2, 3))
    pool.add((1, 4, 5))
    assert pool.get(1) == [(1, 4, 5), (1, 2, 3)]  # most recent first
    pool.add((1, 2, 3))  # inserted again: back to the front
    assert pool.get(1) == [(1, 2, 3), (1, 4, 5)]
    pool.add((1, 6, 7))  # full: the least recently used (1, 4, 5) goes
    assert pool.get(1) == [(1, 6, 7), (1, 2, 3)] and (1, 4, 5) not in pool
    assert pool.touch((1, 2, 3)) and pool.get(1) == [(1, 2, 3), (1, 6, 7)]
    assert not pool.touch((1, 9, 9)) and len(pool) == 2  # touching an absent phrase inserts nothing
    pool.add((8, 9, 10))
    assert pool.get(8) == [(8, 9, 10)] and pool.get(1) == [(1, 2, 3), (1, 6, 7)]  # lists are per start token
    assert pool.remove((8, 9, 10)) and not pool.remove((8, 9, 10)) and pool.get(8) == []
    pool.add_sequence([4, 5, 4, 5, 6])
    assert pool.get(4) == [(4, 5, 6), (4, 5, 4)] and pool.get(5) == [(5, 4, 5)]
    with pytest.raises(ValueError, match="a phrase has 2 tokens; this pool holds phrases of β=3"):
        pool.add((1, 2))


def test_candidate_tree_and_lengthening() -> None:
    pool = PhrasePool(3, 3, 100)
    for phrase in ((22, 30, 31), (22, 30, 32), (22, 40, 41), (21, 50, 51)):
        pool.add(phrase)
    # Most recent first; cut to one appended token, (22, 30, 32) and (22, 30, 31) append the same run.
    assert lengthening_phrases(pool, [20, 21, 22], 3, room=2) == [(22, 40, 41), (22, 30, 32), (22, 30, 31)]
    assert lengthening_phrases(pool, [20, 21, 22], 3, room=1) == [(22, 40, 41), (22, 30, 32)]
    assert lengthening_phrases(pool, [20, 21, 22], 0, room=2) == lengthening_phrases(pool, [], 3, room=2) == []
    tokens, parents, rows, nodes = candidate_tree(10, [20, 21, 22], [(40, 41), (30,)])
    assert tokens == [10, 20, 21, 22, 40, 41, 30] and parents == [-1, 0, 1, 2, 3, 4, 3]
    assert rows == [[20, 21, 22], [20, 21, 22, 40, 41], [20, 21, 22, 30]]
    assert nodes == [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 6]]
    assert candidate_tree(10, [], [(40,)]) == ([10], [-1], [], [])


def test_inspiration_from_hand_built_verification() -> None:
    """Draft 20 21 22 after root 10, one branch 40 41. The target's argmax per node (index = tree node): after 10
    it says 20 (accept), after 20 it says 25 (reject 21), then on regardless: 26, 27 after 21, 22; 28, 29 after the
    branch's 40, 41. Its own continuation along each row becomes phrases."""
    nodes = [[1, 2, 3], [1, 2, 3, 4, 5]]
    argmax = [20, 25, 26, 27, 28, 29]
    phrases = inspiration_phrases(10, argmax, nodes, phrase_length=3, winner=0)
    # Row 1's text: 10 20 25 26 27 28 29; row 0's: 10 20 25 26 27 (the winner, inserted last: most recent).
    assert phrases == [(26, 27, 28), (27, 28, 29), (10, 20, 25), (20, 25, 26), (25, 26, 27)]
    pool = PhrasePool(3, 2, 100)
    for phrase in phrases:
        pool.add(phrase)
    assert pool.get(25) == [(25, 26, 27)] and pool.get(27) == [(27, 28, 29)]
    assert inspiration_phrases(10, [5], [], 2) == []  # no rows, nothing to learn from


def test_refinement_from_hand_built_verification() -> None:
    pool = PhrasePool(3, 4, 100)
    for phrase in ((22, 30, 31), (22, 40, 41), (22, 50, 51), (9, 9, 9)):
        pool.add(phrase)
    extensions = [(22, 40, 41), (22, 30, 31)]
    # The draft (3 tokens) was cut short at its second token: the extensions were never reached; nothing changes.
    refine_pool(pool, 3, extensions, [20, 99])
    assert pool.get(22) == [(22, 50, 51), (22, 40, 41), (22, 30, 31)]
    # The whole draft was accepted and the target went on with 30: (22, 40, 41) was rejected at its first token.
    refine_pool(pool, 3, extensions, [20, 21, 22, 30, 31, 7])
    assert pool.get(22) == [(22, 30, 31), (22, 50, 51)]  # the accepted phrase moved to the front
    # Target's own token 60 after the draft: both rejected; a phrase that was not a candidate stays.
    refine_pool(pool, 3, [(22, 30, 31), (22, 50, 51)], [20, 21, 22, 60])
    assert pool.get(22) == [] and pool.get(9) == [(9, 9, 9)]


def test_refinement_in_a_generation(target, drafts, references, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end, with inspiration switched off so that only refinement can remove phrases: every token has one
    arbitrary phrase; with draft = target each sentence draft is accepted whole, so each lengthening phrase is ruled
    on, and exactly the rejected ones leave the pool."""
    monkeypatch.setattr(ouroboros, "inspiration_phrases", lambda *args, **kwargs: [])
    vocab = target.config.vocab_size
    pool = PhrasePool(2, 1, vocab)
    for token in range(vocab):
        pool.add((token, (7 * token + 3) % vocab))
    before = {phrase for phrases in pool.table.values() for phrase in phrases}
    settings = dict(gamma=3, phrase_length=2, phrases_per_token=1, candidates=2, pool=pool)
    result = ouroboros_generate(target, drafts["copy"], PROMPTS[1], MAX_NEW, 0, **settings)
    assert result.sequences[0].tolist() == references[1]
    stats = result.stats
    rejected = sum(r == 2 and a == d for r, a, d in zip(stats.rows, stats.accepted, stats.drafted))
    assert rejected > 0
    after = {phrase for phrases in pool.table.values() for phrase in phrases}
    assert after < before and len(after) == vocab - rejected


def test_warm_start_round_trip(target, drafts, tmp_path) -> None:
    tokenizer = make_tokenizer()
    pool = PhrasePool(3, 4, len(tokenizer), fingerprint=vocab_fingerprint(tokenizer))
    settings = dict(gamma=4, phrase_length=3, phrases_per_token=4, candidates=3)
    ouroboros_generate(target, drafts["noisy"], PROMPTS[0], MAX_NEW, 0, pool=pool, **settings)
    assert len(pool) > 0
    path = pool.save(tmp_path / "pool.json")
    loaded = PhrasePool.load(path, vocab_size=target.config.vocab_size, tokenizer=tokenizer)
    assert loaded.table == pool.table  # every start token's phrases, in LRU order
    assert (loaded.phrase_length, loaded.phrases_per_token, loaded.fingerprint) == (3, 4, pool.fingerprint)
    # Reusing either pool gives the same (lossless) output with the same draft work: the pool was restored exactly.
    again = [
        ouroboros_generate(target, drafts["noisy"], PROMPTS[2], MAX_NEW, 0, pool=p, **settings) for p in (pool, loaded)
    ]
    assert again[0].sequences.tolist() == again[1].sequences.tolist()
    assert again[0].stats.draft_calls == again[1].stats.draft_calls and again[0].stats.fed == again[1].stats.fed
    assert loaded.table == pool.table


def test_pool_from_another_tokenizer_is_refused(target, drafts, tmp_path) -> None:
    foo, bar = make_tokenizer(extra_words=("foo",)), make_tokenizer(extra_words=("bar",))  # same size, other words
    assert len(foo) == len(bar) and vocab_fingerprint(foo) != vocab_fingerprint(bar)
    path = PhrasePool(3, 4, len(foo), fingerprint=vocab_fingerprint(foo)).save(tmp_path / "pool.json")
    assert PhrasePool.load(path, tokenizer=foo).vocab_size == len(foo)
    with pytest.raises(
        ValueError, match=f"pool.json was built for a tokenizer .* not this one .{vocab_fingerprint(bar)}"
    ):
        PhrasePool.load(path, tokenizer=bar)
    with pytest.raises(ValueError, match=rf"vocabulary of {len(foo)} tokens but the model's has {len(foo) - 1}"):
        PhrasePool.load(path, tokenizer=make_tokenizer())
    with pytest.raises(ValueError, match="another tokenizer"):
        settings = dict(phrase_length=3, phrases_per_token=4, candidates=3)
        ouroboros_generate(target, drafts["copy"], PROMPTS[0], 4, 0, pool=PhrasePool.load(path), **settings)
    with pytest.raises(FileNotFoundError, match="no phrase pool at"):
        PhrasePool.load(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="is not an Ouroboros phrase pool"):
        PhrasePool.load(tmp_path / "other.json")


# ----------------------------------------------------------------------------------------------------------------
# Bad parameters


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(gamma=0), r"gamma=0 must be an integer >= 1"),
        (dict(phrase_length=1), r"phrase_length \(β\)=1 must be an integer >= 2"),
        (dict(phrases_per_token=0), r"phrases_per_token \(W\)=0 must be an integer >= 1"),
        (dict(candidates=0), r"candidates \(K\)=0 must be an integer in \[1, phrases_per_token \+ 1 = 6\]"),
        (dict(candidates=7), r"candidates \(K\)=7 must be an integer in \[1, phrases_per_token \+ 1 = 6\]"),
        (dict(gamma=True), r"gamma=True must be an integer"),
        (dict(phrase_length=3.0), r"phrase_length \(β\)=3.0 must be an integer"),
        (dict(pool=PhrasePool(3, 5, V)), r"β=3, W=5 per start token, but phrase_length=4, phrases_per_token=5"),
        (dict(pool=PhrasePool(4, 5, 10)), rf"vocabulary of 10 tokens but the model's has {V}"),
        (dict(temperature=-1.0), r"temperature=-1.0 must be a finite number >= 0"),
    ],
)
def test_bad_parameters(target, drafts, kwargs: dict, match: str) -> None:
    arguments = dict(temperature=0) | kwargs
    with pytest.raises(ValueError, match=match):
        ouroboros_generate(target, drafts["copy"], PROMPTS[0], 4, **arguments)


def test_bad_drafts(target, drafts) -> None:
    other_vocab = make_llama(tokenizer=make_tokenizer(extra_words=("extra",)), seed=0)
    with pytest.raises(ValueError, match=f"target vocab_size={V} != draft vocab_size={V + 1}"):
        ouroboros_generate(target, other_vocab, PROMPTS[0], 4, 0)
    with pytest.raises(TypeError, match="Ouroboros drafts with a Hugging Face causal LM.*ModelDrafter"):
        ouroboros_generate(target, ModelDrafter(drafts["copy"]), PROMPTS[0], 4, 0)


# ----------------------------------------------------------------------------------------------------------------
# Sampling: the output distribution is the target's (χ² goodness of fit, as in test_learning_free.py)

NEW_TOKENS, SAMPLES = 4, 1500
SMALL_PROMPT = [0, 3, 5, 0, 3, 5, 0]
SAMPLED = dict(gamma=2, phrase_length=2, phrases_per_token=2, candidates=3, prompt_phrases=True)


@pytest.fixture(scope="module")
def small() -> tuple[LlamaForCausalLM, LlamaForCausalLM, torch.Tensor]:
    """A vocabulary-8 Llama, a noisy copy as its draft, and the exact joint distribution (V,)*4 of the target's
    first four sampled tokens at T = 1."""
    model = small_vocab_llama(seed=0)
    return model, perturbed_copy(model, relative_noise=0.1), exact_joint(model, SMALL_PROMPT, NEW_TOKENS)


def sampled(model, draft, samples: int = SAMPLES) -> tuple[torch.Tensor, float]:
    return sampled_tokens(
        lambda generator: ouroboros_generate(
            model, draft, SMALL_PROMPT, NEW_TOKENS, 1.0, generator=generator, **SAMPLED
        ),
        samples,
        len(SMALL_PROMPT),
    )


def test_sampling_is_reproducible(small) -> None:
    model, draft, _ = small
    runs = [
        ouroboros_generate(model, draft, SMALL_PROMPT, 12, 0.9, top_p=0.9, generator=torch.Generator().manual_seed(3))
        for _ in range(2)
    ]
    assert runs[0].sequences.tolist() == runs[1].sequences.tolist()


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(small) -> None:
    model, draft, joint = small
    tokens, hit_rate = sampled(model, draft)
    assert hit_rate > 0.3, hit_rate  # drafts were accepted often: the acceptance rule itself is under test
    p_first, p_second = pair_p_values(tokens, joint)
    assert p_first > ALPHA and p_second > ALPHA, (p_first, p_second)


@pytest.mark.slow
def test_broken_sample_verification_is_detected(small, monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepting the draft's first token unconditionally (p/q ignored) must fail the same χ² check (300 runs are
    plenty for a verifier this wrong)."""
    model, draft, joint = small
    monkeypatch.setattr(ouroboros, "verify_sampled", accept_first_guess)
    tokens, _ = sampled(model, draft, samples=300)
    assert max(pair_p_values(tokens, joint)) < 1e-6
