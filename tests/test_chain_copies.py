"""Chain speculative decoding with rows copied from the text (:mod:`accept_head.trees.chain_copies`), on tiny models.

* Greedy decoding returns exactly the target's greedy text in float32 with right, wrong and real copies, for a
  standalone draft and a feature draft (whose target features then come from the tree pass); right copies are
  accepted whole.
* Without copies (``context_row=0``) it decodes as :func:`speculative_generate` does, round for round.
* At temperature 1 the output follows the target's exact distribution (χ²), with copies at the root and below the
  chain; accepting a copied guess outright fails the same check (``tests/test_context_row.py``).
* The policy hears how many drafted candidates were accepted, not how many copied.
* A bundle's ``context_row`` makes copies its chains' default in ``generate`` and in its ``custom_generate``
  (``model.generate`` with processors: ``tests/test_context_row.py``).
"""

from __future__ import annotations

import pytest
import torch
from generate_helpers import greedy
from stats_helpers import ALPHA, exact_joint, pair_p_values, sampled_tokens, small_vocab_pair
from test_context_row import COPY_PROMPT, SAMPLES, FutureRow, copied_chain
from test_tree_decoding import NEW, PROMPTS
from tiny_models import make_llama, perturbed_copy

import accept_head.trees.chain_copies as chain_copies
from accept_head import FixedK, autoregressive_generate, speculative_generate
from accept_head.chain.baselines import Heuristic
from accept_head.models.feature_draft import FeatureDraft
from accept_head.models.features import lm_head_input


