"""An acceptance head that reads the draft's own numbers, in a draft tree (:class:`~accept_head.trees.growth.HeadTree`
with scalar inputs), on tiny random models.

* Each node's inputs (log q, entropy, top-1, depth, path log q) equal an independent recomputation from the draft
  logits the round drew them from, by the chain's own :func:`~accept_head.acceptance.inputs.draft_stats`, greedy and
  at T = 1 with a top-k filter.
* The head receives exactly those values at decode time, and the labelled round the tree recipe keeps for training
  gives the same values for the same nodes (a test that fails if they disagree by node or by depth).
* A scalar-only head scores every node as it is proposed (no fed node needed); a head that reads the hidden state
  and scalars scores fed nodes with both.
* Fine-tuning a scalar-only head on tree labels changes its scores on those nodes.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import make_llama, perturbed_copy

import accept_head.trees.decoding as tree_decoding
from accept_head import AcceptanceHead
from accept_head.acceptance.inputs import SCALAR_INPUTS, draft_stats
from accept_head.core.costs import CostModel
from accept_head.core.sampling import SamplingConfig, probabilities
from accept_head.training import tree_recipe
from accept_head.trees.growth import HeadTree
from accept_head.trees.labels import TreeLabelRecorder

COST = CostModel(t_draft=0.004, t_target_a=0.039, t_target_b=0.00032)
PROMPT = [2, 10, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def pair():
    target = make_llama(seed=0, num_layers=2)
    return target, perturbed_copy(target, relative_noise=0.15, seed=3)


def scalar_head(hidden_size: int, inputs=SCALAR_INPUTS) -> AcceptanceHead:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        head = AcceptanceHead(hidden_size, depth=1, inputs=list(inputs), residual_on="logq").eval()
    with torch.no_grad():
        head.out.bias.fill_(2.0)  # optimistic: the tree grows several depths
    return head


class Recorder:
    """Records every draft step's logits (in feeding order) and every scalar row the head is given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, head: AcceptanceHead) -> None:
        self.logits, self.fed, self.trees = [], [], []
        draft_probs = tree_decoding.draft_probs

        def record_logits(logits, sampling):
            self.logits.append(logits.float().clone())
            return draft_probs(logits, sampling)

        monkeypatch.setattr(tree_decoding, "draft_probs", record_logits)
        accept_prob = head.accept_prob

        def record_scalars(hidden, scalars=None):
            self.fed.append((hidden, scalars.clone()))
            return accept_prob(hidden, scalars)

        monkeypatch.setattr(head, "accept_prob", record_scalars)

    def observe(self, tree, nodes, logits) -> None:
        self.trees.append((tree, len(self.logits)))


def recomputed_inputs(tree, step_logits: list[torch.Tensor], sampling: SamplingConfig) -> list[list[float]]:
    """Every node's scalar inputs recomputed from the draft logits of its parent's step: the root step's row for
    depth-1 nodes, else the row of the step that fed the parent (fed nodes are the drafter's slots, in order)."""
    root, fed = step_logits[0], torch.cat(step_logits[1:]) if len(step_logits) > 1 else None
    rows = []
    for node, parent in enumerate(tree.parents):
        logits = root[:1] if parent < 0 else fed[tree.slots[parent]][None]
        q = logits.float().softmax(-1) if sampling.greedy else probabilities(logits, sampling)
        logq, entropy, top1 = draft_stats(logits, q, torch.tensor([tree.tokens[node]]), sampling.greedy)
        rows.append([float(logq), float(entropy), float(top1)])
    out = []
    for node in range(len(tree.tokens)):
        path = tree.path(node)
        out.append([*rows[node], float(len(path)), sum(rows[n][0] for n in path)])
    return out


@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, 5)])
def test_node_inputs_equal_a_recomputation_and_reach_the_head(pair, monkeypatch, temperature, top_k) -> None:
    target, draft = pair
    head = scalar_head(draft.config.hidden_size)
    rule = HeadTree(head, COST, width=3, top_k=3, max_depth=5, max_nodes=24)
    recorder = Recorder(monkeypatch, head)
    labels = TreeLabelRecorder(SamplingConfig(temperature, top_k))

    def observe(tree, nodes, logits):
        labels.observe(tree, nodes, logits)
        recorder.observe(tree, nodes, logits)

    start = len(recorder.logits)
    generator = torch.Generator().manual_seed(0)
    tree_decoding.tree_generate(
        target, draft, PROMPT, rule, 16, temperature, top_k, generator=generator, observe=observe
    )
    assert recorder.trees and max(t.depth for t, _ in recorder.trees) >= 2  # deeper nodes were checked too
    sampling = SamplingConfig(temperature, top_k)
    fed_rows = torch.cat([scalars for hidden, scalars in recorder.fed])
    decoded = []
    for (tree, end), kept in zip(recorder.trees, labels.rounds, strict=True):
        steps = recorder.logits[start:end]
        start = end
        if not tree.tokens:
            continue  # the last round had room for no candidate
        want = recomputed_inputs(tree, steps, sampling)
        got = [tree.inputs(n, SCALAR_INPUTS) for n in range(len(tree.tokens))]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)
        # The recipe's kept round gives the head the very values the decoder gave it, node by node.
        assert [kept.inputs(n, SCALAR_INPUTS) for n in range(len(tree.tokens))] == got
        decoded.extend(got)
    # Every node was scored as proposed: the head saw each node's row once, in creation order, and no hidden state.
    assert all(hidden is None for hidden, _ in recorder.fed)
    torch.testing.assert_close(fed_rows, torch.tensor(decoded))


