"""What is trained on tree labels and how trees are priced offline (:mod:`accept_head.training.tree_recipe`), and the
draft-tree rows of ``eval bench``, on tiny random models.

* ``price_trees`` picks, for each scorer, the subtree a brute-force search over every ancestor-closed subtree picks,
  and scores it with the true values; with the labels as scores (the oracle) nothing beats it.
* The soft-label AUC equals the AUC of the expanded binary sample; BCE equals torch's.
* ``TreeModels`` round-trip through safetensors; missing models and folders give clear errors.
* ``python -m train.trees`` on a tiny bundle writes trees.json and models that load, and a rerun reuses the cached
  rounds instead of decoding again.
* The runner decodes ``c2t_tree`` and ``head_tree head=tree`` losslessly (greedy equality) with those models, refuses
  them without, and plans with the cost model it is given; the bench's draft-tree grids reject bad entries.
"""

from __future__ import annotations

import itertools
import json

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
from accept_head.trees.labels import C2TClassifier, LabelledRound, TreeModels

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
    with pytest.raises(ValueError, match="head='draft' must be 'chain'"):
        runner.tree_rule(MethodSpec("head_tree", {"head": "draft"}))


def test_bench_draft_tree_grids_reject_bad_entries() -> None:
    specs = draft_tree_specs({"head_tree": [{"threshold": 0.5}, {}], "c2t_tree": [{}]})
    assert [s.name for s in specs] == ["SpecDec++ tree h=0.5", "SpecDec++ tree", "C2T tree"]
    with pytest.raises(ValueError, match="'ngrammys' is not a draft-tree method"):
        draft_tree_specs({"ngrammys": [{}]})
    with pytest.raises(ValueError, match=r"draft_trees.static_tree\[0\]=3 must be a mapping"):
        draft_tree_specs({"static_tree": [3]})
