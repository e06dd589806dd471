"""Rows copied from the text itself joining a draft tree (:mod:`accept_head.trees.context`, a tree rule's
``context_row``), on tiny random models.

* :class:`ContextRow` returns what followed the latest earlier occurrence of the longest recurring suffix.
* :func:`add_copied_row` merges a row into the verified nodes, ancestor-closed, and reuses nodes holding its tokens.
* Greedy tree decoding with a copied row still returns exactly the target's greedy text in float32, and the copies are
  accepted (the draft is an unrelated random model, so nearly every accepted token was copied).
* At temperature 1 the output follows the target's exact distribution (χ²) with top-k and with drawn siblings;
  a point-mass guess tried on a residual emits exactly that residual, and accepting the guess outright does not.
"""

from __future__ import annotations

import pytest
import torch
from generate_helpers import greedy
from stats_helpers import ALPHA, exact_joint, goodness_of_fit, pair_p_values, sampled_tokens, small_vocab_pair
from test_tree_decoding import COST, NEW, PROMPTS, rules
from tiny_models import make_llama, perturbed_copy

import accept_head.trees.chain_copies as chain_copies
import accept_head.trees.decoding as tree_decoding
import accept_head.trees.verify as tree_verify
from accept_head import CopyingChain, FixedK, autoregressive_generate, chain_copy_generate, make_custom_generate
from accept_head.trees.context import ContextRow
from accept_head.trees.growth import ConfidenceTree, CostTree, DraftTree
from accept_head.trees.verify import try_guesses


def test_context_row_copies_what_followed_the_latest_longest_match() -> None:
    def copy(tokens, length=None):  # one ContextRow follows one growing text
        return ContextRow(3)(tokens, length)

    #            0  1  2  3  4  5  6  7  8  9
    assert copy([7, 1, 2, 8, 1, 2, 9, 4, 1, 2]) == [9, 4, 1]  # [1, 2] last seen at 4-5, followed by 9 4 1
    assert copy([5, 1, 2, 3, 6, 7, 1, 2, 4, 1, 2, 3]) == [6, 7, 1]  # the three-token match beats the later [1, 2]
    assert copy([1, 2, 3, 4]) == []  # no suffix of two tokens recurs
    assert copy([1, 2, 3, 1, 2], length=1) == [3]
    growing, text = ContextRow(2), [1, 2, 3, 1]
    assert growing(text) == []
    text += [2]
    assert growing(text) == [3, 1]
    assert ContextRow(4, shortest=1, longest=1)([4, 5, 6, 5]) == [6, 5]  # up to the end of the text
    with pytest.raises(ValueError, match="length=0"):
        ContextRow(0)
    with pytest.raises(ValueError, match="shortest=3 must be <= longest=2"):
        ContextRow(2, shortest=3, longest=2)


def test_a_long_recurring_suffix_copies_a_long_row_from_its_own_occurrence() -> None:
    #      0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 3, 4, 5, 1, 2, 3, 4, 5]
    # [3, 4, 5] last recurs at 10-12 (followed by 1 2 3); the whole [1, 2, 3, 4, 5] recurs at 0-4 (followed by 6 7 ...)
    assert ContextRow(2)(text) == [1, 2]
    long = ContextRow(2, long_length=6, long_match=5)
    assert long(text) == [6, 7, 8, 9, 0, 3]
    assert long(text, length=3) == [6, 7, 8]  # the caller's cap still holds
    assert long([*text, 9]) == []  # nothing recurs
    assert long([*text, 9, 0]) == [3, 4]  # a two-token match: the short row
    assert long(text[:13], path=[1, 2]) == [3, 4]  # with a drafted path: [5, 1, 2] is not in the text, [1, 2] is
    # a long row no longer than the base: unused
    assert ContextRow(4, long_length=3, long_match=5)(text) == [1, 2, 3, 4]
    for bad in ({"long_length": 0, "long_match": 5}, {"long_length": 8, "long_match": True}):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            ContextRow(4, **bad)


def test_copied_rows_are_cut_to_the_room_given() -> None:
    def copy(tokens, length, path=()):
        return [7, 8, 9, 10][:length]

    def grown(room):
        tree = DraftTree()
        a = tree.add(5, -1, 0.6, 0.6)
        return tree_decoding.add_copied_rows(tree, [a, tree.add(6, a, 0.5, 0.5)], copy, [1, 2], depth=10, room=room)

    assert len(grown(None)) == 2 + 4 + 4  # a row at the root and one below the chain
    assert len(grown(7)) == 7 and len(grown(5)) == 5 and len(grown(2)) == 2


def test_a_copied_row_follows_verified_nodes_and_hangs_the_rest_below() -> None:
    tree = DraftTree()
    a = tree.add(5, -1, 0.6, 0.6)
    b = tree.add(6, a, 0.5, 0.5)
    c = tree.add(9, -1, 0.2, 0.2)  # proposed, not verified
    nodes = tree_decoding.add_copied_row(tree, [a, b], [5, 7, 8])
    assert nodes == [a, b, 3, 4] and tree.parents[3:] == [a, 3] and tree.tokens[3:] == [7, 8]
    assert tree.copied == {3, 4}
    nodes = tree_decoding.add_copied_row(tree, [a, b], [9, 1])  # 9 exists but was not chosen: a new node
    assert nodes == [a, b, 5, 6] and tree.parents[5] == -1 and c not in nodes