def test_a_head_reading_hidden_and_scalars_scores_fed_nodes_with_both(pair, monkeypatch) -> None:
    target, draft = pair
    head = scalar_head(draft.config.hidden_size, inputs=["hidden", "logq", "depth"])
    rule = HeadTree(head, COST, width=3, top_k=3, max_depth=5, max_nodes=24, min_depth=2)  # depth 1 always fed
    recorder = Recorder(monkeypatch, head)
    trees = []
    tree_decoding.tree_generate(target, draft, PROMPT, rule, 12, 0.0, observe=lambda t, n, lg: trees.append(t))
    assert recorder.fed and all(hidden is not None for hidden, _ in recorder.fed)
    fed_nodes = [n for t in trees for n in sorted(t.hidden, key=lambda n: t.slots[n])]
    rows = torch.cat([scalars for _, scalars in recorder.fed])
    want = [t.inputs(n, ["logq", "depth"]) for t in trees for n in sorted(t.hidden, key=lambda n: t.slots[n])]
    assert len(fed_nodes) == len(rows)
    torch.testing.assert_close(rows, torch.tensor(want))


def test_a_scalar_head_fine_tuned_on_tree_labels_moves_and_scores_every_node(pair) -> None:
    target, draft = pair
    head = scalar_head(draft.config.hidden_size)
    rule = HeadTree(head, COST, width=3, top_k=3, max_depth=4, max_nodes=24)
    recorder = TreeLabelRecorder(SamplingConfig(1.0))
    generator = torch.Generator().manual_seed(0)
    tree_decoding.tree_generate(target, draft, PROMPT, rule, 16, 1.0, generator=generator, observe=recorder.observe)
    rounds = recorder.rounds
    labelled = sum(len(r.labelled()) for r in rounds)
    assert sum(len(tree_recipe.head_nodes(head, r)) for r in rounds) == labelled  # no fed node needed
    tuned = tree_recipe.fit_tree_head(head, rounds, epochs=20, lr=1e-2, batch_size=8, seed=0)
    before = tree_recipe.node_metrics(rounds, tree_recipe.head_scorer(head), fed_only=False)
    after = tree_recipe.node_metrics(rounds, tree_recipe.head_scorer(tuned), fed_only=False)
    assert after["nodes"] == labelled and after["bce"] < before["bce"], (before, after)


@pytest.mark.parametrize("settings", [(0.0, None, None), (1.0, None, None), (0.8, 7, None)])
def test_the_chains_one_step_numbers_are_the_batched_ones(settings) -> None:
    """The chain decoder's per-step :func:`draft_step_stats` (one host read) gives each row's numbers exactly as the
    batched :func:`draft_stats` the rollout labels store — a candidate's log q, entropy and top-1, by row — including
    rows of a pruned draft (−inf outside its support)."""
    from accept_head.acceptance.inputs import draft_step_stats

    sampling = SamplingConfig(*settings)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=gen) * 3
    logits[:, 30:] = float("-inf")
    q = probabilities(logits, sampling)
    tokens = torch.tensor([q[i].multinomial(1, generator=gen).item() for i in range(6)])
    batched = torch.stack(draft_stats(logits, q, tokens, sampling.greedy), -1)
    for row in range(6):
        one = draft_step_stats(logits[row], q[row], int(tokens[row]), sampling.greedy)
        torch.testing.assert_close(torch.tensor(one), batched[row], rtol=1e-6, atol=1e-6)
        # Without the spread (a head reading neither entropy nor top-1): log q alone, the same number bit for bit.
        logq, entropy, top1 = draft_step_stats(logits[row], q[row], int(tokens[row]), sampling.greedy, spread=False)
        assert logq == one[0] and math.isnan(entropy) and math.isnan(top1)
    assert not torch.allclose(batched[0], batched[1])  # rows differ: a mix-up of rows would be seen
