"""Speculative decoding over draft trees (:mod:`accept_head.trees.decoding`), on tiny random models.

* The draft's tree attention mask equals a hand-written one.
* Greedy tree decoding returns exactly the target's greedy continuation in float32, for a Hugging Face draft and a
  feature draft, under every growth rule (head, confidence, static).
* After a round that accepted a branch other than the first, both KV caches equal a fresh prefill of the accepted
  sequence, and the feature draft has received exactly the target's teacher-forced features.
* At temperature 1 the output follows the target's exact distribution (χ², EAGLE-2's tree and a scalar-input head
  tree); accepting the first branch unconditionally fails the same check.
* Tree node labels equal an independent recomputation from a fresh target pass; a C2T-style classifier trains on
  them and its tree decodes losslessly.
* :func:`best_subtree` equals a brute-force search over every ancestor-closed subtree of a hand-built tree.
* Bad settings raise ValueErrors naming the setting.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from stats_helpers import ALPHA, SMALL_PROMPT, goodness_of_fit, pair_p_values, sampled_tokens, small_vocab_pair
from tiny_models import distilled_feature_draft, draft_vocabulary, make_llama, perturbed_copy

import accept_head.trees.decoding as tree_decoding
from accept_head import AcceptanceHead, autoregressive_generate
from accept_head.core.costs import CostModel
from accept_head.core.hf_compat import cache_kwargs
from accept_head.core.sampling import SamplingConfig, draw_without_replacement, probabilities
from accept_head.models.feature_draft import FeatureDraft
from accept_head.models.features import lm_head_input
from accept_head.trees.drafters import FeatureTreeDrafter, ModelTreeDrafter, slot_attention
from accept_head.trees.growth import ConfidenceTree, CostTree, DraftTree, HeadTree, StaticTree, best_subtree
from accept_head.trees.labels import C2TClassifier, C2TTree, TreeLabelRecorder, node_labels
from accept_head.trees.verify import tree_mask, try_siblings

COST = CostModel(t_draft=0.004, t_target_a=0.039, t_target_b=0.00032)
PROMPTS = [[2, 10, 11, 12, 13, 14], [2, 40, 41, 7], [5]]
NEW = 24


@pytest.fixture(scope="module")
def pair():
    """A tiny float32 target and a noisy copy of it as draft (agrees often, not always)."""
    target = make_llama(seed=0, num_layers=2)
    return target, perturbed_copy(target, relative_noise=0.15, seed=3)


def rules(hidden_size: int) -> dict:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = AcceptanceHead(hidden_size, depth=1).eval()
        scalar = AcceptanceHead(hidden_size, depth=1, inputs=["logq", "entropy", "top1", "depth", "path_logq"])
    with torch.no_grad():
        head.out.bias.fill_(2.0)  # optimistic: the tree grows several depths
        scalar.out.bias.fill_(2.0)
    return {
        "head": HeadTree(head, COST, width=3, top_k=3, max_depth=5, max_nodes=24),
        "scalar head": HeadTree(scalar.eval(), COST, width=3, top_k=3, max_depth=5, max_nodes=24),
        "confidence": ConfidenceTree(width=3, top_k=3, max_depth=4, max_nodes=20),
        "cost": CostTree(COST, width=2, top_k=3, max_depth=5, max_nodes=16),
        "drawn siblings": CostTree(COST, width=2, top_k=3, max_depth=5, max_nodes=16, siblings="sampled"),  # T > 0 only
        "static": StaticTree((3, 2, 1)),
    }


# --- masks --------------------------------------------------------------------------------------------------------


def test_slot_attention_matches_a_hand_written_mask() -> None:
    # Slots 0, 1 follow the root; 2, 3 are children of 0; 4 is a child of 2. Prefix of 3 positions; slots 3, 4 new.
    mask, positions = slot_attention([-1, -1, 0, 0, 2], new=2, prefix=3, dtype=torch.float32, device="cpu")
    allowed = torch.tensor(
        [
            # prefix  s0 s1 s2 s3 s4
            [1, 1, 1, 1, 0, 0, 1, 0],  # slot 3: prefix, 0, itself
            [1, 1, 1, 1, 0, 1, 0, 1],  # slot 4: prefix, 0, 2, itself
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0] == 0, allowed)
    assert torch.equal(mask[0, 0][~allowed], torch.full((int((~allowed).sum()),), torch.finfo(torch.float32).min))
    assert positions.tolist() == [[4, 5]]  # prefix + depth − 1: depths 2 and 3
    full, depths = tree_mask([-1, 0, 0, 1])
    assert full.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert depths.tolist() == [0, 1, 1, 2]


# --- greedy: identical to the target alone ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["model", "feature", "feature-int8"])
def test_greedy_tree_decoding_equals_autoregressive(pair, kind: str) -> None:
    target, model_draft = pair
    references = [autoregressive_generate(target, p, NEW, temperature=0).sequences[0].tolist() for p in PROMPTS]
    if kind == "model":
        draft = model_draft
    else:  # distilled on the target's own text for these prompts, so its candidates get accepted (seeded)
        kept = draft_vocabulary(target.config.vocab_size, [t for text in references for t in text], leave_out=4)
        draft = distilled_feature_draft(target, kept, references, steps=100)
        if kind == "feature-int8":  # the embedded bundle's draft decodes with int8 weights
            draft = draft.quantize_("int8")
    hidden = model_draft.config.hidden_size if kind == "model" else target.config.hidden_size
    accepted = 0
    for name, rule in rules(hidden).items():
        for prompt in PROMPTS:
            reference = autoregressive_generate(target, prompt, NEW, temperature=0).sequences
            out = tree_decoding.tree_generate(target, draft, prompt, rule, NEW, temperature=0)
            assert torch.equal(out.sequences, reference), (name, prompt)
            assert out.stats.generated == NEW and out.stats.target_calls == len(out.stats.fed)
            accepted += sum(out.stats.accepted)
    assert accepted > 0  # drafted tokens were accepted: the verification path is exercised


def test_a_draft_with_a_shorter_context_does_not_shorten_tree_decoding(pair) -> None:
    """Only the target's context bounds the output: a draft that reads 12 positions grows shallower trees as it runs
    out of room, then none, and the target writes the rest alone — still its own greedy text, all 30 tokens."""
    target, model_draft = pair
    draft = copy.deepcopy(model_draft)
    draft.config.max_position_embeddings = 12
    rule = rules(draft.config.hidden_size)["confidence"]
    prompt = PROMPTS[0]
    reference = autoregressive_generate(target, prompt, 30, temperature=0).sequences
    out = tree_decoding.tree_generate(target, draft, prompt, rule, 30, temperature=0)
    assert torch.equal(out.sequences, reference) and out.stats.generated == 30


# --- caches and features after a round ------------------------------------------------------------------------------


def layer_tensors(cache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]


def fresh_cache(model, ids: list[int]) -> list[torch.Tensor]:
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=torch.tensor([ids]), **cache_kwargs(model, cache))
    return layer_tensors(cache)


def test_caches_after_a_non_first_branch_equal_a_fresh_prefill(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = pair
    seen = {"target": [], "draft": [], "rows": []}
    commit_nodes, verify_greedy = tree_decoding.commit_nodes, tree_decoding.verify_greedy

    def record_target(cache, prefix, nodes):
        commit_nodes(cache, prefix, nodes)
        seen["target"].append(layer_tensors(cache))

    def record_row(argmax, rows, nodes):
        out = verify_greedy(argmax, rows, nodes)
        seen["rows"].append(out[:2])
        return out

    class Recording(ModelTreeDrafter):
        def commit(self, tokens, features, slots):
            super().commit(tokens, features, slots)
            seen["draft"].append((self.prefix, layer_tensors(self.cache)))

    monkeypatch.setattr(tree_decoding, "commit_nodes", record_target)
    monkeypatch.setattr(tree_decoding, "verify_greedy", record_row)
    rule = ConfidenceTree(width=4, top_k=4, max_depth=4, max_nodes=40)
    out = tree_decoding.tree_generate(target, Recording(draft), PROMPTS[0], rule, NEW, temperature=0)
    sequence = out.sequences[0].tolist()
    assert any(row > 0 and m > 0 for row, m in seen["rows"]), seen["rows"]  # a later branch won at least once
    for tensors in seen["target"]:
        length = tensors[0].shape[-2]
        for got, want in zip(tensors, fresh_cache(target, sequence[:length]), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    for prefix, tensors in seen["draft"]:
        assert tensors[0].shape[-2] == prefix
        for got, want in zip(tensors, fresh_cache(draft, sequence[:prefix]), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_feature_draft_receives_the_teacher_forced_features(pair) -> None:
    target, _ = pair
    received = []

    class Recording(FeatureTreeDrafter):
        def start(self, prompt, features):
            received.append(features.clone())
            super().start(prompt, features)

        def commit(self, tokens, features, slots):
            received.append(features.clone())
            super().commit(tokens, features, slots)

    draft = Recording(FeatureDraft.from_target(target, torch.arange(40)), target)
    out = tree_decoding.tree_generate(target, draft, PROMPTS[0], rules(32)["head"], NEW, temperature=0)
    sequence = out.sequences
    want = lm_head_input(target, sequence[:, :-1])[0]
    got = torch.cat(received)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_pruned_feature_draft_proposes_over_its_kept_ids_as_over_the_whole_vocabulary(pair, temperature) -> None:
    """The feature tree drafter gives the tree its kept ids' logits alone (``TreeStep.support``, a third of the
    vocabulary-wide work for the embedded pair): the tree it grows, the children it draws and the q rows verification
    reads are those of whole-vocabulary logits (−inf outside the kept ids), token for token, greedy and at T = 1 with
    drawn siblings."""
    target, _ = pair
    kept = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(4))[:40]  # not ascending
    draft = FeatureDraft.from_target(target, kept)

    class WholeVocabulary(FeatureTreeDrafter):
        def _run(self, *args):
            return super()._run(*args).over_vocabulary(self.vocab_size)

    drafter = FeatureTreeDrafter(draft, target)
    drafter.start(PROMPTS[0], lm_head_input(target, torch.tensor([PROMPTS[0][:-1]]))[0])
    step = drafter.root()
    assert torch.equal(step.support, kept.sort().values) and step.logits.shape == (1, 40)
    rule = CostTree(COST, width=2, top_k=3, max_depth=4, max_nodes=12, siblings="sampled" if temperature else "top")
    sequences, trees = [], []
    for make in (FeatureTreeDrafter, WholeVocabulary):
        grown = []
        out = tree_decoding.tree_generate(
            target, make(draft, target), PROMPTS[0], rule, NEW, temperature,
            generator=torch.Generator().manual_seed(0), observe=lambda tree, nodes, logits: grown.append(tree),
        )  # fmt: skip
        sequences.append(out.sequences)
        trees.append(grown)
    assert torch.equal(*sequences)
    assert [t.tokens for t in trees[0]] == [t.tokens for t in trees[1]] and max(len(t.tokens) for t in trees[0]) > 2
    for ours, whole in zip(*trees):
        assert ours.dists.keys() == whole.dists.keys()
        for node, q in ours.dists.items():
            assert q.shape == (target.config.vocab_size,)
            torch.testing.assert_close(q, whole.dists[node], atol=1e-7, rtol=1e-6)


# --- sampling: the target's exact distribution ----------------------------------------------------------------------

SAMPLES = 1500


@pytest.fixture(scope="module")
def small():
    return small_vocab_pair()


def sample_tree(target, draft, rule=None):
    rule = rule or ConfidenceTree(width=2, top_k=2, max_depth=2, max_nodes=6)
    return lambda g: tree_decoding.tree_generate(target, draft, SMALL_PROMPT, rule, 4, temperature=1.0, generator=g)


def scalar_head_tree(hidden_size: int) -> HeadTree:
    """A head tree whose head reads only the draft's numbers (scores every node as proposed), optimistic."""
    head = AcceptanceHead(hidden_size, depth=0, inputs=["logq", "top1", "depth"], residual_on="logq").eval()
    with torch.no_grad():
        head.out.bias.fill_(1.0)
    return HeadTree(head, COST, width=2, top_k=2, max_depth=3, max_nodes=6)


