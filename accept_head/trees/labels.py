"""Labels for tree rounds, and a C2T-style classifier trained on them.

**Labels.** Every drafted node whose parent the target scored in a round's verification pass (the root, or a
verified node) is labelled from that pass with P(node accepted | parent accepted) under the tree verification rule:
at T > 0 this is exactly p_parent(token) — :func:`~accept_head.trees.verify.verify_sampled` emits each token with its
target probability whatever candidates it tried, so the label holds for verified nodes and for nodes drafted but not
verified alike — and at greedy it is 1[token = argmax p_parent]. These are the soft labels SpecDec++ trains its head
on, extended from a chain's candidates to every node of a tree (:func:`node_labels`, collected over real decoding by
:class:`TreeLabelRecorder` through ``tree_generate(observe=...)``).

**C2T** (Huo et al. 2025) prunes a draft tree with a tiny classifier on three features of a node: the joint draft
probability of its path, the entropy of the distribution it was taken from, and its depth. :class:`C2TClassifier`
is such a classifier (4 → 16 → 1, SiLU, 97 parameters) trained with BCE on the same tree labels;
:class:`C2TTree` grows trees by the cost rule of :class:`~accept_head.trees.growth.HeadTree` with the classifier's
score in place of the head's, so the two are compared like with like.

Here the classifier also reads the node's *own* log draft probability (:data:`C2T_FEATURES`). The label it is
trained on, and the score the cost rule multiplies along a path, is P(node accepted | parent accepted), which at T > 0
is p_parent(token) and is predicted first of all by q_parent(token) — the node's own draft probability. C2T's three
features hold it only mixed with the parent's path: log joint = log q(node) + log joint(parent), and the parent's
part is noise for a label that is conditional on the parent. So the three-feature classifier ranked tree nodes
below the draft probability alone (AUC 0.70 against 0.79, issue 39). The joint is the right feature for an
unconditional label (is the node accepted at all?); for the conditional one the node's own probability is.
Classifiers saved before it (three features) load and score as they were trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ..acceptance.head import HEAD_WEIGHTS, AcceptanceHead
from ..core.costs import CostModel
from ..core.sampling import SamplingConfig, probabilities
from .growth import CostTree, DraftTree, node_inputs

C2T_WEIGHTS = "c2t.safetensors"
C2T_FEATURES = ("log_joint", "entropy", "depth", "log_prob")
"""What :func:`c2t_features` gives per node, in order: log of the joint draft probability of its path, the entropy of
the distribution it was taken from, its depth, and the log of its own draft probability."""
LEGACY_FEATURES = C2T_FEATURES[:3]
"""The features of classifiers saved before ``log_prob`` (files without a ``features`` entry)."""


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


def node_features(prob: float, entropy: float, depth: int, joint: float) -> list[float]:
    """:data:`C2T_FEATURES` of a node from its draft probability, entropy, depth and joint path probability."""
    return [math.log(max(joint, 1e-30)), entropy, float(depth), math.log(max(prob, 1e-30))]


def c2t_features(tree: DraftTree, node: int) -> list[float]:
    """The classifier's features of a node (:data:`C2T_FEATURES`)."""
    return node_features(tree.probs[node], tree.entropies[node], tree.depths[node], tree.joints[node])


