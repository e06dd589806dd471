"""Which draft branches to grow and which to verify: the rules of a tree round, behind one interface.

A round's draft tree (:class:`DraftTree`) holds every proposed node with a *score* s(n), an estimate of
P(n accepted | its parent accepted), and a *value* v(n) = ∏ s along its path: the probability that n is reached and
accepted. A tree T then yields 1 + Σ_{n∈T} v(n) tokens in expectation (the accepted nodes plus the target's own
token), and costs depth(T) draft forwards and one target call over |T| candidates:
cost(T) = drafting(depth(T)) + t_target(|T|) with t_target(n) = a + b·n (:class:`~accept_head.core.costs.CostModel`).

Rules (:class:`TreeRule`), compared like with like by the same tree round:

* :class:`HeadTree` — SpecDec++ for trees: a node's score is the acceptance head's p̂ on the draft's hidden state at
  that node (a node not fed yet counts its draft probability, as the chain's ``unscored="confidence"``). It drafts
  another depth only while that can still raise the expected tokens per second, and verifies the subtree with the
  best expected tokens per second (:func:`best_subtree`); ``threshold`` h keeps out nodes with v < 1 − h (the chain
  rule's threshold on P(some rejection)).
* :class:`CostTree` — the same growth and selection with the nodes' draft probabilities as scores (the ablation
  of the head; :class:`~accept_head.trees.labels.C2TTree` scores them with a C2T-style classifier instead).
* :class:`ConfidenceTree` — EAGLE-2: scores are the draft's probabilities; a fixed depth, the best ``width`` nodes
  of each depth expanded, then the ``max_nodes`` best nodes by value verified (re-ranking).
* :class:`StaticTree` — EAGLE-1: a fixed shape, ``shape[d]`` children for every node of depth d.

Children at T > 0. By default a node's children are the draft's top-k, verified so that a candidate c is accepted
with probability p(c) (:func:`~accept_head.trees.verify.verify_sampled`). With ``siblings="sampled"`` (the cost-priced
rules) they are instead *drawn* without replacement from the draft's q and verified recursively
(:func:`~accept_head.trees.verify.verify_recursive`): the first is accepted with probability min(1, p/q), as a chain's
candidate is, and each further sibling tries what the earlier ones left. Exactness then needs every drawn node
verified and each parent's number of children fixed before the draw (:meth:`CostTree.sibling_counts`), so the tree is
priced as it grows and :meth:`TreeRule.select` returns all of it; a node's score is a(n)·∏(1 − a) over its earlier
siblings (:class:`DraftTree`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..acceptance.head import AcceptanceHead
from ..core.costs import CostModel


@dataclass
class DraftTree:
    """The nodes of one round, in creation order (parents before children). Index −1 is the root (the last
    committed token)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    """1 for children of the root."""
    probs: list[float] = field(default_factory=list)
    """The draft's probability of the node's token in its parent's distribution."""
    joints: list[float] = field(default_factory=list)
    """The product of ``probs`` along the node's path (EAGLE-2's confidence value)."""
    scores: list[float] = field(default_factory=list)
    """s(n): estimated P(n accepted | parent accepted)."""
    values: list[float] = field(default_factory=list)
    """v(n) = ∏ s along the path."""
    entropies: list[float] = field(default_factory=list)
    """Entropy (nats) of the parent's draft distribution the node was taken from."""
    top1s: list[float] = field(default_factory=list)
    """The top-1 probability of that distribution."""
    slots: list[int] = field(default_factory=list)
    """The drafter's cache slot of each fed node (−1: not fed)."""
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    """The draft's hidden state (d,) at each fed node (the head's input), kept when the rule reads it."""
    forwards: int = 0
    """Draft forwards spent on this round (the root step included)."""
    sampled: bool = False
    """Siblings were *drawn* from the draft without replacement (T > 0, :func:`~accept_head.trees.verify.\
verify_recursive`), in draw order: a node's score is then its estimated acceptance given that it is tried, times the
    chance that every earlier sibling was rejected. Otherwise siblings are the draft's top-k (deterministic)."""
    accepts: list[float] = field(default_factory=list)
    """a(n): estimated P(n accepted | parent accepted and n tried); s(n) = a(n) unless ``sampled``."""
    children: dict[int, list[int]] = field(default_factory=dict)
    """Each parent's children (−1: the root's), in creation order (draw order when ``sampled``)."""
    dists: dict[int, torch.Tensor] = field(default_factory=dict)
    """``sampled`` only: the draft distribution (V,) each parent's children were drawn from (−1: the root's)."""
    copied: set[int] = field(default_factory=set)
    """Nodes copied from the text rather than proposed by the draft
    (:func:`~accept_head.trees.decoding.add_copied_row`): point-mass guesses, verified after the drawn siblings."""

    def add(self, token: int, parent: int, prob: float, score: float, entropy: float = 0.0, top1: float = 1.0) -> int:
        """Append a childless node; ``score`` is its a(n) (its s(n) follows, see :attr:`sampled`)."""
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.entropies.append(float(entropy))
        self.top1s.append(float(top1))
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.probs.append(float(prob))
        self.joints.append((1.0 if parent < 0 else self.joints[parent]) * float(prob))
        self.accepts.append(float(score))
        self.scores.append(0.0)
        self.values.append(0.0)
        self.slots.append(-1)
        self.children.setdefault(parent, []).append(node)
        self._score_siblings(node)
        return node

    def rescore(self, node: int, score: float, checked: bool = True) -> None:
        """Replace a childless node's a(n) (its score and value follow, and, when ``sampled``, those of its later
        siblings); ``checked=False`` skips the childless check for nodes the caller has just added."""
        assert not checked or node not in self.children, "rescore a node before its children are added"
        self.accepts[node] = float(score)
        self._score_siblings(node)

    def _score_siblings(self, node: int) -> None:
        """Recompute s and v of ``node`` and (when ``sampled``) of its later siblings, which must be childless."""
        parent = self.parents[node]
        base = 1.0 if parent < 0 else self.values[parent]
        group = self.children[parent] if self.sampled else [node]
        rejected = 1.0
        for sibling in group:
            if sibling >= node:
                self.scores[sibling] = self.accepts[sibling] * rejected
                self.values[sibling] = base * self.scores[sibling]
            rejected *= 1.0 - self.accepts[sibling]

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def newest(self) -> list[int]:
        """Nodes of the deepest depth, best value first (ties: the earlier node)."""
        deepest = [n for n, d in enumerate(self.depths) if d == self.depth]
        return sorted(deepest, key=lambda n: -self.values[n])

    def inputs(self, node: int, names: Sequence[str]) -> list[float]:
        """The acceptance head's scalar ``names`` (:data:`~accept_head.acceptance.inputs.SCALAR_INPUTS`) of
        ``node``, as a chain round defines them for its candidates: log q(y), the entropy and top-1 probability of the
        distribution it was taken from, its depth and the log of its path's joint draft probability (probabilities
        floored at 1e-30 before the log, as the C2T features are)."""
        log_prob, log_joint = (math.log(max(p, 1e-30)) for p in (self.probs[node], self.joints[node]))
        return node_inputs(names, log_prob, self.entropies[node], self.top1s[node], self.depths[node], log_joint)

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def node_inputs(
    names: Sequence[str], log_prob: float, entropy: float, top1: float, depth: int, log_joint: float
) -> list[float]:
    """Scalar head inputs ``names`` of a tree node from the log of its draft probability, the entropy and top-1
    probability of its parent's distribution, its depth and the log of its path's joint draft probability — the values
    :func:`~accept_head.acceptance.inputs.draft_stats` gives a chain candidate at that depth."""
    values = {"logq": log_prob, "entropy": entropy, "top1": top1, "depth": float(depth), "path_logq": log_joint}
    unknown = [name for name in names if name not in values]
    if unknown:
        raise ValueError(f"no tree node input named {unknown}; a node has {list(values)}.")
    return [values[name] for name in names]