class FutureRow:
    """Stands in for :class:`ContextRow`: copies the target's own greedy continuation (``right``) or that text with
    every token shifted (``wrong``), so the test knows which copies verification must accept."""

    def __init__(self, reference: list[int], shift: int, vocab_size: int) -> None:
        self.reference, self.shift, self.vocab_size = reference, shift, vocab_size

    def __call__(self, tokens, length, path=()):
        if path:  # no copy below the leaves: the test counts the root's copies
            return []
        future = self.reference[len(tokens) : len(tokens) + min(length, 4)]
        return [(t + self.shift) % self.vocab_size for t in future]


@pytest.mark.parametrize("copies", ["right", "wrong", "context"])
def test_greedy_decoding_with_a_copied_row_equals_autoregressive(copies: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Right copies are accepted whole (4 a round), wrong ones change nothing, the real :class:`ContextRow` neither;
    the draft, a random model sharing the vocabulary, rarely guesses right on its own."""
    target, draft = make_llama(seed=0, num_layers=2), make_llama(seed=11, num_layers=1)
    for name in ("head", "confidence", "cost"):
        rule = rules(draft.config.hidden_size)[name]
        for prompt in PROMPTS:
            reference = autoregressive_generate(target, prompt, NEW, temperature=0).sequences
            if copies != "context":
                row = FutureRow(reference[0].tolist(), int(copies == "wrong"), target.config.vocab_size)
                monkeypatch.setattr(tree_decoding, "ContextRow", lambda length, row=row: row)
            rule.context_row = 4
            out = tree_decoding.tree_generate(target, draft, prompt, rule, NEW, temperature=0)
            assert torch.equal(out.sequences, reference), (name, prompt)
            if copies == "right":  # every round but the last accepts the 4 copied tokens
                assert out.stats.accepted[:-1] == [4] * (len(out.stats.accepted) - 1), out.stats.accepted


def test_a_copy_below_the_likeliest_leaf_continues_a_right_path() -> None:
    """Below the drafted leaf most likely reached, the row copied after the committed text and that leaf's path. A
    copy that is the target's own continuation of the path (an oracle) makes greedy rounds accept more, and the output
    is still the target's; the copy's length keeps every path within the round's depth."""
    target = make_llama(seed=0, num_layers=2)
    draft = perturbed_copy(target, relative_noise=0.15, seed=3)  # often right: its paths are worth continuing
    prompt = PROMPTS[0]
    reference = autoregressive_generate(target, prompt, NEW, temperature=0).sequences
    oracle = reference[0].tolist()

    class PathOracle:
        def __call__(self, tokens, length, path=()):
            if not path or oracle[len(tokens) : len(tokens) + len(path)] != list(path):
                return []
            start = len(tokens) + len(path)
            return oracle[start : start + min(length, 4)]

    accepted = {}
    for copies in (False, True):
        rule = ConfidenceTree(width=2, top_k=2, max_depth=3, max_nodes=8, context_row=4 if copies else 0)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tree_decoding, "ContextRow", lambda length: PathOracle())
            out = tree_decoding.tree_generate(target, draft, prompt, rule, NEW, temperature=0)
        assert torch.equal(out.sequences, reference), copies
        assert max(out.stats.proposed) <= 7  # a leaf at depth <= 3 and at most 4 copied tokens below it
        accepted[copies] = sum(out.stats.accepted)
    assert accepted[True] > accepted[False] + 3, accepted


