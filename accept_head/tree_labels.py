"""Labels for tree rounds, and a C2T-style classifier trained on them.

**Labels.** Every drafted node whose parent the target scored in a round's verification pass (the root, or a
verified node) is labelled from that pass with P(node accepted | parent accepted) under the tree verification rule:
at T > 0 this is exactly p_parent(token) — :func:`~accept_head.tree_verify.verify_sampled` emits each token with its
target probability whatever candidates it tried, so the label holds for verified nodes and for nodes drafted but not
verified alike — and at greedy it is 1[token = argmax p_parent]. These are the soft labels SpecDec++ trains its head
on, extended from a chain's candidates to every node of a tree (:func:`node_labels`, collected over real decoding by
:class:`TreeLabelRecorder` through ``tree_generate(observe=...)``).

**C2T** (Huo et al. 2025) prunes a draft tree with a tiny classifier on three features of a node: the joint draft
probability of its path, the entropy of the distribution it was taken from, and its depth. :class:`C2TClassifier`
is such a classifier (3 → 16 → 1, SiLU, 81 parameters) trained with BCE on the same tree labels;
:class:`C2TTree` grows trees by the cost rule of :class:`~accept_head.tree_growth.HeadTree` with the classifier's
score in place of the head's, so the two are compared like with like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .cost_model import CostModel
from .sampling import SamplingConfig, probabilities
from .tree_growth import CostTree, DraftTree


def node_labels(tree: DraftTree, nodes: list[int], logits: torch.Tensor, sampling: SamplingConfig) -> dict[int, float]:
    """Labels of a round's nodes from its verification pass: ``nodes`` were verified (creation order) and
    ``logits`` (1 + len(nodes), V) are the target's at the root and at each of them. Returns {node: label} for every
    node whose parent was scored (see the module docstring)."""
    probs = probabilities(logits, sampling)
    row = {node: i + 1 for i, node in enumerate(nodes)}
    labels = {}
    for node, parent in enumerate(tree.parents):
        scored = 0 if parent < 0 else row.get(parent)
        if scored is not None:
            labels[node] = float(probs[scored, tree.tokens[node]])
    return labels


def c2t_features(tree: DraftTree, node: int) -> list[float]:
    """C2T's three features of a node: log joint draft probability of its path, the entropy of the distribution it
    was taken from, and its depth."""
    return [math.log(max(tree.joints[node], 1e-30)), tree.entropies[node], float(tree.depths[node])]


@dataclass
class TreeLabelRecorder:
    """Collects labelled nodes over decoding: pass ``recorder.observe`` as ``tree_generate(observe=...)``."""

    sampling: SamplingConfig
    features: list[list[float]] = field(default_factory=list)
    """C2T features per labelled node."""
    hidden: list[torch.Tensor] = field(default_factory=list)
    """The draft's hidden state of each labelled node that was fed (head training rows)."""
    hidden_labels: list[float] = field(default_factory=list)
    labels: list[float] = field(default_factory=list)

    def observe(self, tree: DraftTree, nodes: list[int], logits: torch.Tensor) -> None:
        for node, label in node_labels(tree, nodes, logits, self.sampling).items():
            self.features.append(c2t_features(tree, node))
            self.labels.append(label)
            if node in tree.hidden:
                self.hidden.append(tree.hidden[node].float().cpu())
                self.hidden_labels.append(label)


class C2TClassifier(nn.Module):
    """P(node accepted | parent accepted) from C2T's three features (3 → 16 → 1), inputs standardised."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 16), nn.SiLU(), nn.Linear(16, 1))
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("std", torch.ones(3))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(..., 3) → acceptance logits (...)."""
        return self.net((features - self.mean) / self.std).squeeze(-1)

    @classmethod
    def fit(cls, features: list[list[float]], labels: list[float], steps: int = 500, seed: int = 0) -> C2TClassifier:
        """Train on (features, soft labels) with BCE and Adam (full batch). Raises ValueError without labels."""
        if not labels or len(features) != len(labels):
            raise ValueError(f"C2TClassifier.fit needs as many labels as feature rows, got {len(labels)} labels.")
        x = torch.tensor(features, dtype=torch.float32)
        y = torch.tensor(labels, dtype=torch.float32)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls()
        model.mean.copy_(x.mean(0))
        model.std.copy_(x.std(0).clamp_min(1e-3) if len(x) > 1 else torch.ones(3))
        optimizer = torch.optim.Adam(model.net.parameters(), lr=0.02)
        for _ in range(steps):
            optimizer.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            loss.backward()
            optimizer.step()
        return model.eval()


class C2TTree(CostTree):
    """The cost-priced tree of :class:`~accept_head.tree_growth.CostTree` scored by a :class:`C2TClassifier`: every
    node is scored when proposed (no draft state needed). ``settings``: CostTree's width, top_k, max_depth, ..."""

    def __init__(self, classifier: C2TClassifier, cost: CostModel, **settings) -> None:
        super().__init__(cost, **settings)
        self.classifier = classifier

    def prior(self, prob: float, entropy: float, depth: int, joint: float) -> float:
        with torch.inference_mode():
            logit = self.classifier(torch.tensor([math.log(max(joint, 1e-30)), entropy, float(depth)]))
        return float(torch.sigmoid(logit))