def check_context_row(context_row: int) -> int:
    """``context_row`` if it is an integer >= 0, else ValueError."""
    if isinstance(context_row, bool) or not isinstance(context_row, int) or context_row < 0:
        raise ValueError(f"context_row={context_row!r} must be an integer >= 0 (tokens copied from the text; 0: none).")
    return context_row


def check_tree_settings(**settings: int) -> None:
    """Raise ValueError unless every setting is an integer >= 1 (widths, depths, node budgets, shapes)."""
    for name, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1 (a tree needs at least one node per depth).")


def best_subtree(
    parents: Sequence[int],
    values: Sequence[float],
    cost: CostModel,
    max_nodes: int,
    floor: float = 0.0,
    forwards: int | None = None,
) -> tuple[list[int], float]:
    """The ancestor-closed subset T of a tree that maximises expected tokens per second (1 + Σ_T v) / cost(T).

    ``values`` must not rise from a parent to its child (v = ∏ s, s ≤ 1). Draft cost: ``forwards`` draft steps
    when the draft forwards are already spent (then only |T| matters), else depth(T) (:meth:`CostModel.drafting`).
    Nodes with v < ``floor`` are left out, and |T| ≤ ``max_nodes``. Exact: for each depth cap D the best T of size n
    is the n best nodes by value (ancestor-closed, because values fall along paths; ties go to the earlier node, a
    parent), so scanning every (D, n) covers the optimum. Returns (nodes in creation order, expected tokens per
    second; the empty tree's 1 / t_target(0) when nothing pays).
    """
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    best, best_rate = [], 1.0 / cost.t_target(0)
    caps = range(1, max(depths, default=0) + 1) if forwards is None else [max(depths, default=0)]
    for cap in caps:
        ranked = sorted((n for n, d in enumerate(depths) if d <= cap and values[n] >= floor), key=lambda n: -values[n])
        draft = cost.drafting(cap if forwards is None else forwards)
        expected = 1.0
        for size, node in enumerate(ranked[:max_nodes], start=1):
            expected += values[node]
            rate = expected / (draft + cost.t_target(size))
            if rate > best_rate:
                best, best_rate = ranked[:size], rate
    return sorted(best), best_rate


