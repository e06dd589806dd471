"""Lossless speculative decoding over a draft *tree*: SpecDec++'s acceptance head choosing the branches.

Each round: the drafter reads the committed text (one forward) and proposes the top-k children of the root; while
the rule (:mod:`~accept_head.trees.growth`) says another depth pays, the best frontier nodes are fed in ONE batched
draft forward under a tree mask (:mod:`~accept_head.trees.drafters`), which scores them (the head reads their hidden
states) and proposes their top-k children. The rule then picks the nodes to verify; the target scores them all in
one pass under a tree mask (:func:`~accept_head.trees.verify.tree_forward`), the longest surviving path is accepted
with the target's own next token, and both models keep exactly that path.

Why top-k children stay lossless at T > 0. The candidates are deterministic functions of the committed text (the
draft's top-k, no sampling), so they are independent of the verifier's randomness, and
:func:`~accept_head.trees.verify.verify_sampled` tries the distinct siblings c_1..c_k of the current node in turn,
accepting c_i with probability r(c_i)/Σr where r is p with the mass of c_1..c_{i−1} removed, and otherwise draws from
what remains of r. Then P(emit c_i) = p(c_i) for every sibling and P(emit x) = p(x) for every other x — the emitted
token follows the target's p whatever the candidates are; the same holds at the accepted child with its own p, so
the whole sequence follows the target (Fu et al. 2024, Alg. 4; ``tests/test_tree_decoding.py`` checks it by χ²).
The rule needs no independent draws from q (SpecInfer's multi-draft rule would); the price is that a candidate is
accepted with probability p(c), not min(1, p/q). A rule with ``siblings="sampled"`` pays that price back: its
children are drawn from q without replacement and :func:`~accept_head.trees.verify.verify_recursive` accepts the first
with probability min(1, p/q), like a chain candidate, and tries the others on what it leaves (recursive rejection
sampling; ``tests/test_tree_decoding.py`` checks it by χ² too). Greedy verification accepts a node iff it is the
target's argmax, whatever the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..chain.decoding import GenerationResult, _check_int, _prepare, _timed, _until_eos, draft_room, prefill
from ..core.sampling import SamplingConfig, argmax, draw_without_replacement, probabilities
from ..models.drafters import Drafter
from ..models.static_target import target_cache
from .attention import attention_layout, check_masked_attention
from .context import ContextRow
from .drafters import TreeDrafter, as_tree_drafter
from .growth import DraftTree, TreeRule
from .verify import (
    TreeDecodeStats,
    commit_nodes,
    tree_pass,
    verify_greedy,
    verify_recursive,
    verify_sampled,
)


def draft_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """(n, V) draft logits → the distributions whose top-k become children and whose values price them: the
    sampling transform at T > 0, the untempered softmax at greedy (a one-hot carries no confidence)."""
    return logits.float().softmax(-1) if sampling.greedy else probabilities(logits, sampling)


def draft_tree(
    drafter: TreeDrafter,
    rule: TreeRule,
    sampling: SamplingConfig,
    max_depth: int,
    stats: TreeDecodeStats,
    generator: torch.Generator | None = None,
) -> DraftTree:
    """Grow one round's tree (at most ``max_depth`` deep). Returns every proposed node with its score and value.
    Children are the draft's top-k, or at T > 0 under a rule with ``siblings="sampled"`` drawn without replacement
    with ``generator`` (:func:`propose_children`)."""
    tree = DraftTree(sampled=rule.siblings == "sampled" and not sampling.greedy)
    step = drafter.root() if max_depth > 0 else None
    parents = [-1]  # the nodes whose children the latest forward proposed (−1: the root)
    while step is not None:
        tree.forwards += 1
        stats.draft_calls += 1
        q = draft_probs(step.logits, sampling)
        proposed = propose_children(tree, rule, parents, q, generator, step.support, drafter.vocab_size)
        if not proposed:  # nothing drawn (or q = 0 everywhere): the tree is final
            break
        with _timed(stats, "head_time"):
            for node, score in zip(proposed, rule.prior_scores(tree, proposed)):
                tree.rescore(node, score, checked=False)  # just proposed: childless
        if tree.depth >= max_depth or not rule.grow(tree):
            break
        parents = rule.frontier(tree)
        if not parents:
            break
        slots = [tree.slots[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in parents]
        step = drafter.expand([tree.tokens[n] for n in parents], slots)
        first = max(tree.slots, default=-1) + 1
        for i, node in enumerate(parents):
            tree.slots[node], tree.hidden[node] = first + i, step.hidden[i]
        if rule.uses_hidden:
            with _timed(stats, "head_time"):
                for node, score in zip(parents, rule.score(step.hidden, tree, parents)):
                    tree.rescore(node, score)
    return tree


def propose_children(
    tree: DraftTree,
    rule: TreeRule,
    parents: Sequence[int],
    q: torch.Tensor,
    generator: torch.Generator | None,
    support: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> list[int]:
    """Add children of ``parents`` (q: their draft distributions, (n, V), or (n, S) over the ascending ids
    ``support`` of a pruned draft whose vocabulary has ``vocab_size`` ids) to ``tree``, each scored by its draft
    probability for now: the top ``rule.children`` of each, or — ``tree.sampled`` — as many as
    :meth:`~accept_head.trees.growth.CostTree.sibling_counts` decides from the parents, drawn without replacement in
    draw order (each parent's q kept for verification, over the whole vocabulary). Returns the new nodes."""
    entropies = (-(q * q.clamp_min(1e-30).log()).sum(-1)).tolist()
    top = q.topk(min(rule.children(tree.depth + 1), q.shape[-1]), dim=-1)
    top_probs, top_index = top.values.tolist(), top.indices.tolist()
    if tree.sampled:
        positive = [[prob for prob in probs if prob > 0] for probs in top_probs]  # q = 0 outside a pruned vocabulary
        counts = rule.sibling_counts(tree, parents, positive)
        drawn = draw_without_replacement(q, max(counts), generator).tolist() if any(counts) else [[]] * len(parents)
        children = [[(t, float(q[i, t])) for t in row[:count]] for i, (row, count) in enumerate(zip(drawn, counts))]
    else:
        children = [list(zip(index, probs)) for index, probs in zip(top_index, top_probs)]
    proposed = []
    for i, (parent, entropy) in enumerate(zip(parents, entropies)):
        if tree.sampled and children[i]:
            tree.dists[parent] = q[i] if support is None else q.new_zeros(vocab_size).index_copy_(0, support, q[i])
        for index, prob in children[i]:
            if prob > 0:  # q = 0 outside a pruned vocabulary
                token = index if support is None else int(support[index])
                proposed.append(tree.add(token, parent, prob, prob, entropy, top1=top_probs[i][0]))
    return proposed


def tree_rows(tree: DraftTree, nodes: Sequence[int]) -> tuple[list[int], list[int], list[list[int]], list[list[int]]]:
    """Lay the verified ``nodes`` (creation order, ancestor-closed) out for the target: (tokens, parents) of the
    target's tree with the root at index 0, and each root-to-leaf row as round nodes and as target tree indices."""
    index = {node: i + 1 for i, node in enumerate(nodes)}
    tokens = [tree.tokens[n] for n in nodes]
    parents = [index.get(tree.parents[n], 0) for n in nodes]
    inner = {tree.parents[n] for n in nodes}
    paths = [tree.path(n) for n in nodes if n not in inner]
    return tokens, parents, paths, [[index[n] for n in path] for path in paths]


@torch.inference_mode()
def tree_generate(
    target: torch.nn.Module,
    draft,
    input_ids: torch.Tensor | Sequence[int],
    rule: TreeRule,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    observe: Callable[[DraftTree, list[int], torch.Tensor], None] | None = None,
) -> GenerationResult:
    """Lossless speculative decoding over draft trees grown by ``rule`` (see the module docstring).

    ``draft``: a Hugging Face causal LM sharing the target's tokenizer, a
    :class:`~accept_head.models.feature_draft.FeatureDraft` or a :class:`~accept_head.trees.drafters.TreeDrafter`. The
    target must take a custom 4D attention mask (eager or SDPA attention). Returns the sequences and
    :class:`~accept_head.trees.verify.TreeDecodeStats` (``fed``: tokens fed to the target per call, ``rows``: leaves).
    ``observe(tree, nodes, logits)``, if given, sees each round after verification: the drafted tree, the verified
    nodes and the target's logits (1 + len(nodes), V) at the root and at each of them (for tree labels,
    :mod:`~accept_head.trees.labels`).

    A rule with ``context_row`` > 0 adds to every round's verified nodes up to that many tokens copied from the text
    itself (:class:`~accept_head.trees.context.ContextRow`: what followed the latest earlier occurrence of the last
    three, else two, tokens) and as many below the drafted leaf most likely reached, merged into the tree where the
    draft proposed the same tokens. The copies are fixed before verification, so decoding stays exact
    (:func:`add_copied_rows`).

    The target must be one a tree mask serves (:func:`~accept_head.trees.attention.check_masked_attention`: sliding
    windows get their window per layer type, ALiBi is refused). A request past its context warns
    (:class:`~accept_head.chain.decoding.ContextLimitWarning`) and returns the tokens that fit.
    """
    _check_int("max_new_tokens", max_new_tokens, low=0)
    sampling = SamplingConfig(temperature, top_k, top_p)
    stats = TreeDecodeStats()
    rounds = TreeRounds(tree_drafter_for(draft, target, rule), rule, sampling, stats, generator)
    return decode_rounds(target, rounds, input_ids, max_new_tokens, sampling, eos_token_id, generator, observe)


class Rounds(Protocol):
    """What a decoder verified by tree passes drafts each round (:func:`decode_rounds`)."""

    drafter: TreeDrafter | Drafter
    stats: TreeDecodeStats

    def draft(self, tokens: list[int], depth: int) -> tuple[DraftTree, list[int]]:
        """The round's tree and the nodes to verify (creation order, ancestor-closed; no path deeper than ``depth``)
        after the committed ``tokens``."""
        ...

    def commit(self, tree: DraftTree, accepted: list[int], new: list[int], hidden: torch.Tensor | None) -> None:
        """Keep the ``accepted`` nodes: ``new`` are the committed tokens (the accepted path and the target's own),
        ``hidden`` the target's final hidden states at the root and the accepted nodes (feature drafts), else None."""
        ...


class TreeRounds:
    """:func:`tree_generate`'s rounds: ``rule``'s tree grown by a :class:`~accept_head.trees.drafters.TreeDrafter`,
    with the rule's copied rows (``context_row``) merged in."""

    def __init__(
        self,
        drafter: TreeDrafter,
        rule: TreeRule,
        sampling: SamplingConfig,
        stats: TreeDecodeStats,
        generator: torch.Generator | None,
    ) -> None:
        self.drafter, self.rule, self.sampling, self.stats, self.generator = drafter, rule, sampling, stats, generator
        self.copy = ContextRow(rule.context_row) if rule.context_row else None

    def draft(self, tokens: list[int], depth: int) -> tuple[DraftTree, list[int]]:
        tree = draft_tree(self.drafter, self.rule, self.sampling, depth, self.stats, self.generator)
        nodes = self.rule.select(tree)
        if self.copy is not None:
            nodes = add_copied_rows(tree, nodes, self.copy, tokens, depth)
        return tree, nodes

    def commit(self, tree: DraftTree, accepted: list[int], new: list[int], hidden: torch.Tensor | None) -> None:
        self.drafter.commit(new, hidden, _fed_slots(tree, accepted))


def decode_rounds(
    target: torch.nn.Module,
    rounds: Rounds,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    observe: Callable[[DraftTree, list[int], torch.Tensor], None] | None = None,
    target_runtime: str = "eager",
) -> GenerationResult:
    """The round loop of the decoders verified by one tree pass per round (:func:`tree_generate`,
    :func:`~accept_head.trees.chain_copies.chain_copy_generate`): ``rounds`` drafts the nodes, the target scores the
    root and every node under a tree mask, :func:`verify_tree` accepts a path and the target's own token, and the
    target's cache and ``rounds`` keep exactly that path. ``target_runtime``: the target's cache
    (:func:`~accept_head.models.static_target.target_cache`; a static one holds the prompt, the budget and 16 more
    positions, so the rounds must not verify more than 16 nodes past the budget)."""
    layout = attention_layout(target)  # the caller checked the target with check_masked_attention
    ids, budget, eos = _prepare(input_ids, max_new_tokens, eos_token_id, target)
    stats, tokens, drafter = rounds.stats, ids[0].tolist(), rounds.drafter
    with _timed(stats, "total_time"):
        cache = target_cache(target, target_runtime, ids.shape[1] + budget)  # lacks the last token, each round's root
        with _timed(stats, "target_time"):
            prefill(target, drafter, ids.to(next(target.parameters()).device), cache)
        while stats.generated < budget:
            # 1. Draft: a path commits at most budget - generated - 1 candidates, never past the draft's context.
            depth = min(budget - stats.generated - 1, draft_room(drafter, len(tokens)))
            with _timed(stats, "draft_time"):
                tree, nodes = rounds.draft(tokens, depth)
            with _timed(stats, "target_time"):  # 2. Verify the root (the last token) and the nodes in one pass
                tree_tokens, parents, paths, rows = tree_rows(tree, nodes)
                logits, hidden = tree_pass(
                    target, cache, [tokens[-1], *tree_tokens], [-1, *parents], layout, drafter.needs_target_features
                )
                row, m, next_token = verify_tree(logits, tree, paths, rows, sampling, generator)
                accepted = paths[row][:m] if m else []
                commit_nodes(cache, len(tokens) - 1, rows[row][:m] if m else [])
            if observe is not None:
                observe(tree, nodes, logits)
            # 3. Commit the accepted path and the target's token (up to an EOS); both models keep that path.
            new = _until_eos([*(tree.tokens[n] for n in accepted), next_token], eos)
            stats.record_tree_round(1 + len(nodes), len(paths), len(paths[row]) if row >= 0 else 0, m, len(new))
            with _timed(stats, "draft_time"):
                features = hidden[[0, *(rows[row][:m] if m else [])]] if drafter.needs_target_features else None
                rounds.commit(tree, accepted, new, None if features is None else features[: len(new)])
            tokens.extend(new)
            if new[-1] in eos:
                break
    return GenerationResult(torch.tensor([tokens], dtype=torch.long), stats)


def add_copied_rows(
    tree: DraftTree, nodes: list[int], copy: ContextRow, tokens: Sequence[int], depth: int, room: int | None = None
) -> list[int]:
    """The verified ``nodes`` with the rule's copied rows merged in (:func:`add_copied_row`): one after the committed
    ``tokens`` at the root, and one below the drafted leaf most likely reached and accepted (the highest value), copied
    after ``tokens`` and that leaf's path — so a path the draft gets right can run on where the text repeats. No path
    grows deeper than ``depth``, and with ``room`` the rows are cut so that no more than ``room`` nodes are verified."""

    def fits(row: list[int]) -> list[int]:
        return row if room is None else row[: max(room - len(nodes), 0)]

    nodes = add_copied_row(tree, nodes, fits(copy(tokens, depth)))
    inner = {tree.parents[n] for n in nodes}
    leaves = [n for n in nodes if n not in inner and n not in tree.copied]
    if leaves:
        leaf = max(leaves, key=lambda n: tree.values[n])  # ties: the earlier node
        path = [tree.tokens[n] for n in tree.path(leaf)]
        nodes = add_copied_row(tree, nodes, fits(copy(tokens, depth - tree.depths[leaf], path)), parent=leaf)
    return nodes


def add_copied_row(tree: DraftTree, nodes: list[int], row: Sequence[int], parent: int = -1) -> list[int]:
    """The verified ``nodes`` with the copied ``row`` merged in below ``parent`` (−1: the root; else a verified node):
    its tokens follow the verified nodes that already hold them, and the rest hang below as new nodes of ``tree``
    (probability and score 0, marked in ``tree.copied``), appended in creation order so that the nodes stay
    ancestor-closed.

    Exact at every temperature: the row is a function of the committed text and the drafted path alone, both fixed
    before verification. Greedy verification accepts a copied node iff it is the target's argmax; at T > 0 it is a
    point-mass guess, tried after the draft's own children (:func:`~accept_head.trees.verify.verify_sampled`,
    :func:`~accept_head.trees.verify.verify_recursive`).
    """
    if not row:
        return nodes
    chosen, out = set(nodes), list(nodes)
    for token in row:
        same = [n for n in tree.children.get(parent, []) if n in chosen and tree.tokens[n] == token]
        if same:
            parent = same[0]
            continue
        parent = tree.add(token, parent, 0.0, 0.0)
        tree.copied.add(parent)
        out.append(parent)
    return out


def tree_drafter_for(draft, target: torch.nn.Module, rule: TreeRule) -> TreeDrafter:
    """The :class:`~accept_head.trees.drafters.TreeDrafter` for ``draft`` (:func:`as_tree_drafter`), after checking
    that ``target`` takes a tree mask and that the rule's acceptance head, if any, reads the draft's hidden size."""
    check_masked_attention(target)
    drafter = as_tree_drafter(draft, target)
    head = getattr(rule, "head", None)
    if head is not None and head.hidden_size != drafter.hidden_size:
        raise ValueError(
            f"The acceptance head expects hidden size {head.hidden_size} but the draft's is {drafter.hidden_size}; "
            "train a head for this draft."
        )
    return drafter


def verify_tree(
    logits: torch.Tensor,
    tree: DraftTree,
    paths: list[list[int]],
    rows: list[list[int]],
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[int, int, int]:
    """Verify a round: ``logits`` (1 + |nodes|, V) are the target's at the root and at each verified node (target
    tree indices ``rows``, round nodes ``paths``, as :func:`tree_rows` lays them out). Greedy accepts a node iff it is
    the argmax; otherwise :func:`~accept_head.trees.verify.verify_sampled` on ``probabilities(logits, sampling)``.
    Returns (winning row or −1, accepted count m, the target's next token)."""
    if sampling.greedy:
        return verify_greedy(argmax(logits).tolist(), _row_tokens(tree, paths), rows)
    if tree.sampled:  # every node verified, target index = node + 1 (rows of all nodes; copies come last)
        probs = probabilities(logits, sampling)
        accepted, token = verify_recursive(probs, tree.children, tree.tokens, tree.dists, generator, tree.copied)
        row = next((r for r, path in enumerate(paths) if path[: len(accepted)] == accepted), -1)
        return row, len(accepted), token
    return verify_sampled(probabilities(logits, sampling), _row_tokens(tree, paths), rows, generator)


def _row_tokens(tree: DraftTree, paths: list[list[int]]) -> list[list[int]]:
    return [[tree.tokens[n] for n in path] for path in paths]


def _fed_slots(tree: DraftTree, accepted: Sequence[int]) -> list[int]:
    """The drafter's slots of the accepted nodes it was fed (a prefix of the path)."""
    slots = []
    for node in accepted:
        if tree.slots[node] < 0:
            break
        slots.append(tree.slots[node])
    return slots
