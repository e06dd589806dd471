"""What is trained on tree labels and how trees are priced offline (:mod:`accept_head.training.tree_recipe`), and the
draft-tree rows of ``eval bench``, on tiny random models.

* ``price_trees`` picks, for each scorer, the subtree a brute-force search over every ancestor-closed subtree picks,
  and scores it with the true values; with the labels as scores (the oracle) nothing beats it.
* The soft-label AUC equals the AUC of the expanded binary sample; BCE equals torch's.
* The node scorers (the node's q, EAGLE-2's path probability, AdaEDL's entropy bound, the hidden-only head) and the
  Brier score equal an independent recomputation on hand-made rounds; the hidden-only head reads the hidden state
  alone, is seeded, and stays out of the all-node metrics.
* ``TreeModels`` round-trip through safetensors; missing models and folders give clear errors.
* The C2T classifier reads the node's own log draft probability besides C2T's three features (its label is
  conditional on the parent), and classifiers saved with the three features alone still load and score alike.
* ``python -m train.trees`` on a tiny bundle writes trees.json and models that load, and a rerun reuses the cached
  rounds instead of decoding again.
* The tree calibration (an isotonic map from the bundle head's probability to node labels, per mode) is fitted on
  the training rounds, checked on the check rounds beside the chain calibration, and exported into the bundle, where
  ``tree_rule`` and the runner's ``head_tree`` use it (the chain policy keeps its own map) and greedy trees stay equal
  to autoregressive decoding; bundles without one price trees with the chain calibration.
* The runner decodes ``c2t_tree`` and ``head_tree head=tree`` losslessly (greedy equality) with those models, refuses
  them without, and plans with the cost model it is given; the bench's draft-tree grids reject bad entries.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from sklearn.metrics import roc_auc_score
from tiny_models import tree_bundle

from accept_head import AcceptanceHead, autoregressive_generate
from accept_head.core.costs import CostModel
from accept_head.engine.pair_loading import load_pair
from accept_head.engine.runner import MethodSpec, Runner
from accept_head.evaluation.bench import draft_tree_specs
from accept_head.training import tree_recipe
from accept_head.trees.growth import DraftTree
from accept_head.trees.labels import (
    C2T_FEATURES,
    LEGACY_FEATURES,
    C2TClassifier,
    C2TTree,
    LabelledRound,
    TreeModels,
    c2t_features,
)

COST = CostModel(t_draft=0.004, t_target_a=0.039, t_target_b=0.002)
TREE = {"width": 2, "top_k": 3, "max_depth": 4, "max_nodes": 12}


def hand_round() -> LabelledRound:
    """Root → 0 (label .9), 1 (.3); 0 → 2 (.8), 3 (.5); 2 → 4 (.6); 1 → 5 (.9); node 6 (child of 5) unlabelled."""
    parents = [-1, -1, 0, 0, 2, 1, 5]
    labels = {0: 0.9, 1: 0.3, 2: 0.8, 3: 0.5, 4: 0.6, 5: 0.9}
    probs = [0.7, 0.2, 0.6, 0.3, 0.5, 0.4, 0.9]
    features = [[0.0, 1.0, 1.0]] * len(parents)
    return LabelledRound(parents, probs, features, labels, {}, forwards=3)


def brute_force(parents, values, truth, cost: CostModel) -> tuple[float, float]:
    """(true expected tokens, cost) of the ancestor-closed subset with the best rate by ``values``."""
    best, best_rate = (1.0, cost.t_target(0)), 1.0 / cost.t_target(0)
    for size in range(1, len(parents) + 1):
        for subset in itertools.combinations(range(len(parents)), size):
            if any(parents[n] >= 0 and parents[n] not in subset for n in subset):
                continue
            depths = {n: 1 if parents[n] < 0 else None for n in subset}
            for n in subset:  # parents precede children
                depths[n] = 1 if parents[n] < 0 else depths[parents[n]] + 1
            seconds = max(depths.values()) * cost.t_draft + cost.t_target(size)
            rate = (1 + sum(values[n] for n in subset)) / seconds
            if rate > best_rate + 1e-12:
                best_rate, best = rate, (1 + sum(truth[n] for n in subset), seconds)
    return best


def path_products(parents, scores):
    out = []
    for n, p in enumerate(parents):
        out.append((1.0 if p < 0 else out[p]) * scores[n])
    return out


@pytest.mark.parametrize("scorer", ["oracle", "draft", "flat"])
def test_price_trees_picks_the_brute_force_subtree_and_scores_it_with_the_truth(scorer: str) -> None:
    r = hand_round()
    nodes = r.labelled()
    assert nodes == [0, 1, 2, 3, 4, 5]  # node 6's parent was not verified: no label, not priced
    parents = [r.parents[n] for n in nodes]
    truth = path_products(parents, [r.labels[n] for n in nodes])
    scores = {"oracle": r.labels, "draft": dict(enumerate(r.probs)), "flat": dict.fromkeys(nodes, 0.5)}[scorer]
    values = path_products(parents, [scores[n] for n in nodes])
    tokens, seconds = brute_force(parents, values, truth, COST)
    priced = tree_recipe.price_trees([r], lambda _: scores, COST, max_nodes=10)
    assert priced["expected_tokens_per_round"] == pytest.approx(tokens)
    assert priced["expected_tokens_per_second"] == pytest.approx(tokens / seconds)
    oracle = tree_recipe.price_trees([r], lambda _: r.labels, COST, max_nodes=10)
    assert priced["expected_tokens_per_second"] <= oracle["expected_tokens_per_second"] + 1e-12


def test_top_children_are_each_parents_most_probable_child() -> None:
    # Root's children 0 (.7) and 1 (.2); node 0's children 2 (.6) and 3 (.3); 4, 5, 6 are only children.
    assert tree_recipe.top_children(hand_round()) == {0, 2, 4, 5, 6}


def test_soft_auc_and_bce_match_their_definitions() -> None:
    labels, scores = [1.0, 0.0, 0.25, 0.75, 0.5], [0.9, 0.1, 0.4, 0.2, 0.6]
    # A soft label y is y positives and 1 - y negatives: with quarter weights the sample is 4 copies of each row.
    y, s = [], []
    for label, score in zip(labels, scores):
        positives = round(4 * label)
        y += [1] * positives + [0] * (4 - positives)
        s += [score] * 4
    assert tree_recipe.soft_auc(labels, scores) == pytest.approx(roc_auc_score(y, s))
    assert tree_recipe.soft_auc([1.0, 1.0], [0.2, 0.3]) is None  # one class only
    expected = torch.nn.functional.binary_cross_entropy(torch.tensor(scores), torch.tensor(labels))
    assert tree_recipe.bce(labels, scores) == pytest.approx(float(expected), rel=1e-5)


def scored_rounds() -> list[LabelledRound]:
    """Two hand-made rounds with all four C2T features per node (the log joint summed along the path), hidden states
    (width 4) of some nodes, and one entropy (7 nats) whose AdaEDL bound is negative."""
    g = torch.Generator().manual_seed(0)
    rounds = []
    for parents, probs, entropies, labels, fed in (
        ([-1, -1, 0, 0, 2], [0.7, 0.2, 0.6, 0.3, 0.5], [0.5, 2.0, 1.0, 7.0, 0.1], [1.0, 0.0, 0.8, 0.1, 0.6], (0, 2)),
        ([-1, 0, 1, 1], [0.9, 0.4, 0.05, 0.5], [0.2, 3.0, 6.0, 1.5], [1.0, 0.3, 0.0, 0.7], (0, 1)),
    ):
        features = []
        for n, parent in enumerate(parents):
            log_joint = math.log(probs[n]) + (0.0 if parent < 0 else features[parent][0])
            depth = 1.0 if parent < 0 else features[parent][2] + 1
            features.append([log_joint, entropies[n], depth, math.log(probs[n])])
        hidden = {n: torch.randn(4, generator=g) for n in fed}
        rounds.append(LabelledRound(parents, probs, features, dict(enumerate(labels)), hidden, forwards=3))
    return rounds


def test_node_scorers_and_the_brier_score_equal_an_independent_recomputation() -> None:
    rounds = scored_rounds()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        chain = AcceptanceHead(4, depth=1).eval()
    models = TreeModels({"greedy": C2TClassifier.fit([f for r in rounds for f in r.features], [0.5] * 9, 5)})
    models.heads["greedy"] = chain
    bundle = SimpleNamespace(head=chain, calibration_for=lambda greedy: None)
    hidden_only = tree_recipe.fit_hidden_head(4, 2, rounds, epochs=3, lr=1e-2, batch_size=2, seed=3)
    again = tree_recipe.fit_hidden_head(4, 2, rounds, epochs=3, lr=1e-2, batch_size=2, seed=3)
    assert hidden_only.inputs == ("hidden",) and hidden_only.depth == 2 and not hidden_only.scalar_inputs
    assert all(torch.equal(a, b) for a, b in zip(hidden_only.state_dict().values(), again.state_dict().values()))
    table = tree_recipe.scorers(bundle, models, True, None, hidden_only)
    assert "draft probability (EAGLE-2)" not in table  # the node's own q is not EAGLE-2's score: its path's is
    bound = "entropy bound (AdaEDL, γ=0.2)"
    assert tree_recipe.ENTROPY_BOUND == bound
    for r in rounds:
        for n in r.labelled():
            path, node = 1.0, n
            while node >= 0:
                path, node = path * r.probs[node], r.parents[node]
            with torch.no_grad():
                head = float(torch.sigmoid(hidden_only(r.hidden[n]))) if n in r.hidden else r.probs[n]
            expected = {"draft probability q": r.probs[n], "path probability (EAGLE-2)": path}
            expected |= {bound: 1 - math.sqrt(0.2 * r.features[n][1]), tree_recipe.HIDDEN_ONLY: head}
            for name, value in expected.items():
                assert table[name](r)[n] == pytest.approx(value, rel=1e-5), (name, n)
    assert table[bound](rounds[0])[3] < 0  # H = 7 > 1/γ: counted as 0 below
    for name in ("draft probability q", "path probability (EAGLE-2)", bound, tree_recipe.HIDDEN_ONLY):
        labels = [r.labels[n] for r in rounds for n in r.labelled()]
        scores = [min(max(table[name](r)[n], 0.0), 1.0) for r in rounds for n in r.labelled()]
        metrics = tree_recipe.node_metrics(rounds, table[name], fed_only=False)
        brier = torch.nn.functional.mse_loss(torch.tensor(scores), torch.tensor(labels))
        assert metrics["nodes"] == 9 and metrics["brier"] == pytest.approx(float(brier), rel=1e-6)
        assert metrics["auc"] == pytest.approx(tree_recipe.soft_auc(labels, scores))
    checked = tree_recipe._check_results(rounds, rounds, table, COST, 10, (tree_recipe.HIDDEN_ONLY,))
    assert checked["fed_nodes"][tree_recipe.HIDDEN_ONLY]["nodes"] == 4  # fed nodes 0, 2 and 0, 1
    assert tree_recipe.HIDDEN_ONLY not in checked["all_nodes"] and bound in checked["all_nodes"]
    assert checked["all_nodes"]["chain head"]["nodes"] == 9  # not named fed-only: counts q off the fed nodes


def test_tree_models_round_trip_and_say_what_is_missing(tmp_path) -> None:
    features = [[-0.1 * i, 0.5, float(1 + i % 3)] for i in range(40)]
    labels = [float(i % 2) for i in range(40)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        head = AcceptanceHead(8, depth=1).eval()
    models = TreeModels({"greedy": C2TClassifier.fit(features, labels, steps=20)}, {"sampled": head})
    models.save(tmp_path / "trees")
    loaded = TreeModels.load(tmp_path / "trees")
    x = torch.tensor(features)
    assert torch.equal(loaded.classifier(True)(x), models.classifier(True)(x))
    h = torch.randn(3, 8)
    assert torch.equal(loaded.head(False)(h), head(h))
    with pytest.raises(ValueError, match="no C2T classifier for sampled decoding"):
        loaded.classifier(False)
    with pytest.raises(ValueError, match="no tree-trained head for greedy"):
        loaded.head(True)
    with pytest.raises(FileNotFoundError, match="python -m train.trees"):
        TreeModels.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no greedy/sampled"):
        TreeModels.load(tmp_path / "empty")
    (tmp_path / "bad" / "greedy").mkdir(parents=True)
    (tmp_path / "bad" / "greedy" / "c2t.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a C2T classifier"):
        TreeModels.load(tmp_path / "bad")


def test_c2t_features_are_log_joint_entropy_depth_and_the_nodes_own_log_probability() -> None:
    tree = DraftTree()
    tree.add(5, -1, 0.6, 0.6, entropy=1.5)
    tree.add(7, 0, 0.25, 0.25, entropy=0.5)  # a child of node 0: joint 0.6 · 0.25
    assert C2T_FEATURES == ("log_joint", "entropy", "depth", "log_prob")
    assert c2t_features(tree, 1) == pytest.approx([math.log(0.15), 0.5, 2.0, math.log(0.25)])
    classifier = C2TClassifier.fit([c2t_features(tree, n) for n in (0, 1)], [1.0, 0.0], steps=5)
    rule = C2TTree(classifier, COST)
    with torch.no_grad():
        expected = torch.sigmoid(classifier(torch.tensor(c2t_features(tree, 1))))
    assert rule.prior(0.25, 0.5, 2, 0.15) == pytest.approx(float(expected))  # decoding reads the same four


def test_c2t_classifier_learns_a_conditional_label_only_with_the_nodes_own_probability() -> None:
    """The tree label is P(node accepted | parent accepted) — here exactly the node's own q. log joint = log q + log
    joint(parent) hides it behind the parent's path; with log q as a fourth input the classifier ranks nodes as q
    does, without it clearly worse (the C2T baseline's deficit against the draft probability alone)."""
    g = torch.Generator().manual_seed(0)
    q = torch.rand(600, generator=g) * 0.98 + 0.01
    parent_joint = torch.rand(600, generator=g) ** 3 + 1e-3
    depth = torch.randint(1, 6, (600,), generator=g).float()
    rows = torch.stack([(q * parent_joint).log(), torch.rand(600, generator=g), depth, q.log()], -1).tolist()
    labels = q.tolist()
    aucs = {}
    for name, width in (("four", 4), ("three", 3)):
        classifier = C2TClassifier.fit([r[:width] for r in rows], labels, steps=200)
        assert classifier.features == C2T_FEATURES[:width]
        with torch.no_grad():
            aucs[name] = tree_recipe.soft_auc(labels, classifier(torch.tensor(rows)).tolist())
    assert aucs["four"] == pytest.approx(tree_recipe.soft_auc(labels, q.tolist()), abs=0.01)
    assert aucs["three"] < aucs["four"] - 0.05, aucs


def test_a_c2t_classifier_saved_before_log_prob_still_loads(tmp_path) -> None:
    """A file without a feature list (three inputs, as every classifier before) loads as a three-feature classifier
    and scores four-feature rows by their first three columns; a new file names its features and round-trips."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        old = C2TClassifier(LEGACY_FEATURES)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in old.state_dict().items()}, str(tmp_path / "old.safetensors"))
    loaded = C2TClassifier.load(tmp_path / "old.safetensors")
    assert loaded.features == LEGACY_FEATURES and loaded.net[0].in_features == 3
    rows = torch.randn(5, 4)
    assert torch.equal(loaded(rows), old(rows[:, :3])) and torch.equal(loaded(rows[:, :3]), old(rows[:, :3]))
    new = C2TClassifier.fit(rows.tolist(), [1.0, 0.0, 1.0, 0.5, 0.0], steps=3)
    new.save(tmp_path / "new.safetensors")
    again = C2TClassifier.load(tmp_path / "new.safetensors")
    assert again.features == C2T_FEATURES and torch.equal(again(rows), new(rows))
    with pytest.raises(ValueError, match=r"expected \(\.\.\., 4\) node features"):
        again(rows[:, :3])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny bundle and ``python -m train.trees`` run on it (greedy and T=1, a few raw prompts)."""
    root = tmp_path_factory.mktemp("trees")
    bundle = tree_bundle(root, COST.to_dict(), TREE)
    prompts = root / "prompts.jsonl"
    texts = ["write a short poem", "explain python code", "count to ten", "sort this list", "name three fruits"]
    prompts.write_text("".join(json.dumps({"instruction": t}) + "\n" for t in texts))
    config = dict(
        bundle=str(bundle),
        prompts=[{"path": str(prompts), "limit": 3}],
        check_prompts=[{"path": str(prompts), "offset": 3}],
        output_dir=str(root / "out"),
        max_new_tokens=10,
        collect={"width": 2, "top_k": 3, "max_depth": 3, "max_nodes": 10},
        head_epochs=2,
        c2t_steps=50,
        prompt_options=tree_recipe.PromptOptions(prompt_mode="raw"),
    )
    payload = tree_recipe.run(**config)
    return root, bundle, config, payload


def test_train_trees_writes_models_and_a_report_and_resumes_from_cached_rounds(trained, monkeypatch) -> None:
    root, _, config, payload = trained
    assert json.loads((root / "out" / "trees.json").read_text())["results"].keys() == {"greedy", "sampled"}
    for mode, result in payload["results"].items():
        assert result["rounds"]["train"] > 0 and result["labelled_nodes"]["train"] > result["rounds"]["train"]
        oracle = result["priced_trees"]["oracle (true labels)"]["expected_tokens_per_second"]
        for name, priced in result["priced_trees"].items():
            assert priced["expected_tokens_per_second"] <= oracle + 1e-9, (mode, name)
            assert priced["expected_tokens_per_round"] >= 1.0
        if mode == "greedy":  # greedy labels are 0/1, the oracle's own BCE is 0
            assert result["fed_nodes"]["oracle (true labels)"]["bce"] == pytest.approx(0.0, abs=1e-5)
    models = TreeModels.load(root / "out")
    assert set(models.c2t) == set(models.heads) == {"greedy", "sampled"}

    def no_decoding(*args, **kwargs):
        raise AssertionError("the rerun decoded again instead of reading rounds-*.pt")

    monkeypatch.setattr(tree_recipe, "collect_rounds", no_decoding)
    again = tree_recipe.run(**config)
    assert again["results"]["greedy"]["rounds"] == payload["results"]["greedy"]["rounds"]
    assert again["results"]["sampled"]["priced_trees"] == payload["results"]["sampled"]["priced_trees"]


def test_cached_rounds_are_reused_only_when_made_by_the_same_draft_and_settings(trained, tmp_path) -> None:
    """The rounds cache keeps what made it (draft weights digest, rule, prompts, ...): the same key reads the file,
    another key (a draft retrained in place) or a cache without a key collects anew and replaces it."""
    root = trained[0]
    stored = [LabelledRound(**r) for r in torch.load(root / "out" / "greedy" / "rounds-check.pt", weights_only=True)]
    path, calls = tmp_path / "rounds-check.pt", []
    assert len(stored) >= 3

    def make(rounds):
        def collect():
            calls.append(len(rounds))
            return rounds

        return collect

    first = tree_recipe._cached_rounds(path, make(stored), {"draft_weights": "a"})
    again = tree_recipe._cached_rounds(path, make([]), {"draft_weights": "a"})
    assert calls == [len(stored)] and len(again) == len(first) == len(stored)
    assert len(tree_recipe._cached_rounds(path, make(stored[:1]), {"draft_weights": "b"})) == 1
    assert len(tree_recipe._cached_rounds(path, make([]), {"draft_weights": "b"})) == 1 and calls == [len(stored), 1]
    path.with_suffix(".key").unlink()  # a cache from before keys were kept
    assert len(tree_recipe._cached_rounds(path, make(stored[:2]), {"draft_weights": "b"})) == 2
    assert calls == [len(stored), 1, 2]


def test_tree_calibration_is_fitted_checked_and_exported_into_the_bundle(trained) -> None:
    from accept_head import SpecDecPP
    from accept_head.acceptance.calibration import Calibration

    root, bundle, config, payload = trained
    loaded = SpecDecPP.from_pretrained(bundle)
    assert loaded.tree_calibration == {}  # not exported by default
    assert loaded.tree_rule(greedy=False).calibration is loaded.calibration_for(False)  # the chain's map
    raw = torch.load(root / "out" / "sampled" / "rounds-train.pt", weights_only=True)
    cached = [LabelledRound(**r) for r in raw]
    fitted = tree_recipe.fit_tree_calibration(loaded.head, cached)
    hidden, scalars, labels = tree_recipe._head_rows(loaded.head, cached)
    with torch.inference_mode():
        mapped = torch.tensor([fitted(p) for p in loaded.head.float().accept_prob(hidden, scalars).tolist()])
    # Isotonic regression keeps the labels' mean, and its map is monotone.
    assert mapped.mean().item() == pytest.approx(labels.mean().item(), abs=1e-6)
    assert fitted.y == sorted(fitted.y)
    for mode, result in payload["results"].items():
        stored = Calibration.from_dict(json.loads((root / "out" / mode / "tree_calibration.json").read_text()))
        assert stored.kind == "isotonic"
        for name in ("chain head", "chain head, tree calibration"):
            assert 0 <= result["fed_nodes"][name]["ece"] <= 1 and result["fed_nodes"][name]["nodes"] > 0
    assert Calibration.from_dict(json.loads((root / "out" / "sampled" / "tree_calibration.json").read_text())) == fitted

    exported = root / "bundle-export"  # beside the original, so its relative model paths still resolve
    shutil.copytree(bundle, exported)
    (exported / "README.md").write_text("# card\n")
    for _ in range(2):  # a second export replaces the card's section instead of adding one
        tree_recipe.run(**{**config, "bundle": str(exported), "export_calibration": True})
    card = (exported / "README.md").read_text()
    assert card.startswith("# card") and card.count("## Tree calibration") == 1
    again = SpecDecPP.from_pretrained(exported)
    assert set(again.tree_calibration) == {"greedy", "sampled"}
    assert again.tree_calibration["sampled"] == fitted
    assert again.tree_rule(greedy=True).calibration is again.tree_calibration["greedy"]
    # The map was fitted on top-k children's labels: a T > 0 tree of top-k children uses it, one of drawn children
    # (the bundle's default, accepted as chain candidates are) the chain's map.
    again.tree = {**again.tree, "siblings": "top"}
    assert again.tree_rule(greedy=False).calibration is again.tree_calibration["sampled"]
    again.tree = {**again.tree, "siblings": "sampled"}
    assert again.tree_rule(greedy=False).calibration is again.calibration
    assert again.policy(greedy=False).calibration is None  # the chain keeps its own (here: none)
    record = again.provenance["tree_calibration"]
    assert set(record["modes"]) == {"greedy", "sampled"} and record["modes"]["sampled"]["tree"]["nodes"] > 0
    ids = [5, 9, 10, 11, 12, 13]
    reference = autoregressive_generate(again.target, ids, 12, temperature=0.0, eos_token_id=again.eos_token_ids)
    assert torch.equal(again.generate(ids, max_new_tokens=12, temperature=0, tree=True).sequences, reference.sequences)
    runner = Runner(load_pair(str(exported)), max_new_tokens=12, temperature=1.0, tree_cost=COST)
    assert runner.tree_rule(MethodSpec("head_tree", {})).calibration is runner.head.tree_calibration["sampled"]
    with pytest.raises(ValueError, match=r"tree_calibration modes \['warm'\] are unknown"):
        SpecDecPP(again.target, again.draft, again.head, 0.6, tree_calibration={"warm": fitted})


def test_runner_decodes_c2t_and_tree_head_trees_losslessly_and_refuses_them_without_models(trained) -> None:
    root, bundle, _, _ = trained
    pair = load_pair(str(bundle))
    models = TreeModels.load(root / "out")
    ids = [5, 9, 10, 11, 12, 13]
    reference = autoregressive_generate(pair.target, ids, 12, temperature=0.0, eos_token_id=pair.eos_token_id)
    specs = [
        MethodSpec("c2t_tree", dict(TREE)),
        MethodSpec("head_tree", {"head": "tree", **TREE}),
        MethodSpec("cost_tree", dict(TREE)),
    ]
    bare = Runner(pair, max_new_tokens=12, temperature=0.0)
    for spec in specs[:2]:
        assert "python -m train.trees" in bare.supports(spec)
    slow = CostModel(t_draft=0.5, t_target_a=0.039, t_target_b=0.002)  # a draft forward dearer than 10 target calls
    runner = Runner(pair, max_new_tokens=12, temperature=0.0, tree_models=models, tree_cost=slow)
    for spec in specs:
        assert runner.supports(spec) is None
        result = runner.decoder(spec)(ids, torch.Generator().manual_seed(0))
        assert torch.equal(result.sequences, reference.sequences), spec.name
        assert runner.tree_rule(spec).cost is slow
        # Under that cost no second depth pays: every round drafts one depth (one root forward each).
        assert result.stats.draft_calls == result.stats.target_calls
    assert runner.tree_rule(specs[1]).head is models.head(True)
    # The cost tree calls no head: where the head's share was measured it plans without it; the head's tree pays it.
    headed = CostModel(t_draft=0.5, t_target_a=0.039, t_target_b=0.002, t_head=0.1)
    runner = Runner(pair, max_new_tokens=12, temperature=0.0, tree_models=models, tree_cost=headed)
    assert runner.tree_rule(specs[2]).cost.t_draft == pytest.approx(0.4)
    assert runner.tree_rule(MethodSpec("head_tree", dict(TREE))).cost is headed
    with pytest.raises(ValueError, match="head='draft' must be 'chain'"):
        runner.tree_rule(MethodSpec("head_tree", {"head": "draft"}))


def test_bench_draft_tree_grids_reject_bad_entries() -> None:
    specs = draft_tree_specs({"head_tree": [{"threshold": 0.5}, {}], "c2t_tree": [{}]})
    assert [s.name for s in specs] == ["SpecDec++ tree h=0.5", "SpecDec++ tree", "C2T tree"]
    with pytest.raises(ValueError, match="'ngrammys' is not a draft-tree method"):
        draft_tree_specs({"ngrammys": [{}]})
    with pytest.raises(ValueError, match=r"draft_trees.static_tree\[0\]=3 must be a mapping"):
        draft_tree_specs({"static_tree": [3]})