SIBLINGS = ("top", "sampled")
"""How a tree rule chooses children at T > 0: the draft's ``top`` k (verified by
:func:`~accept_head.trees.verify.verify_sampled`, a candidate accepted with probability p(c)) or k ``sampled`` without
replacement from the draft (:func:`~accept_head.trees.verify.verify_recursive`, the first accepted with probability
min(1, p/q) as in a chain). Greedy decoding always takes the top k."""


class TreeRule:
    """How a tree round grows and what it verifies. The round (:func:`~accept_head.trees.decoding.draft_tree`)
    proposes :meth:`children` top-k children of each node in :meth:`frontier` (each scored by :meth:`prior`), asks
    :meth:`grow` before each further draft forward, and verifies :meth:`select`."""

    uses_hidden: bool = False
    """Scores fed nodes from the draft's hidden state (:meth:`score`)."""
    siblings: str = "top"
    """How children are chosen at T > 0 (:data:`SIBLINGS`); ``sampled`` rules also give :meth:`sibling_counts`."""
    context_row: int = 0
    """Tokens copied from the text itself that join each round's verified nodes (0: none): the continuation of the
    latest earlier occurrence of the last three, else two, tokens, at the root and below the drafted leaf most likely
    reached (:class:`~accept_head.trees.context.ContextRow`, :func:`~accept_head.trees.decoding.add_copied_rows`).
    Fixed before verification, so decoding stays exact."""
    max_depth: int
    max_nodes: int

    def children(self, depth: int) -> int:
        """How many children (the draft's top-k) each expanded node of depth ``depth`` − 1 gets."""
        raise NotImplementedError

    def frontier(self, tree: DraftTree) -> list[int]:
        """The nodes of the newest depth to feed (expand) in the next draft forward."""
        raise NotImplementedError

    def prior(self, prob: float, entropy: float, depth: int, joint: float) -> float:
        """A new node's score before it is fed, from its draft probability ``prob``, the entropy of the distribution
        it was taken from, its depth and ``joint``, the product of draft probabilities along its path: by default
        ``prob`` (EAGLE-2's confidence)."""
        return prob

    def prior_scores(self, tree: DraftTree, nodes: Sequence[int]) -> list[float]:
        """The scores of the just-proposed ``nodes`` (childless): :meth:`prior` of each by default."""
        return [self.prior(tree.probs[n], tree.entropies[n], tree.depths[n], tree.joints[n]) for n in nodes]

    def grow(self, tree: DraftTree) -> bool:
        """Whether another draft forward (one more depth) is worth it."""
        return tree.depth < self.max_depth

    def score(self, hidden: torch.Tensor, tree: DraftTree, nodes: Sequence[int]) -> list[float]:
        """(n, d) hidden states of the just-fed ``nodes`` of ``tree`` → their scores."""
        raise NotImplementedError(f"{type(self).__name__} does not score hidden states.")

    def select(self, tree: DraftTree) -> list[int]:
        """The nodes to verify (ancestor-closed), in creation order."""
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