@pytest.mark.parametrize("rule", ["confidence", "scalar head", "drawn siblings"])
def test_sampled_tree_decoding_keeps_the_target_distribution(small, rule: str) -> None:
    target, draft, joint = small
    tree_rule = None if rule == "confidence" else scalar_head_tree(draft.config.hidden_size)
    if rule == "drawn siblings":  # children drawn without replacement, verified recursively
        tree_rule.siblings = "sampled"
    tokens, hit_rate = sampled_tokens(sample_tree(target, draft, tree_rule), SAMPLES, len(SMALL_PROMPT))
    assert hit_rate > 0.3, hit_rate  # draft nodes were accepted often: the acceptance rule itself is under test
    p_first, p_second = pair_p_values(tokens, joint)
    assert p_first > ALPHA and p_second > ALPHA, (p_first, p_second)


def test_broken_tree_verification_is_detected(small, monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepting the first branch's first node unconditionally must fail the same χ² check."""

    def accept_first(probs, rows, nodes, generator):
        if not rows:
            return -1, 0, int(torch.multinomial(probs[0].float(), 1, generator=generator))
        return 0, 1, int(torch.multinomial(probs[nodes[0][0]].float(), 1, generator=generator))

    target, draft, joint = small
    monkeypatch.setattr(tree_decoding, "verify_sampled", accept_first)
    # A quarter of the samples suffice: the broken rule is off by far more than the check resolves.
    tokens, _ = sampled_tokens(sample_tree(target, draft), SAMPLES // 4, len(SMALL_PROMPT))
    p_values = pair_p_values(tokens, joint)
    assert min(p_values) < ALPHA, p_values


P_TARGET = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
Q_DRAFT = torch.tensor([0.1, 0.5, 0.05, 0.2, 0.0, 0.15])  # no mass on token 4, more than p on tokens 1, 3, 5


def drawn_sibling_outcomes(k: int, n: int, keep=lambda drawn: drawn) -> tuple[torch.Tensor, float]:
    """Token counts of ``n`` rounds of :func:`try_siblings` on ``k`` siblings drawn from Q_DRAFT (``keep`` filters
    the draw before verification), and the share of rounds that accepted a sibling."""
    generator, counts, accepted = torch.Generator().manual_seed(0), torch.zeros(len(P_TARGET)), 0
    for _ in range(n):
        drawn = keep(draw_without_replacement(Q_DRAFT[None], k, generator)[0].tolist())
        i, residual = try_siblings(P_TARGET, Q_DRAFT, drawn, generator)
        accepted += i is not None
        counts[drawn[i] if i is not None else int(torch.multinomial(residual.float(), 1, generator=generator))] += 1
    return counts, accepted / n


@pytest.mark.parametrize("k", [1, 3])
def test_drawn_siblings_emit_the_target_distribution(k: int) -> None:
    """Siblings drawn without replacement and tried in draw order emit exactly p; one sibling is accepted as a chain
    candidate is (Σ min(p, q) = 0.54), and more siblings are accepted more often."""
    counts, accepted = drawn_sibling_outcomes(k, 4000)
    assert goodness_of_fit(counts, P_TARGET) > ALPHA
    chain = float(torch.minimum(P_TARGET, Q_DRAFT).sum())
    assert accepted == pytest.approx(chain, abs=0.03) if k == 1 else accepted > chain + 0.15


def test_the_draw_follows_q_without_replacement() -> None:
    """The first of k draws follows q; the second follows q renormalised without the first (token 1 first)."""
    draws = draw_without_replacement(Q_DRAFT.expand(6000, -1), 2, torch.Generator().manual_seed(1))
    assert goodness_of_fit(torch.bincount(draws[:, 0], minlength=6).float(), Q_DRAFT) > ALPHA
    second = draws[draws[:, 0] == 1, 1]
    without = Q_DRAFT.clone()
    without[1] = 0
    assert goodness_of_fit(torch.bincount(second, minlength=6).float(), without) > ALPHA
    assert (draws[:, 0] != draws[:, 1]).all() and not (draws == 4).any()


def test_dropping_drawn_siblings_by_their_own_value_is_detected() -> None:
    """Which siblings are tried must be fixed before the draw: keeping only the likely ones (q > 0.12) breaks p."""
    counts, _ = drawn_sibling_outcomes(3, 1000, keep=lambda drawn: [t for t in drawn if Q_DRAFT[t] > 0.12])
    assert goodness_of_fit(counts, P_TARGET) < ALPHA


def test_sibling_counts_follow_the_parents_distribution() -> None:
    """Drawn siblings: a flat draft distribution gets more children than a peaked one, within max_nodes; a floor
    (threshold) keeps out siblings worth less."""
    rule = CostTree(COST, top_k=4, max_nodes=6, siblings="sampled")
    tree = DraftTree(forwards=1, sampled=True)
    assert rule.sibling_counts(tree, [-1], [[0.97, 0.01, 0.01, 0.01]]) == [1]
    flat = rule.sibling_counts(tree, [-1], [[0.3, 0.25, 0.2, 0.15]])
    assert flat == [4]
    assert sum(rule.sibling_counts(tree, [-1, -1], [[0.3, 0.25, 0.2, 0.15]] * 2)) == 6  # max_nodes
    strict = CostTree(COST, top_k=4, threshold=0.85, siblings="sampled")
    assert strict.sibling_counts(tree, [-1], [[0.3, 0.25, 0.2, 0.15]]) == [2]  # v ≥ 0.15: 0.3, 0.7·0.25 (not 0.105)


# --- the growth rule --------------------------------------------------------------------------------------------------

# A hand-built tree: node i's parent and value (values never rise from a parent to its child).
PARENTS = [-1, -1, -1, 0, 0, 1, 3, 3, 6]
VALUES = [0.9, 0.5, 0.05, 0.8, 0.1, 0.3, 0.7, 0.2, 0.6]


def brute_force(parents, values, cost, max_nodes, floor=0.0, forwards=None) -> float:
    depths = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    best = 1.0 / cost.t_target(0)
    for size in range(1, min(max_nodes, len(parents)) + 1):
        for subset in itertools.combinations(range(len(parents)), size):
            if any(parents[n] >= 0 and parents[n] not in subset for n in subset):
                continue  # not ancestor-closed
            if any(values[n] < floor for n in subset):
                continue
            steps = max(depths[n] for n in subset) if forwards is None else forwards
            draft = cost.t_draft + (steps - 1) * (cost.t_draft_next or cost.t_draft)  # the first after a target pass
            best = max(best, (1 + sum(values[n] for n in subset)) / (draft + cost.t_target(size)))
    return best


@pytest.mark.parametrize(
    "cost",
    [
        COST,
        CostModel(t_draft=0.03, t_target_a=0.04, t_target_b=0.01),
        CostModel(0.001, 0.01, 0.02),
        CostModel(t_draft=0.03, t_target_a=0.04, t_target_b=0.01, t_draft_next=0.005),
    ],
    ids=["cpu-like", "expensive-draft", "expensive-width", "cheaper-later-steps"],
)
@pytest.mark.parametrize("max_nodes,floor,forwards", [(9, 0.0, None), (4, 0.0, None), (9, 0.25, None), (9, 0.0, 4)])
def test_best_subtree_equals_brute_force(cost, max_nodes, floor, forwards) -> None:
    nodes, rate = best_subtree(PARENTS, VALUES, cost, max_nodes, floor, forwards)
    assert rate == pytest.approx(brute_force(PARENTS, VALUES, cost, max_nodes, floor, forwards))
    assert all(PARENTS[n] < 0 or PARENTS[n] in nodes for n in nodes) and len(nodes) <= max_nodes


def test_head_tree_grows_only_while_a_depth_pays() -> None:
    head = AcceptanceHead(4, depth=0)

    def chain_tree(score: float) -> DraftTree:
        tree = DraftTree(forwards=1)
        tree.add(7, -1, 0.9, score)
        return tree

    rule = HeadTree(head, COST, max_depth=8)
    assert rule.grow(chain_tree(0.95))  # a likely node: its child would add ~0.9 tokens for one draft step
    assert not rule.grow(chain_tree(0.02))  # an unlikely one: the next depth cannot pay for the draft step
    assert not HeadTree(head, COST, threshold=0.5).grow(chain_tree(0.4))  # v < 1 − h: not expanded


def test_the_head_decides_how_deep_the_tree_grows(pair) -> None:
    """With the first depth always fed (min_depth=2) the head has scored it when the cost rule first asks whether a
    further depth pays: a head that expects acceptance drafts deep trees, one that expects rejection stops."""
    target, draft = pair
    forwards = {}
    for bias in (-4.0, 4.0):
        head = AcceptanceHead(draft.config.hidden_size, depth=0)
        with torch.no_grad():
            head.out.weight.zero_()
            head.out.bias.fill_(bias)
        rule = HeadTree(head, COST, width=3, top_k=3, min_depth=2)
        out = tree_decoding.tree_generate(target, draft, PROMPTS[0], rule, NEW, temperature=0)
        assert torch.equal(out.sequences, autoregressive_generate(target, PROMPTS[0], NEW, temperature=0).sequences)
        forwards[bias] = out.stats.draft_calls / out.stats.target_calls
    assert forwards[-4.0] <= 2.0 < 4.0 < forwards[4.0], forwards


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda h: HeadTree(h, COST, width=0), r"width=0 must be an integer >= 1"),
        (lambda h: HeadTree(h, COST, max_depth=0), r"max_depth=0 must be an integer >= 1"),
        (lambda h: HeadTree(h, COST, max_nodes=0), r"max_nodes=0 must be an integer >= 1"),
        (lambda h: HeadTree(h, COST, top_k=0), r"top_k=0 must be an integer >= 1"),
        (lambda h: HeadTree(h, COST, threshold=1.5), r"threshold=1.5 must be in \(0, 1\]"),
        (lambda h: HeadTree(h, COST, min_depth=0), r"min_depth=0 must be an integer >= 1"),
        (lambda h: HeadTree(h, COST, max_depth=3, min_depth=4), r"min_depth=4 must be <= max_depth=3"),
        (lambda h: HeadTree(h, COST, siblings="random"), r"siblings='random' must be one of \('top', 'sampled'\)"),
        (lambda h: ConfidenceTree(width=-1), r"width=-1 must be an integer >= 1"),
        (lambda h: ConfidenceTree(max_depth=0), r"max_depth=0"),
        (lambda h: StaticTree((2, 0)), r"shape\[1\]=0 must be an integer >= 1"),
        (lambda h: StaticTree(()), r"shape=\(\) is empty"),
        (lambda h: StaticTree((2,), max_nodes=0), r"max_nodes=0"),
    ],
)
def test_bad_tree_settings_raise(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(AcceptanceHead(4, depth=0))


def test_head_of_another_width_is_refused(pair) -> None:
    target, draft = pair
    rule = HeadTree(AcceptanceHead(7, depth=0), COST)
    with pytest.raises(ValueError, match="hidden size 7"):
        tree_decoding.tree_generate(target, draft, PROMPTS[0], rule, 4, temperature=0)


# --- the bundle: generate(..., tree=True) -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree_bundle_dir(tmp_path_factory):
    """A saved tiny bundle (fp32 target and draft folders) with a cost model and tree settings."""
    from tiny_models import tree_bundle

    return tree_bundle(tmp_path_factory.mktemp("tree-bundle"), COST.to_dict(), TREE_SETTINGS)


TREE_SETTINGS = {"width": 2, "top_k": 3, "max_depth": 4, "max_nodes": 12}


def test_bundle_tree_generation_round_trips_and_equals_greedy(tree_bundle_dir) -> None:
    from accept_head import SpecDecPP

    loaded = SpecDecPP.from_pretrained(tree_bundle_dir)
    target, draft, head = loaded.target, loaded.draft, loaded.head
    assert loaded.tree == TREE_SETTINGS and loaded.tree_rule().max_nodes == 12
    prompt = [5, 9, 10, 11, 12, 13]
    eos = loaded.eos_token_ids
    reference = autoregressive_generate(target, prompt, 20, temperature=0, eos_token_id=eos).sequences
    out = loaded.generate(prompt, max_new_tokens=20, temperature=0, tree=True)
    assert torch.equal(out.sequences, reference) and len(out.stats.fed) == out.stats.target_calls
    assert out.stats.generated > 1  # not an immediate EOS
    copying = SpecDecPP(target, draft, head, 0.6, cost_model=COST.to_dict(), tree={**TREE_SETTINGS, "context_row": 4})
    assert copying.tree_rule().context_row == 4  # a bundle's tree settings may carry a copied row
    assert torch.equal(copying.generate(prompt, max_new_tokens=20, temperature=0, tree=True).sequences, reference)
    sampled = [loaded.generate(prompt, max_new_tokens=12, seed=4, tree=True).new_token_ids for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded
    assert loaded.tree_rule(threshold=0.5).floor == pytest.approx(0.5)
    assert loaded.tree_rule().siblings == "sampled"  # at T > 0 children are drawn unless the settings say otherwise
    top = SpecDecPP(target, draft, head, 0.6, cost_model=COST.to_dict(), tree={**TREE_SETTINGS, "siblings": "top"})
    assert top.tree_rule().siblings == "top"
    with pytest.raises(ValueError, match="max_depth=0"):
        SpecDecPP(target, draft, head, 0.6, cost_model=COST.to_dict(), tree={"max_depth": 0})
    with pytest.raises(ValueError, match=r"tree settings \['depth'\] are unknown"):
        SpecDecPP(target, draft, head, 0.6, cost_model=COST.to_dict(), tree={"depth": 3})
    with pytest.raises(ValueError, match="no cost model"):
        SpecDecPP(target, draft, head, 0.6).generate(prompt, max_new_tokens=4, tree=True)


def test_chat_tree_mode_reports_tokens_per_round_and_tree_size(tree_bundle_dir) -> None:
    import io

    from accept_head.specdecpp.chat import main as chat_main

    out = io.StringIO()
    argv = ["chat", "--bundle", str(tree_bundle_dir), "--prompt", "write code", "--max_new_tokens", "10", "--tree"]
    assert chat_main([*argv, "--temperature", "0"], out=out) == 0
    text = out.getvalue()
    assert "tokens/round" in text and "candidates/round" in text and "HeadTree(" in text and "(same tokens)" in text
    # Through generate's custom_generate path: a context-reading processor still gives the target's own tokens.
    out = io.StringIO()
    assert chat_main([*argv, "--temperature", "0", "--repetition_penalty", "1.3"], out=out) == 0
    assert "candidates/round" in out.getvalue() and "(same tokens)" in out.getvalue()
    with pytest.raises(SystemExit):
        chat_main([*argv, "--policy", "fixed:3"], out=io.StringIO())


# --- tree labels and the C2T-style baseline ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_node_labels_equal_an_independent_recomputation(pair, temperature: float) -> None:
    target, draft = pair
    sampling = SamplingConfig(temperature)
    rounds = []

    def observe(tree, nodes, logits):
        rounds.append((tree, list(nodes), node_labels(tree, nodes, logits, sampling)))

    rule = ConfidenceTree(width=2, top_k=3, max_depth=3, max_nodes=8)
    generator = torch.Generator().manual_seed(0)
    prompt = PROMPTS[0]
    out = tree_decoding.tree_generate(
        target, draft, prompt, rule, 16, temperature, generator=generator, observe=observe
    )
    sequence, start, checked = out.sequences[0].tolist(), len(prompt), 0
    assert len(rounds) == out.stats.target_calls
    for (tree, nodes, labels), accepted in zip(rounds, out.stats.accepted):
        assert set(labels) == {n for n, p in enumerate(tree.parents) if p < 0 or p in nodes}  # parent scored
        for node, label in labels.items():
            context = sequence[:start] + [tree.tokens[n] for n in tree.path(node)[:-1]]
            with torch.no_grad():
                fresh = target(input_ids=torch.tensor([context])).logits[0, -1]
            want = float(probabilities(fresh, sampling)[tree.tokens[node]])
            assert label == pytest.approx(want, abs=1e-5), (node, label, want)
            checked += 1
        start += accepted + 1
    assert checked > 20 and any(n not in nodes for tree, nodes, labels in rounds for n in labels)  # unverified too


def test_c2t_classifier_trains_on_tree_labels_and_decodes_losslessly(pair) -> None:
    target, draft = pair
    recorder = TreeLabelRecorder(SamplingConfig(1.0))
    rule = ConfidenceTree(width=3, top_k=3, max_depth=3, max_nodes=12)
    for seed, prompt in enumerate(PROMPTS[:2]):
        generator = torch.Generator().manual_seed(seed)
        tree_decoding.tree_generate(target, draft, prompt, rule, 16, 1.0, generator=generator, observe=recorder.observe)
    assert len(recorder.labels) == len(recorder.features) > 20 and recorder.hidden
    assert len(recorder.hidden) == len(recorder.hidden_labels)
    classifier = C2TClassifier.fit(recorder.features, recorder.labels, steps=200)
    x, y = torch.tensor(recorder.features), torch.tensor(recorder.labels)
    trained = torch.nn.functional.binary_cross_entropy_with_logits(classifier(x), y)
    constant = torch.nn.functional.binary_cross_entropy(y.mean().expand_as(y), y)
    assert trained < constant  # it learned something beyond the base rate
    # C2T's three inputs and the node's own log q → 16 → 1 (C2T's paper: 3 inputs, 81 weights here)
    assert sum(p.numel() for p in classifier.parameters()) == 4 * 16 + 16 + 16 + 1
    c2t = C2TTree(classifier, COST, width=2, top_k=3, max_depth=4, max_nodes=12)
    reference = autoregressive_generate(target, PROMPTS[1], NEW, temperature=0).sequences
    assert torch.equal(tree_decoding.tree_generate(target, draft, PROMPTS[1], c2t, NEW, 0).sequences, reference)
    with pytest.raises(ValueError, match="as many labels"):
        C2TClassifier.fit([[0.0, 1.0, 1.0]], [])


def test_engine_runs_the_tree_methods_like_any_other(tree_bundle_dir) -> None:
    from accept_head.engine.pair_loading import load_pair
    from accept_head.engine.runner import MethodSpec, Runner, aggregate

    pair = load_pair(str(tree_bundle_dir))
    runner = Runner(pair, max_new_tokens=12, temperature=0.0)
    ids = [5, 9, 10, 11, 12, 13]
    eos = pair.eos_token_id
    reference = autoregressive_generate(pair.target, ids, 12, temperature=0.0, eos_token_id=eos).sequences
    specs = [
        MethodSpec("head_tree", {"max_nodes": 6}),
        MethodSpec("confidence_tree", {"width": 2, "top_k": 2, "max_depth": 3, "max_nodes": 6}),
        MethodSpec("static_tree", {"shape": [2, 1]}),
    ]
    for spec in specs:
        result = runner.decoder(spec)(ids, torch.Generator().manual_seed(0))
        assert torch.equal(result.sequences, reference), spec.name
        summary = aggregate(spec.name, [result.stats], COST)
        assert summary.generated == result.stats.generated and summary.modeled_tokens_per_second > 0
    assert runner.tree_rule(specs[0]).max_nodes == 6 and runner.tree_rule(specs[0]).width == TREE_SETTINGS["width"]
    assert specs[0].name == "SpecDec++ tree max_nodes=6"
    with pytest.raises(ValueError, match="bad parameters"):
        runner.tree_rule(MethodSpec("confidence_tree", {"depth": 3}))