@dataclass
class LabelledRound:
    """One tree round kept for training and for pricing trees offline: the drafted tree's shape, what each scorer
    reads, and the labels of every node whose parent the target scored (:func:`node_labels`)."""

    parents: list[int]
    probs: list[float]
    """The draft's probability of each node (its EAGLE-2 score)."""
    features: list[list[float]]
    """C2T features of each node (:func:`c2t_features`; three per node in rounds cached before ``log_prob``)."""
    labels: dict[int, float]
    hidden: dict[int, torch.Tensor]
    """The draft's hidden state at each fed node (the head's input)."""
    forwards: int
    top1s: list[float] = field(default_factory=list)
    """The top-1 probability of the distribution each node was taken from (empty in rounds cached before it)."""

    def inputs(self, node: int, names) -> list[float]:
        """The acceptance head's scalar ``names`` of ``node``, the values :meth:`DraftTree.inputs
        <accept_head.trees.growth.DraftTree.inputs>` gave the head at decode time."""
        if "top1" in names and not self.top1s:
            raise ValueError(
                "these tree rounds were cached before node top-1 probabilities were recorded: delete the rounds-*.pt "
                "files of that output folder and run `python -m train.trees` again."
            )
        log_joint, entropy, depth, *rest = self.features[node]
        log_prob = rest[0] if rest else math.log(max(self.probs[node], 1e-30))
        top1 = self.top1s[node] if self.top1s else 1.0
        return node_inputs(names, log_prob, entropy, top1, int(depth), log_joint)

    def labelled(self) -> list[int]:
        """The nodes with a label, in creation order: an ancestor-closed subtree (a verified parent's own path was
        verified, so every node on it has a label)."""
        return sorted(self.labels)


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
    rounds: list[LabelledRound] = field(default_factory=list)
    """Every observed round whole (:class:`LabelledRound`)."""

    def observe(self, tree: DraftTree, nodes: list[int], logits: torch.Tensor) -> None:
        labels = node_labels(tree, nodes, logits, self.sampling)
        features = [c2t_features(tree, node) for node in range(len(tree.tokens))]
        hidden = {node: state.float().cpu() for node, state in tree.hidden.items()}
        kept = LabelledRound(list(tree.parents), list(tree.probs), features, labels, hidden, tree.forwards)
        kept.top1s = list(tree.top1s)
        self.rounds.append(kept)
        for node, label in labels.items():
            self.features.append(features[node])
            self.labels.append(label)
            if node in hidden:
                self.hidden.append(hidden[node])
                self.hidden_labels.append(label)


class C2TClassifier(nn.Module):
    """P(node accepted | parent accepted) from C2T-style features of a node (``features``, a subsequence of
    :data:`C2T_FEATURES`; all four by default) through 16 SiLU units, inputs standardised."""

    def __init__(self, features: tuple[str, ...] = C2T_FEATURES) -> None:
        super().__init__()
        if not features or any(f not in C2T_FEATURES for f in features) or len(set(features)) != len(features):
            raise ValueError(f"features={features!r} must be distinct names of {C2T_FEATURES}.")
        self.features = tuple(f for f in C2T_FEATURES if f in features)
        self._columns = [C2T_FEATURES.index(f) for f in self.features]
        width = len(self.features)
        self.net = nn.Sequential(nn.Linear(width, 16), nn.SiLU(), nn.Linear(16, 1))
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("std", torch.ones(width))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(..., len(C2T_FEATURES)) — or (..., len(self.features)), its own columns only — → acceptance logits
        (...)."""
        if features.shape[-1] == len(C2T_FEATURES) != len(self.features):
            features = features[..., self._columns]
        if features.shape[-1] != len(self.features):
            raise ValueError(f"expected (..., {len(C2T_FEATURES)}) node features, got {tuple(features.shape)}.")
        return self.net((features - self.mean) / self.std).squeeze(-1)

    @classmethod
    def fit(cls, features: list[list[float]], labels: list[float], steps: int = 500, seed: int = 0) -> C2TClassifier:
        """Train on (features, soft labels) with BCE and Adam (full batch); rows of three features (rounds cached
        before ``log_prob``) train a :data:`LEGACY_FEATURES` classifier. Raises ValueError without labels."""
        if not labels or len(features) != len(labels):
            raise ValueError(f"C2TClassifier.fit needs as many labels as feature rows, got {len(labels)} labels.")
        x = torch.tensor(features, dtype=torch.float32)
        y = torch.tensor(labels, dtype=torch.float32)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls(C2T_FEATURES[: x.shape[-1]])
        model.mean.copy_(x.mean(0))
        model.std.copy_(x.std(0).clamp_min(1e-3) if len(x) > 1 else torch.ones(x.shape[-1]))
        optimizer = torch.optim.Adam(model.net.parameters(), lr=0.02)
        for _ in range(steps):
            optimizer.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            loss.backward()
            optimizer.step()
        return model.eval()

    def save(self, path: str | Path) -> None:
        """Weights and standardisation in one safetensors file; its metadata names the features."""
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path), metadata={"format": "pt", "features": ",".join(self.features)})

    @classmethod
    def load(cls, path: str | Path) -> C2TClassifier:
        """A classifier saved by :meth:`save`; files without a feature list read :data:`LEGACY_FEATURES`."""
        try:
            with safe_open(str(path), "pt") as f:
                named = (f.metadata() or {}).get("features")
            model = cls(tuple(named.split(",")) if named else LEGACY_FEATURES)
            model.load_state_dict(load_file(str(path)))
        except (OSError, RuntimeError, SafetensorError) as err:
            raise ValueError(f"{path} is not a C2T classifier saved by C2TClassifier.save: {err}") from err
        return model.eval()


class C2TTree(CostTree):
    """The cost-priced tree of :class:`~accept_head.trees.growth.CostTree` scored by a :class:`C2TClassifier`: every
    node is scored when proposed (no draft state needed). ``settings``: CostTree's width, top_k, max_depth, ..."""

    def __init__(self, classifier: C2TClassifier, cost: CostModel, **settings) -> None:
        super().__init__(cost, **settings)
        self.classifier = classifier

    def prior(self, prob: float, entropy: float, depth: int, joint: float) -> float:
        with torch.inference_mode():
            logit = self.classifier(torch.tensor(node_features(prob, entropy, depth, joint)))
        return float(torch.sigmoid(logit))