class ConfidenceTree(TreeRule):
    """EAGLE-2's dynamic tree: value = product of draft probabilities; the ``width`` best nodes of each depth get
    their ``top_k`` children, for ``max_depth`` depths; the ``max_nodes`` best nodes are verified."""

    def __init__(
        self, width: int = 4, top_k: int = 4, max_depth: int = 6, max_nodes: int = 32, context_row: int = 0
    ) -> None:
        check_tree_settings(width=width, top_k=top_k, max_depth=max_depth, max_nodes=max_nodes)
        self.width, self.top_k, self.max_depth, self.max_nodes = width, top_k, max_depth, max_nodes
        self.context_row = check_context_row(context_row)

    def children(self, depth: int) -> int:
        return self.top_k

    def frontier(self, tree: DraftTree) -> list[int]:
        return tree.newest()[: self.width]

    def select(self, tree: DraftTree) -> list[int]:
        return sorted(sorted(range(len(tree.values)), key=lambda n: -tree.values[n])[: self.max_nodes])

    def describe(self) -> str:
        return f"ConfidenceTree(width={self.width}, top_k={self.top_k}, depth={self.max_depth}, nodes={self.max_nodes})"


class StaticTree(TreeRule):
    """EAGLE-1's fixed tree: every node of depth d − 1 gets ``shape[d-1]`` children (the draft's top ones), up to
    ``len(shape)`` depths; all nodes are verified (at most ``max_nodes``, the best by value)."""

    def __init__(self, shape: Sequence[int] = (4, 2, 2, 1, 1), max_nodes: int = 64, context_row: int = 0) -> None:
        if not shape:
            raise ValueError("shape=() is empty: a static tree needs one child count per depth, e.g. (4, 2, 1).")
        check_tree_settings(**{f"shape[{d}]": k for d, k in enumerate(shape)}, max_nodes=max_nodes)
        self.shape, self.max_depth, self.max_nodes = tuple(shape), len(shape), max_nodes
        self.context_row = check_context_row(context_row)

    def children(self, depth: int) -> int:
        return self.shape[depth - 1]

    def frontier(self, tree: DraftTree) -> list[int]:
        return sorted(tree.newest())

    def select(self, tree: DraftTree) -> list[int]:
        return sorted(sorted(range(len(tree.values)), key=lambda n: -tree.values[n])[: self.max_nodes])

    def describe(self) -> str:
        return f"StaticTree(shape={self.shape})"


