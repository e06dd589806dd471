"""Learning-free decoders (N-Grammys, Lookahead decoding) and the tree verification they share.

Greedy output must equal autoregressive greedy decoding on every prompt and setting; the one-pass tree verification
must reproduce separate calls' logits; the model bigram must equal a direct computation; the Lookahead mask must
equal the paper's pattern written by hand; sampled decoding must keep the target's distribution (χ² as in
``test_lossless.py``); bad parameters must fail with clear errors. Tiny float32 Llamas only, no network.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from stats_helpers import ALPHA, accept_first_guess, exact_joint, pair_p_values, sampled_tokens
from tiny_models import make_llama, make_tokenizer, small_vocab_llama
from transformers import DynamicCache, LlamaForCausalLM

from accept_head import (
    ModelBigram,
    NgramPool,
    TreeDecodeStats,
    autoregressive_generate,
    lookahead_generate,
    ngrammys_generate,
)
from accept_head.core.hf_compat import cache_kwargs, keep_cache_positions
from accept_head.learning_free.lookahead import JacobiWindow, lookahead_tree
from accept_head.trees.attention import check_masked_attention
from accept_head.trees.context import ContextNgrams
from accept_head.trees.verify import add_rows, commit_nodes, tree_forward, tree_mask

# Prompts repeat themselves so that context n-grams have something to match.
PROMPTS = [[1, 12, 40, 41, 9, 12, 40, 41, 9, 12, 40], [2, 30, 31, 32, 30, 31, 32, 30, 31], [5, 7, 7, 7, 7, 8, 9, 7]]
MAX_NEW = 40


# ``targets`` (random, near_bigram) and their ``bigrams`` are conftest fixtures.


@pytest.fixture(scope="module")
def references(targets) -> dict[str, list[list[int]]]:
    return {
        name: [autoregressive_generate(model, p, MAX_NEW, temperature=0).sequences[0].tolist() for p in PROMPTS]
        for name, model in targets.items()
    }


# ----------------------------------------------------------------------------------------------------------------
# Greedy equality with autoregressive greedy decoding


NGRAMMYS_SETTINGS = {
    "model k=1 w=1": dict(strategy="model", k=1, w=1),
    "model k=5 w=4": dict(strategy="model", k=5, w=4),
    "context k=3 w=6 q=1": dict(strategy="context", k=3, w=6, q=1),
    "mixed k=10 w=2 q=2": dict(strategy="mixed", k=10, w=2, q=2),
    "mixed k=4 w=8 q=3": dict(strategy="mixed", k=4, w=8, q=3),
}
LOOKAHEAD_SETTINGS = {
    "W=1 N=2 G=1": dict(window=1, ngram=2, guess_set=1),
    "W=3 N=3 G=2": dict(window=3, ngram=3, guess_set=2),
    "W=5 N=4 G=5 context": dict(window=5, ngram=4, guess_set=5, context_ngrams=True),
    "W=2 N=5 G=3": dict(window=2, ngram=5, guess_set=3, seed=3),
}


def run_method(method: str, setting: str, target, bigram, prompt, max_new=MAX_NEW, **kwargs):
    if method == "ngrammys":
        return ngrammys_generate(target, prompt, max_new, 0, bigram=bigram, **NGRAMMYS_SETTINGS[setting], **kwargs)
    return lookahead_generate(target, prompt, max_new, 0, **LOOKAHEAD_SETTINGS[setting], **kwargs)


CASES = [("ngrammys", s) for s in NGRAMMYS_SETTINGS] + [("lookahead", s) for s in LOOKAHEAD_SETTINGS]


@pytest.mark.parametrize("method,setting", CASES)
def test_greedy_equals_autoregressive(targets, bigrams, references, method: str, setting: str) -> None:
    accepted = {}
    for name, target in targets.items():
        for prompt, reference in zip(PROMPTS, references[name]):
            result = run_method(method, setting, target, bigrams[name], prompt)
            assert result.sequences[0].tolist() == reference, (name, prompt)
            stats = result.stats
            assert isinstance(stats, TreeDecodeStats) and stats.draft_calls == 0
            assert stats.generated == MAX_NEW == stats.target_calls + sum(stats.accepted)  # no EOS: m + 1 per call
            assert len(stats.proposed) == len(stats.accepted) == len(stats.fed) == len(stats.rows) == stats.target_calls
            assert all(0 <= a <= p for a, p in zip(stats.accepted, stats.proposed))
            assert stats.discarded == sum(stats.proposed) - sum(stats.accepted)
            accepted[name] = accepted.get(name, 0) + sum(stats.accepted)
    assert accepted["near_bigram"] > 0  # the accept path ran, not only the target's own token


@pytest.mark.parametrize("method,setting", [CASES[1], CASES[-2]])
def test_eos_and_short_budgets(targets, bigrams, references, method: str, setting: str) -> None:
    target, bigram = targets["near_bigram"], bigrams["near_bigram"]
    prompt, reference = PROMPTS[0], references["near_bigram"][0]
    generated = reference[len(prompt) :]
    eos = generated[len(generated) // 2]
    result = run_method(method, setting, target, bigram, prompt, eos_token_id=[eos, 10_000])
    assert result.sequences[0].tolist() == prompt + generated[: generated.index(eos) + 1]
    for budget in (0, 1, 2, 5):
        result = run_method(method, setting, target, bigram, prompt, max_new=budget)
        assert result.sequences[0].tolist() == reference[: len(prompt) + budget]


# ----------------------------------------------------------------------------------------------------------------
# Tree verification: one pass equals separate calls; the cache keeps exactly the accepted row


def prefilled(model, tokens: list[int]) -> DynamicCache:
    cache = DynamicCache()
    model(input_ids=torch.tensor([tokens]), **cache_kwargs(model, cache))
    return cache


@torch.inference_mode()
def test_rows_in_one_pass_match_separate_calls(targets) -> None:
    model = targets["random"]
    prefix, root = PROMPTS[0][:-1], PROMPTS[0][-1]
    rows = [[7, 8, 9], [7, 20], [50, 51, 52, 53], [3]]
    cache = prefilled(model, prefix)
    tree, parents = [root], [-1]
    nodes = add_rows(tree, parents, 0, rows)
    logits = tree_forward(model, cache, tree, parents)
    assert logits.shape == (1 + sum(map(len, rows)), model.config.vocab_size)
    for row, row_nodes in zip(rows, nodes):
        separate = model(input_ids=torch.tensor([prefix + [root] + row])).logits[0, len(prefix) :]
        torch.testing.assert_close(logits[[0, *row_nodes]], separate, atol=1e-5, rtol=0)
    # Keep row 2's first two tokens: the cache must equal the one a plain pass over the kept text leaves.
    commit_nodes(cache, len(prefix), nodes[2][:2])
    plain = prefilled(model, prefix + [root] + rows[2][:2])
    assert cache.get_seq_length() == plain.get_seq_length() == len(prefix) + 3
    for ours, theirs in zip(cache.layers, plain.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_lookahead_branches_match_separate_calls(targets) -> None:
    """Each window token sees its Jacobi diagonal, each guess its own row, at the right positions."""
    model = targets["random"]
    prefix, current = PROMPTS[1][:-1], PROMPTS[1][-1]
    window = JacobiWindow(3, 4, current, [0] * 4)
    window.levels = [[current, 11, 12], [21, 22, 23], [31, 32, 33]]  # a full window: N - 1 = 3 levels, W = 3
    guesses = [(40, 41, 42), (40, 43)]
    tokens, parents, top, nodes = lookahead_tree(window, guesses)
    logits = tree_forward(model, prefilled(model, prefix), tokens, parents)
    for level, column in itertools.product(range(3), range(3)):
        diagonal = window.levels[0][: column + 1] + [window.levels[lv][column] for lv in range(1, level + 1)]
        separate = model(input_ids=torch.tensor([prefix + diagonal])).logits[0, -1]
        torch.testing.assert_close(logits[level * 3 + column], separate, atol=1e-5, rtol=0)
    assert top == [6, 7, 8]
    for guess, guess_nodes in zip(guesses, nodes):
        separate = model(input_ids=torch.tensor([prefix + [current, *guess]])).logits[0, len(prefix) + 1 :]
        torch.testing.assert_close(logits[guess_nodes], separate, atol=1e-5, rtol=0)


def test_lookahead_mask_matches_hand_written() -> None:
    """W = 3, N = 3, G = 2: the window's 2 levels (x_t a b / c d e) then guesses (g h), (i j)."""
    window = JacobiWindow(3, 3, 100, [101, 102, 103])
    assert window.levels == [[100, 101, 102, 103]] and not window.full  # filling: one level of W + N - 2 tokens
    window.advance(200, [1, 2, 3, 4])
    assert window.full and window.levels == [[200, 102, 103], [2, 3, 4]]
    tokens, parents, top, nodes = lookahead_tree(window, [(5, 6), (7, 8)])
    assert tokens == [200, 102, 103, 2, 3, 4, 5, 6, 7, 8] and top == [3, 4, 5] and nodes == [[6, 7], [8, 9]]
    expected = torch.tensor(
        [
            # x  a  b  c  d  e  g  h  i  j
            [1, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # x_t
            [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # a: level 0, column 1
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 0],  # b: level 0, column 2
            [1, 0, 0, 1, 0, 0, 0, 0, 0, 0],  # c: level 1, column 0
            [1, 1, 0, 0, 1, 0, 0, 0, 0, 0],  # d: level 1, column 1
            [1, 1, 1, 0, 0, 1, 0, 0, 0, 0],  # e: level 1, column 2
            [1, 0, 0, 0, 0, 0, 1, 0, 0, 0],  # g: guess 1, token 1
            [1, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # h: guess 1, token 2
            [1, 0, 0, 0, 0, 0, 0, 0, 1, 0],  # i: guess 2, token 1
            [1, 0, 0, 0, 0, 0, 0, 0, 1, 1],  # j: guess 2, token 2
        ],
        dtype=torch.bool,
    )
    mask, depths = tree_mask(parents)
    assert torch.equal(mask, expected)
    assert depths.tolist() == [0, 1, 2, 1, 2, 3, 1, 2, 1, 2]  # position offsets from x_t
    assert window.ngrams([9, 9, 9]) == [(200, (2, 9)), (102, (3, 9)), (103, (4, 9))]
    window.advance(300, [7, 8, 9])
    assert window.levels == [[300, 3, 4], [7, 8, 9]]


def test_keep_cache_positions() -> None:
    cache = DynamicCache()
    for layer in range(2):
        states = torch.arange(10.0).view(1, 1, 10, 1).expand(1, 2, 10, 3) + 100 * layer
        cache.update(states.clone(), -states.clone(), layer)
    keep_cache_positions(cache, 3, [5, 8])
    assert cache.get_seq_length() == 5
    assert cache.layers[1].keys[0, 1, :, 0].tolist() == [100, 101, 102, 105, 108]
    assert cache.layers[0].values[0, 0, :, 2].tolist() == [0, -1, -2, -5, -8]
    keep_cache_positions(cache, 2, [2, 3])  # already contiguous: a plain crop
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 5]
    keep_cache_positions(cache, 1, [])
    assert cache.get_seq_length() == 1
    for extra in ([0], [1, 1], [2]):
        with pytest.raises(ValueError, match="strictly increasing"):
            keep_cache_positions(cache, 1, extra)


def test_tree_mask_rejects_bad_parents() -> None:
    with pytest.raises(ValueError, match="earlier token"):
        tree_mask([-1, 1])


# ----------------------------------------------------------------------------------------------------------------
# The model bigram and the n-gram sources


@torch.inference_mode()
def test_bigram_table_matches_direct_computation(targets, tmp_path) -> None:
    model = targets["random"]
    table = ModelBigram.build(model, top=3, batch_size=7)  # batches that do not divide the vocabulary
    vocab = model.config.vocab_size
    direct = torch.stack([model(input_ids=torch.tensor([[t]])).logits[0, -1].topk(3).indices for t in range(vocab)])
    assert table.next_tokens.shape == (vocab, 3)
    assert torch.equal(table.next_tokens, direct)
    # w > 1: row r starts with the r-th successor and follows top-1 successors.
    rows = table.rows(12, 2, 4)
    for r, row in enumerate(rows):
        assert row[0] == direct[12, r]
        assert all(row[j + 1] == direct[row[j], 0] for j in range(3))
    # Cached on disk by fingerprint: the second call reads the file instead of running the model.
    first = ModelBigram.load_or_build(model, tmp_path, top=3)
    (path,) = tmp_path.glob("bigram-*-top3.safetensors")
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        second = ModelBigram.load_or_build(model, tmp_path, top=3)
    finally:
        handle.remove()
    assert not calls and torch.equal(first.next_tokens, second.next_tokens) and torch.equal(second.next_tokens, direct)
    # A table from another model (same vocabulary) or another tokenizer is refused, naming the file.
    with pytest.raises(ValueError, match=f"{path.name}.*fingerprint"):
        ModelBigram.load(path, make_llama(seed=5))
    other = make_llama(tokenizer=make_tokenizer(extra_words=("extra",)), seed=0)
    with pytest.raises(ValueError, match=f"{path.name}.*vocabulary of {vocab} tokens.*{vocab + 1}"):
        ModelBigram.load(path, other)
    with pytest.raises(ValueError, match="fingerprint"):
        ngrammys_generate(make_llama(seed=5), PROMPTS[0], 4, 0, bigram=table, k=2)


def test_context_ngrams_and_pool() -> None:
    context = ContextNgrams(q=2)
    tokens = [1, 2, 3, 4, 1, 2, 5, 1, 2]
    assert context.matches(tokens, k=5, w=3) == [(6, [5, 1, 2]), (2, [3, 4, 1])]  # most recent match first
    assert context.matches(tokens, k=1, w=2) == [(6, [5, 1])]
    tokens += [3]
    assert context.matches(tokens, k=5, w=2) == [(3, [4, 1])]  # (2, 3) matched once; the index grew incrementally
    pool = NgramPool(ngram=3, guess_set=2, vocab_size=10)
    pool.add(1, (2, 3))
    pool.add(1, (4, 5))
    pool.add(1, (2, 3))  # refreshed: now the most recent
    pool.add(1, (6, 7))  # full: the least recently used (4, 5) goes
    assert pool.get(1) == [(6, 7), (2, 3)]
    pool.add_sequence([8, 9, 8, 9])
    assert pool.get(8) == [(9, 8)] and pool.get(9) == [(8, 9)]


# ----------------------------------------------------------------------------------------------------------------
# Sampling: the output distribution is the target's (χ² goodness of fit, as in test_lossless.py)

NEW_TOKENS, SAMPLES = 4, 1500
SMALL_PROMPT = [0, 3, 5, 0, 3, 5, 0]


@pytest.fixture(scope="module")
def small() -> tuple[LlamaForCausalLM, torch.Tensor]:
    """A vocabulary-8 Llama and the exact distribution (V,)*4 of its first four sampled tokens at T = 1."""
    model = small_vocab_llama(seed=0)
    return model, exact_joint(model, SMALL_PROMPT, NEW_TOKENS)


def assert_fits(tokens: torch.Tensor, joint: torch.Tensor) -> None:
    p_first, p_second = pair_p_values(tokens, joint)
    assert p_first > ALPHA and p_second > ALPHA, (p_first, p_second)


SAMPLERS = {
    "lookahead": lambda model, bigram: (
        lambda g: lookahead_generate(
            model, SMALL_PROMPT, NEW_TOKENS, 1.0, generator=g, window=3, ngram=3, guess_set=3, context_ngrams=True
        )
    ),
    "ngrammys": lambda model, bigram: (
        lambda g: ngrammys_generate(model, SMALL_PROMPT, NEW_TOKENS, 1.0, generator=g, k=3, w=3, q=1, bigram=bigram)
    ),
}


@pytest.mark.parametrize("method", list(SAMPLERS))
def test_sampling_keeps_the_target_distribution(small, method: str) -> None:
    model, joint = small
    decode = SAMPLERS[method](model, ModelBigram.build(model, top=3))
    tokens, hit_rate = sampled_tokens(decode, SAMPLES, len(SMALL_PROMPT))
    assert hit_rate > 0.1, hit_rate  # guesses were accepted often: the acceptance rule itself is under test
    assert_fits(tokens, joint)


CONTROL_SAMPLES = 300
"""Runs of each negative control: a verifier this wrong is rejected at p < 1e-6 with far fewer runs."""


@pytest.mark.parametrize("method", list(SAMPLERS))
def test_broken_sample_verification_is_detected(small, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sampler's own control: accepting the first guess unconditionally (p ignored) must fail the same χ²
    check. (A subtler mutant — one that keeps a rejected sibling's mass in the residual — passes this χ² at these
    sample sizes; ``test_tree_verify.py`` catches it exactly.)"""
    model, joint = small
    monkeypatch.setattr(f"accept_head.learning_free.{method}.verify_sampled", accept_first_guess)
    decode = SAMPLERS[method](model, ModelBigram.build(model, top=3))
    tokens, _ = sampled_tokens(decode, CONTROL_SAMPLES, len(SMALL_PROMPT))
    assert max(pair_p_values(tokens, joint)) < 1e-6


# ----------------------------------------------------------------------------------------------------------------
# Bad parameters


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(k=0), r"k=0 must be an integer >= 1"),
        (dict(w=0), r"w=0 must be an integer >= 1"),
        (dict(q=0), r"q=0 must be an integer >= 1"),
        (dict(w=True), r"w=True must be an integer"),
        (dict(strategy="bigram"), r"strategy='bigram' must be one of"),
        (dict(k=11), r"k=11 rows need a bigram table with top >= 11"),
        (dict(bigram=None), r"needs the model bigram"),
    ],
)
def test_ngrammys_bad_parameters(targets, bigrams, kwargs: dict, match: str) -> None:
    arguments = dict(bigram=bigrams["random"]) | kwargs
    with pytest.raises(ValueError, match=match):
        ngrammys_generate(targets["random"], PROMPTS[0], 4, 0, **arguments)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window=0), r"window \(W\)=0 must be an integer >= 1"),
        (dict(ngram=1), r"ngram \(N\)=1 must be an integer >= 2"),
        (dict(guess_set=0), r"guess_set \(G\)=0 must be an integer >= 1"),
        (dict(ngram=3.0), r"ngram \(N\)=3.0 must be an integer"),
        (dict(pool=NgramPool(3, 2, 10)), r"N=3, G=2 but ngram=4, guess_set=5"),
        (dict(pool=NgramPool(4, 5, 10)), r"vocabulary of 10 tokens .* another tokenizer"),
    ],
)
def test_lookahead_bad_parameters(targets, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lookahead_generate(targets["random"], PROMPTS[0], 4, 0, **kwargs)


def test_attention_without_custom_masks_is_refused() -> None:
    stub = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(ValueError, match="flash_attention_2.*custom 4D attention mask"):
        check_masked_attention(stub)