MODES = ("greedy", "sampled")
"""Decoding modes that tree labels (and what is trained on them) are kept apart by: greedy, and sampling (T > 0)."""


def tree_mode(greedy: bool) -> str:
    return MODES[0] if greedy else MODES[1]


@dataclass
class TreeModels:
    """What is trained on tree labels (``python -m train.trees``), per decoding mode (:data:`MODES`): a C2T
    classifier for :class:`C2TTree` and an acceptance head trained on tree nodes (``head_tree`` with ``head: tree``).
    Saved as ``<folder>/<mode>/c2t.safetensors`` and ``<folder>/<mode>/head.safetensors`` (+ ``head_config.json``)."""

    c2t: dict[str, C2TClassifier] = field(default_factory=dict)
    heads: dict[str, AcceptanceHead] = field(default_factory=dict)

    def classifier(self, greedy: bool) -> C2TClassifier:
        return self._get(self.c2t, greedy, "C2T classifier")

    def head(self, greedy: bool) -> AcceptanceHead:
        return self._get(self.heads, greedy, "tree-trained head")

    @staticmethod
    def _get(table: dict, greedy: bool, what: str):
        mode = tree_mode(greedy)
        if mode not in table:
            raise ValueError(
                f"no {what} for {mode} decoding here (have: {sorted(table) or 'none'}); train one with "
                f"`python -m train.trees --config ...` with this mode's temperature."
            )
        return table[mode]

    def save(self, folder: str | Path) -> None:
        for mode, classifier in self.c2t.items():
            (Path(folder) / mode).mkdir(parents=True, exist_ok=True)
            classifier.save(Path(folder) / mode / C2T_WEIGHTS)
        for mode, head in self.heads.items():
            head.save_pretrained(Path(folder) / mode)

    @classmethod
    def load(cls, folder: str | Path) -> TreeModels:
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"tree_models={str(folder)!r} is not a folder; write one with `python -m train.trees`."
            )
        models = cls()
        for mode in MODES:
            if (folder / mode / C2T_WEIGHTS).is_file():
                models.c2t[mode] = C2TClassifier.load(folder / mode / C2T_WEIGHTS)
            if (folder / mode / HEAD_WEIGHTS).is_file():
                models.heads[mode] = AcceptanceHead.from_pretrained(folder / mode).eval()
        if not models.c2t and not models.heads:
            raise FileNotFoundError(
                f"{folder} holds no {'/'.join(MODES)} subfolder with {C2T_WEIGHTS} or {HEAD_WEIGHTS}."
            )
        return models