class CostTree(TreeRule):
    """A tree grown by expected tokens per second under ``cost``: the ``width`` best nodes of the newest depth are
    expanded into their ``top_k`` children while :meth:`grow` says a depth pays, then :func:`best_subtree` picks what
    to verify. Nodes keep their :meth:`~TreeRule.prior` scores (subclasses score them otherwise).

    ``min_depth`` depths are drafted before the cost rule decides (as the chain rule's ``min_candidates``): with
    ``min_depth=2`` every round feeds its first depth, so an acceptance head has scored those nodes when the rule
    first asks whether a further depth pays; with 1 that first decision rests on the draft probabilities alone."""

    def __init__(
        self,
        cost: CostModel,
        width: int = 4,
        top_k: int = 4,
        max_depth: int = 12,
        max_nodes: int = 48,
        threshold: float | None = None,
        min_depth: int = 1,
        siblings: str = "top",
        context_row: int = 0,
    ) -> None:
        check_tree_settings(width=width, top_k=top_k, max_depth=max_depth, max_nodes=max_nodes, min_depth=min_depth)
        if min_depth > max_depth:
            raise ValueError(f"min_depth={min_depth} must be <= max_depth={max_depth}.")
        if siblings not in SIBLINGS:
            raise ValueError(f"siblings={siblings!r} must be one of {SIBLINGS} (how children are chosen at T > 0).")
        if threshold is not None and not 0.0 < threshold <= 1.0:
            raise ValueError(
                f"threshold={threshold} must be in (0, 1] (nodes need P(reached and accepted) >= 1 - threshold) "
                "or None (the cost model alone decides)."
            )
        self.cost = cost
        self.width, self.top_k, self.max_depth, self.max_nodes = width, top_k, max_depth, max_nodes
        self.threshold, self.min_depth, self.siblings = threshold, min_depth, siblings
        self.context_row = check_context_row(context_row)
        self.floor = 0.0 if threshold is None else 1.0 - threshold

    def children(self, depth: int) -> int:
        return self.top_k

    def frontier(self, tree: DraftTree) -> list[int]:
        return [n for n in tree.newest()[: self.width] if tree.values[n] >= self.floor]

    def grow(self, tree: DraftTree) -> bool:
        """Draft one more depth iff the best tree after it could beat the best tree now, both priced with one
        estimate per frontier node n (the nodes the next forward feeds): n is accepted as often as its parent was
        (the parent's score — the head's, once the parent was fed; at depth 1, n's own draft probability), and so
        is its best child, which the next depth adds. The cost counts the extra forward (a round's later step)."""
        frontier = self.frontier(tree)
        if tree.depth >= self.max_depth or not frontier:
            return False
        if tree.depth < self.min_depth:
            return True
        if tree.sampled:
            return self._grow_sampled(tree, frontier)
        parents, values = list(tree.parents), list(tree.values)
        for node in frontier:
            parent = tree.parents[node]
            rate = tree.scores[node] if parent < 0 else tree.scores[parent]
            values[node] = (1.0 if parent < 0 else tree.values[parent]) * rate
            parents.append(node)
            values.append(values[node] * rate)
        _, now = best_subtree(tree.parents, values[: len(tree.values)], self.cost, self.max_nodes, self.floor)
        _, after = best_subtree(parents, values, self.cost, self.max_nodes, self.floor)
        return after > now and not math.isclose(after, now)

    def _grow_sampled(self, tree: DraftTree, frontier: list[int]) -> bool:
        """:meth:`grow` for drawn siblings, where every drawn node is verified: one more depth pays iff the frontier's
        first children (each accepted, once its parent is, as often as the parent was: a(parent), at depth 1 a(n))
        raise the whole tree's expected tokens per second after the extra forward and their verification."""
        gain = 0.0
        for node in frontier:
            parent = tree.parents[node]
            gain += tree.values[node] * tree.accepts[node if parent < 0 else parent]
        expected, seconds = self._tree_rate(tree)
        after = seconds + self.cost.t_step + self.cost.t_target_b * len(frontier)
        rate_now, rate_after = expected / seconds, (expected + gain) / after
        return rate_after > rate_now and not math.isclose(rate_after, rate_now)

    def sibling_counts(self, tree: DraftTree, parents: Sequence[int], top: Sequence[Sequence[float]]) -> list[int]:
        """How many children to *draw* for each of ``parents`` (drawn siblings; decided before the draw, from the
        parents alone, which keeps verification lossless). ``top[i]``: the ``top_k`` largest draft probabilities of
        parent i's distribution (descending, > 0) — the prior of its i-th draw, a_i ≈ top[i], so s_i ≈ a_i·∏(1 − a_j).
        Greedy by estimated value: a child is drawn while it is worth ≥ the threshold's floor, the tree stays within
        ``max_nodes``, and it raises the expected tokens per second of the tree as it stands (v > E·b / C)."""
        candidates = []
        for i, (parent, probs) in enumerate(zip(parents, top, strict=True)):
            base, rejected = (1.0 if parent < 0 else tree.values[parent]), 1.0
            for prob in probs:
                candidates.append((base * prob * rejected, i))
                rejected *= 1.0 - prob
        counts = [0] * len(parents)
        expected, seconds = self._tree_rate(tree)
        size = len(tree.tokens)
        for value, i in sorted(candidates, key=lambda c: -c[0]):
            if size >= self.max_nodes or value < self.floor or value * seconds <= expected * self.cost.t_target_b:
                break
            counts[i], size = counts[i] + 1, size + 1
            expected, seconds = expected + value, seconds + self.cost.t_target_b
        return counts

    def _tree_rate(self, tree: DraftTree) -> tuple[float, float]:
        """(expected tokens, seconds) of verifying every node of ``tree`` after its draft forwards."""
        return 1.0 + sum(tree.values), self.cost.drafting(tree.forwards) + self.cost.t_target(len(tree.tokens))

    def select(self, tree: DraftTree) -> list[int]:
        if tree.sampled:  # drawn siblings: every drawn node is verified (dropping one by its own value is not exact)
            return list(range(len(tree.tokens)))
        nodes, _ = best_subtree(tree.parents, tree.values, self.cost, self.max_nodes, self.floor, tree.forwards)
        return nodes

    def describe(self) -> str:
        extra = "" if self.threshold is None else f", h={self.threshold:g}"
        extra += "" if self.siblings == "top" else f", siblings={self.siblings}"
        extra += f", context_row={self.context_row}" if self.context_row else ""
        return f"{type(self).__name__}(width={self.width}, top_k={self.top_k}, nodes={self.max_nodes}{extra})"