@pytest.mark.parametrize("copies", ["right", "context"])
@pytest.mark.parametrize("kind", ["tree", "chain"])
def test_generate_with_processors_and_a_copied_row_equals_the_targets_own(
    kind: str, copies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through ``model.generate(custom_generate=...)``, whose processors read each node's own branch: copies
    are processed there too (a repetition penalty and no-repeat n-grams change the target's choice), beside a tree
    or beside a stop policy's chain (``CopyingChain``, :mod:`accept_head.trees.chain_copies`)."""
    target, draft = make_llama(seed=0, num_layers=2), make_llama(seed=11, num_layers=1)
    target.generation_config.eos_token_id = None
    options = dict(max_new_tokens=NEW, repetition_penalty=1.8, no_repeat_ngram_size=2)
    module = tree_decoding if kind == "tree" else chain_copies
    for prompt in PROMPTS:
        reference = greedy(target, prompt, **options)
        if copies == "right":
            row = FutureRow(reference[0].tolist(), 0, target.config.vocab_size)
            monkeypatch.setattr(module, "ContextRow", lambda length, row=row: row)
        if kind == "tree":
            rule = ConfidenceTree(width=2, top_k=2, max_depth=4, max_nodes=8, context_row=4)
        else:
            rule = CopyingChain(FixedK(2), context_row=4)
        fn = make_custom_generate(draft, rule)
        assert torch.equal(greedy(target, prompt, custom_generate=fn, **options), reference), prompt
        assert fn.last_stats.fed  # verified by tree passes
        if copies == "right":
            assert fn.last_stats.accepted[:-1] == [4] * (len(fn.last_stats.accepted) - 1)


def test_bad_context_row_is_refused() -> None:
    with pytest.raises(ValueError, match="context_row=-1 must be an integer >= 0"):
        ConfidenceTree(context_row=-1)
    with pytest.raises(ValueError, match="context_row=1.5"):
        CostTree(COST, context_row=1.5)


SAMPLES = 1200


COPY_PROMPT = [0, 0, 1, 0, 1, 2, 0, 2, 3, 0, 3, 4, 0, 4, 5, 0, 5, 6, 0, 6, 7, 0, 7, 0, 0]
"""Every pair (0, x) recurs, so after a drafted first token x there is always a row to copy below it."""


@pytest.fixture(scope="module")
def copy_pair():
    target, draft, _ = small_vocab_pair()
    return target, draft, exact_joint(target, COPY_PROMPT, 4)


def copied_decode(siblings: str, target, draft):
    rule = CostTree(COST, width=2, top_k=2, max_depth=1, max_nodes=4, siblings=siblings, context_row=3)
    if siblings == "top":
        rule = ConfidenceTree(width=2, top_k=2, max_depth=1, max_nodes=4, context_row=3)
    return lambda g: tree_decoding.tree_generate(target, draft, COPY_PROMPT, rule, 4, temperature=1.0, generator=g)


@pytest.mark.parametrize("siblings", ["top", "sampled"])
def test_sampled_decoding_with_a_copied_row_keeps_the_target_distribution(
    siblings: str, copy_pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft, joint = copy_pair
    copies, original = [], tree_decoding.add_copied_row

    def counted(tree, nodes, row, parent=-1):
        out = original(tree, nodes, row, parent)
        copies.append((len(out) - len(nodes), parent >= 0))
        return out

    monkeypatch.setattr(tree_decoding, "add_copied_row", counted)
    tokens, _ = sampled_tokens(copied_decode(siblings, target, draft), SAMPLES, len(COPY_PROMPT))
    # copied nodes joined the trees, at the root and below drafted leaves: their verification is under test
    assert sum(n for n, below in copies if not below) > SAMPLES // 2 and sum(n for n, below in copies if below) > 50
    p_first, p_second = pair_p_values(tokens, joint)
    assert p_first > ALPHA and p_second > ALPHA, (p_first, p_second)


@pytest.mark.parametrize("decoder", ["tree", "chain"])
def test_accepting_a_copied_guess_outright_is_detected(decoder: str, copy_pair, monkeypatch) -> None:
    """Drawn siblings (or a chain's candidate) then a copy: a copy accepted whenever the draws were rejected must fail
    the same check, for trees and for chains with copies (:mod:`accept_head.trees.chain_copies`)."""
    target, draft, joint = copy_pair
    monkeypatch.setattr(
        tree_verify, "try_guesses", lambda residual, guesses, g: (0, residual) if guesses else (None, residual)
    )
    decode = copied_decode("sampled", target, draft) if decoder == "tree" else copied_chain(target, draft)
    tokens, _ = sampled_tokens(decode, SAMPLES // 2, len(COPY_PROMPT))
    assert min(pair_p_values(tokens, joint)) < ALPHA


def copied_chain(target, draft):
    """Chains of one drafted candidate with copied rows (3 tokens) at T = 1 after :data:`COPY_PROMPT`."""
    return lambda g: chain_copy_generate(
        target, draft, COPY_PROMPT, FixedK(1), 4, context_row=3, temperature=1.0, generator=g
    )


P_RESIDUAL = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])


def guessed_tokens(n: int, guesses: list[int], try_them=try_guesses) -> torch.Tensor:
    generator, counts = torch.Generator().manual_seed(0), torch.zeros(len(P_RESIDUAL))
    for _ in range(n):
        i, residual = try_them(P_RESIDUAL, guesses, generator)
        counts[guesses[i] if i is not None else int(torch.multinomial(residual.float(), 1, generator=generator))] += 1
    return counts


def test_point_mass_guesses_emit_the_residual_and_a_greedy_acceptance_does_not() -> None:
    assert goodness_of_fit(guessed_tokens(4000, [3, 0]), P_RESIDUAL) > ALPHA

    def accept_twice_as_often(residual, guesses, generator):  # broken: min(1, 2 r(c)/Σr)
        u = float(torch.rand(1, generator=generator, dtype=torch.float64))
        if u < min(1.0, 2 * float(residual[guesses[0]] / residual.sum())):
            return 0, residual
        residual = residual.double().clone()
        residual[guesses[0]] = 0.0
        return None, residual

    assert goodness_of_fit(guessed_tokens(1000, [3], accept_twice_as_often), P_RESIDUAL) < ALPHA