@pytest.mark.parametrize("copies", ["right", "wrong", "context"])
def test_greedy_decoding_with_copies_equals_autoregressive(copies: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unrelated random draft rarely guesses right, so right copies carry the rounds: four a round."""
    target, draft = make_llama(seed=0, num_layers=2), make_llama(seed=11, num_layers=1)
    for prompt in PROMPTS:
        reference = autoregressive_generate(target, prompt, NEW, temperature=0).sequences
        if copies != "context":
            row = FutureRow(reference[0].tolist(), int(copies == "wrong"), target.config.vocab_size)
            monkeypatch.setattr(chain_copies, "ContextRow", lambda length, row=row: row)
        out = chain_copies.chain_copy_generate(target, draft, prompt, FixedK(2), NEW, temperature=0)
        assert torch.equal(out.sequences, reference), prompt
        if copies == "right":
            assert out.stats.accepted[:-1] == [4] * (len(out.stats.accepted) - 1), out.stats.accepted


def test_a_feature_draft_reads_the_targets_features_at_the_accepted_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A feature draft reads the target's hidden states at the committed tokens, which now come from a tree pass
    whose accepted row is often the copy (right copies, a branch beside the chain): every feature it receives equals
    the target's own at that position."""
    target = make_llama(seed=0, num_layers=2)
    prompt = PROMPTS[0]
    reference = autoregressive_generate(target, prompt, NEW, temperature=0).sequences
    row = FutureRow(reference[0].tolist(), 0, target.config.vocab_size)
    monkeypatch.setattr(chain_copies, "ContextRow", lambda length: row)
    drafter = chain_copies.as_drafter(FeatureDraft.from_target(target, torch.arange(40)), target, with_hidden=False)
    received, start, commit = [], drafter.start, drafter.commit
    drafter.start = lambda tokens, features: (received.append(features.clone()), start(tokens, features))[1]
    drafter.commit = lambda tokens, features: (received.append(features.clone()), commit(tokens, features))[1]
    out = chain_copies.chain_copy_generate(target, drafter, prompt, FixedK(3), NEW, context_row=4, temperature=0)
    assert torch.equal(out.sequences, reference)
    assert max(out.stats.rows) == 2  # the copy was a branch beside the chain
    want = lm_head_input(target, out.sequences[:, :-1])[0]
    got = torch.cat(received)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_without_copies_it_decodes_as_the_chain_decoder() -> None:
    """``context_row=0`` verifies the chain through the tree pass: greedily the same rounds as the chain decoder."""
    target = make_llama(seed=0, num_layers=2)
    draft = perturbed_copy(target, relative_noise=0.15, seed=3)
    for prompt in PROMPTS:
        chain = speculative_generate(target, draft, prompt, FixedK(3), NEW, temperature=0)
        tree = chain_copies.chain_copy_generate(target, draft, prompt, FixedK(3), NEW, context_row=0, temperature=0)
        assert torch.equal(chain.sequences, tree.sequences), prompt
        assert (chain.stats.proposed, chain.stats.accepted) == (tree.stats.proposed, tree.stats.accepted)
        assert sum(chain.stats.accepted) > 0


def test_the_policy_hears_the_accepted_drafted_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Right copies win every round while the unrelated draft's candidates are rejected: an adaptive schedule must
    hear 0 accepted (and shrink its K), not the copied tokens' 4."""
    target, draft = make_llama(seed=0, num_layers=2), make_llama(seed=11, num_layers=1)
    prompt = PROMPTS[0]
    reference = autoregressive_generate(target, prompt, NEW, temperature=0).sequences
    row = FutureRow(reference[0].tolist(), 0, target.config.vocab_size)
    monkeypatch.setattr(chain_copies, "ContextRow", lambda length: row)
    heard = []
    policy = Heuristic(initial_k=4)
    update = policy.update
    policy.update = lambda state, accepted: (heard.append((state.n, accepted)), update(state, accepted))[1]
    chain_copies.chain_copy_generate(target, draft, prompt, policy, NEW, temperature=0)
    assert heard and all(accepted <= n for n, accepted in heard)
    assert sum(accepted for _, accepted in heard) < len(heard), heard


class TextRow:
    """Stands in for :class:`ContextRow`: the target's own greedy continuation after the text and the drafted
    ``path`` when the path agrees with it (a right copy), else none; records every path it was asked about."""

    def __init__(self, reference: list[int]) -> None:
        self.reference, self.paths = reference, []

    def __call__(self, tokens, length, path=()):
        self.paths.append(list(path))
        start = len(tokens)
        if list(path) != self.reference[start : start + len(path)]:
            return []
        return self.reference[start + len(path) : start + len(path) + min(length, 4)]


def test_a_copy_aware_rule_leaves_the_rest_of_the_round_to_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FixedK(4, copy_k=1)``: the decoder asks, before each decision, whether a copy would follow the candidates
    drafted so far; where one does the round stops at one drafted candidate and the copy carries on below it. The
    greedy text stays the target's (float32), with fewer drafted tokens than FixedK(4) with the same copies; the
    plain chain decoder never sets ``copy_below``, so there the rule is FixedK(4) round for round."""
    target = make_llama(seed=0, num_layers=2)
    draft = perturbed_copy(target, relative_noise=0.02, seed=3)  # right about half the time
    prompt = PROMPTS[0]
    reference = autoregressive_generate(target, prompt, NEW, temperature=0).sequences
    row = TextRow(reference[0].tolist())
    monkeypatch.setattr(chain_copies, "ContextRow", lambda length: row)
    aware, rounds = FixedK(4, copy_k=1), []
    update = aware.update
    aware.update = lambda state, accepted: (rounds.append((state.n, state.copy_below)), update(state, accepted))[1]
    out = chain_copies.chain_copy_generate(target, draft, prompt, aware, NEW, temperature=0)
    assert torch.equal(out.sequences, reference)
    assert [] in row.paths and any(row.paths)  # asked at the root and about drafted paths
    assert (1, True) in rounds and all(copy_below for n, copy_below in rounds if n == 1), rounds
    row.paths.clear()
    fixed = chain_copies.chain_copy_generate(target, draft, prompt, FixedK(4), NEW, temperature=0)
    assert torch.equal(fixed.sequences, reference)
    assert len(row.paths) <= 2 * len(fixed.stats.accepted)  # only add_copied_rows asks: at the root and below the chain
    assert out.stats.draft_calls < fixed.stats.draft_calls
    chain = speculative_generate(target, draft, prompt, FixedK(4, copy_k=1), NEW, temperature=0)
    plain = speculative_generate(target, draft, prompt, FixedK(4), NEW, temperature=0)
    assert torch.equal(chain.sequences, plain.sequences) and chain.stats.proposed == plain.stats.proposed


def test_bad_context_row_is_refused() -> None:
    target, draft = make_llama(seed=0, num_layers=2), make_llama(seed=11, num_layers=1)
    with pytest.raises(ValueError, match="context_row=-1 must be an integer >= 0"):
        chain_copies.chain_copy_generate(target, draft, [1, 2], FixedK(2), 4, context_row=-1)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=f"long_row={bad!r} must be an integer >= 0"):
            chain_copies.CopyingChain(FixedK(2), 4, long_row=bad)


def test_long_rows_copy_further_after_a_long_repeat() -> None:
    """``long_row``: after a recurring suffix of five or more tokens the copied row holds ``long_row`` tokens (after a
    shorter one, ``context_row``), the output is still exactly the target's greedy text, over a static cache too
    (which holds 16 positions past the budget: the rows are cut to fit); without it nothing changes."""
    target, draft = make_llama(seed=0, num_layers=2), make_llama(seed=11, num_layers=1)
    stretch = list(range(3, 40))
    for repeat, long_fed in ((stretch[:6], (16, 3 + 32 + 32)), (stretch[:2], (4, 3 + 4 + 4))):
        prompt = stretch + repeat
        for new in (24, 3):
            reference = autoregressive_generate(target, prompt, new, temperature=0).sequences
            for runtime, long_row in (("eager", 0), ("eager", 32), ("static", 32)):
                out = chain_copies.chain_copy_generate(
                    target, draft, prompt, FixedK(2), new, 4, temperature=0, target_runtime=runtime, long_row=long_row
                )
                assert torch.equal(out.sequences, reference), (repeat, new, runtime, long_row)
                low, high = long_fed if long_row else (4, 3 + 4 + 4)
                if new == 24:
                    assert low <= out.stats.fed[0] <= high, (repeat, long_row, out.stats.fed)


@pytest.mark.parametrize("runtime", ["eager", "static"])
def test_padding_only_copies_fill_the_width_the_pass_pads_to(runtime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``padding_only``: right copies still decode the target's greedy text, but no pass grows past the width a
    static target pads the root and the chain to (2 drafted → 4, 3 → 4: no room, 5 → 8); without it they do."""
    target, draft = make_llama(seed=0, num_layers=2), make_llama(seed=11, num_layers=1)
    prompt = PROMPTS[0]
    reference = autoregressive_generate(target, prompt, NEW, temperature=0).sequences
    row = FutureRow(reference[0].tolist(), 0, target.config.vocab_size)
    monkeypatch.setattr(chain_copies, "ContextRow", lambda length, row=row: row)
    for k, width in ((2, 4), (3, 4), (5, 8)):
        fed = {}
        for padding_only in (False, True):
            out = chain_copies.chain_copy_generate(
                target, draft, prompt, FixedK(k), NEW, 4, temperature=0, target_runtime=runtime,
                padding_only=padding_only,
            )  # fmt: skip
            assert torch.equal(out.sequences, reference), (k, padding_only)
            fed[padding_only] = out.stats.fed[:-1]  # the last round drafts fewer: the budget's end
        assert max(fed[True]) == width < max(fed[False]), (k, fed)
    with pytest.raises(ValueError, match="padding_only=1 must be True or False"):
        chain_copies.CopyingChain(FixedK(2), 4, padding_only=1)


@pytest.fixture(scope="module")
def copy_pair():
    target, draft, _ = small_vocab_pair()
    return target, draft, exact_joint(target, COPY_PROMPT, 4)


def test_sampled_decoding_with_copies_keeps_the_target_distribution(copy_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft, joint = copy_pair
    copies, original = [], chain_copies.add_copied_rows

    def counted(tree, nodes, copy, tokens, depth, room=None):
        out = original(tree, nodes, copy, tokens, depth, room)
        copies.append(sum(tree.parents[n] >= 0 for n in out[len(nodes) :]))  # copied nodes below the chain
        copies.append(-sum(tree.parents[n] < 0 for n in out[len(nodes) :]))  # at the root (counted negative)
        return out

    monkeypatch.setattr(chain_copies, "add_copied_rows", counted)
    tokens, _ = sampled_tokens(copied_chain(target, draft), SAMPLES, len(COPY_PROMPT))
    assert sum(n for n in copies if n > 0) > 50 and -sum(n for n in copies if n < 0) > 50, copies[:20]
    p_first, p_second = pair_p_values(tokens, joint)
    assert p_first > ALPHA and p_second > ALPHA, (p_first, p_second)


def test_a_bundle_decodes_chains_with_copies_on_request(tmp_path) -> None:
    """``SpecDecPP.generate(context_row=n)``: the chain with copies decodes the target's greedy text and verifies
    copied rows, over the eager or the static target; ``context_row=0`` is the plain chain; a bad value is refused."""
    from test_tree_decoding import COST, TREE_SETTINGS
    from tiny_models import tree_bundle

    from accept_head import SpecDecPP

    bundle = SpecDecPP.from_pretrained(tree_bundle(tmp_path, COST.to_dict(), TREE_SETTINGS))
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]  # 16 tokens before an EOS, copies beside the chain
    eos = bundle.eos_token_ids
    reference = autoregressive_generate(bundle.target, prompt, 20, temperature=0, eos_token_id=eos).sequences
    copied = bundle.generate(prompt, max_new_tokens=20, temperature=0, context_row=4)
    plain = bundle.generate(prompt, max_new_tokens=20, temperature=0, context_row=0)
    assert torch.equal(copied.sequences, reference) and torch.equal(plain.sequences, reference)
    assert max(copied.stats.fed) > max(plain.stats.proposed) + 1 and not hasattr(plain.stats, "fed")
    tree = bundle.generate(prompt, max_new_tokens=20, temperature=0, tree=True, context_row=4)
    assert torch.equal(tree.sequences, reference)
    sampled = [bundle.generate(prompt, max_new_tokens=12, seed=4, context_row=4).new_token_ids for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded
    longer = bundle.generate(
        list(range(20, 40)) + [20, 21, 22, 23, 24], max_new_tokens=12, temperature=0, context_row=4, long_row=16
    )
    shorter = bundle.generate(
        list(range(20, 40)) + [20, 21, 22, 23, 24], max_new_tokens=12, temperature=0, context_row=4
    )
    assert torch.equal(longer.sequences, shorter.sequences) and longer.stats.fed[0] >= shorter.stats.fed[0] + 4
    with pytest.raises(ValueError, match="long_row=16 shapes the copies beside a chain"):
        bundle.generate(prompt, max_new_tokens=4, context_row=0, long_row=16)
    padded = bundle.generate(prompt, max_new_tokens=20, temperature=0, context_row=4, padding_only=True)
    assert torch.equal(padded.sequences, reference) and max(padded.stats.fed) <= max(copied.stats.fed)
    with pytest.raises(ValueError, match="padding_only=True shapes the copies beside a chain"):
        bundle.generate(prompt, max_new_tokens=4, tree=True, context_row=4, padding_only=True)
    hf = bundle.target.generate(  # the same long copies through transformers' generate
        longer.sequences[:, :25], custom_generate=bundle.custom_generate, max_new_tokens=12, do_sample=False,
        context_row=4, long_row=16, return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(hf.sequences, longer.sequences) and hf.stats.fed == longer.stats.fed
    static = bundle.generate(prompt, max_new_tokens=20, temperature=0, context_row=4, target_runtime="static")
    assert torch.equal(static.sequences, reference) and static.stats.fed == copied.stats.fed
    # A bundle's own context_row is its chains' default; it round-trips, and a bundle without one copies nothing.
    assert bundle.context_row == 0 and "fed" not in vars(bundle.generate(prompt, max_new_tokens=8, temperature=0).stats)
    bundle.context_row = 4
    bundle.save_pretrained(tmp_path / "copying")
    loaded = SpecDecPP.from_pretrained(tmp_path / "copying", target=bundle.target, draft=bundle.draft)
    assert loaded.context_row == 4
    default = loaded.generate(prompt, max_new_tokens=20, temperature=0)
    assert torch.equal(default.sequences, reference) and default.stats.fed == copied.stats.fed
    assert (
        loaded.generate(prompt, max_new_tokens=20, temperature=0, target_runtime="static").stats.fed
        == default.stats.fed
    )
    with pytest.raises(ValueError, match="context_row=1.5"):
        SpecDecPP(bundle.target, bundle.draft, bundle.head, 0.6, context_row=1.5)
    with pytest.raises(ValueError, match="context_row=-2 must be an integer >= 0"):
        bundle.generate(prompt, max_new_tokens=4, tree=True, context_row=-2)


def test_a_bundles_custom_generate_copies_as_its_generate_does(tmp_path) -> None:
    """The bundle's own ``custom_generate`` verifies its ``context_row`` copies beside chains, as ``generate`` does:
    the same text and the same rounds; ``context_row=`` overrides, and beside ``policy=`` it is refused."""
    from test_tree_decoding import COST, TREE_SETTINGS
    from tiny_models import tree_bundle

    from accept_head import SpecDecPP

    bundle = SpecDecPP.from_pretrained(tree_bundle(tmp_path, COST.to_dict(), TREE_SETTINGS))
    bundle.context_row = 4
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]  # 16 tokens before an EOS, copies beside the chain
    bundle.target.generation_config.eos_token_id = bundle.eos_token_ids
    out = bundle.generate(prompt, max_new_tokens=16, temperature=0)
    ids = greedy(bundle.target, prompt, max_new_tokens=16, custom_generate=bundle.custom_generate)
    assert torch.equal(ids, out.sequences) and bundle.last_stats.fed == out.stats.fed
    assert out.stats.generated == 16 and max(out.stats.rows) == 2  # rounds with a copy beside the chain
    greedy(bundle.target, prompt, max_new_tokens=16, custom_generate=bundle.custom_generate, context_row=0)
    assert not hasattr(bundle.last_stats, "fed")
    with pytest.raises(ValueError, match="wrap your policy as CopyingChain"):
        greedy(
            bundle.target,
            prompt,
            max_new_tokens=4,
            custom_generate=bundle.custom_generate,
            policy=FixedK(2),
            context_row=4,
        )