class HeadTree(CostTree):
    """SpecDec++ for trees (see the module docstring): the acceptance head scores the nodes (through ``calibration``
    when given); the tree grows by expected tokens per second under ``cost`` (:class:`CostTree`).

    What the head reads decides when a node is scored. A head that reads the draft's hidden state scores a node once
    it is fed (its scalar inputs, if it reads any, beside it); until then the node counts its draft probability.
    A head that reads only scalar inputs (log q, entropy, top-1, depth, path log q: :meth:`DraftTree.inputs`) scores
    every node as it is proposed — no forward is needed for them."""

    def __init__(
        self,
        head: AcceptanceHead,
        cost: CostModel,
        width: int = 4,
        top_k: int = 4,
        max_depth: int = 12,
        max_nodes: int = 48,
        threshold: float | None = None,
        calibration=None,
        min_depth: int = 1,
        siblings: str = "top",
        context_row: int = 0,
    ) -> None:
        super().__init__(cost, width, top_k, max_depth, max_nodes, threshold, min_depth, siblings, context_row)
        self.head, self.calibration = head, calibration
        self.uses_hidden = head.reads_hidden

    def _scores(self, hidden: torch.Tensor | None, tree: DraftTree, nodes: Sequence[int]) -> list[float]:
        scalars = None
        if self.head.scalar_inputs:
            rows = [tree.inputs(n, self.head.scalar_inputs) for n in nodes]
            scalars = torch.tensor(rows, dtype=torch.float32, device=self.head.out.weight.device)
        with torch.inference_mode():
            probs = self.head.accept_prob(hidden, scalars).float().tolist()
        return probs if self.calibration is None else [float(self.calibration(p)) for p in probs]

    def prior_scores(self, tree: DraftTree, nodes: Sequence[int]) -> list[float]:
        if self.head.reads_hidden or not nodes:
            return super().prior_scores(tree, nodes)
        return self._scores(None, tree, nodes)

    def score(self, hidden: torch.Tensor, tree: DraftTree, nodes: Sequence[int]) -> list[float]:
        return self._scores(hidden, tree, nodes)
