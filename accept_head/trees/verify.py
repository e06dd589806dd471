"""One target pass over many guesses: token trees under a custom 4D attention mask, and their lossless verification.

The learning-free decoders (:mod:`~accept_head.learning_free.ngrammys`, :mod:`~accept_head.learning_free.lookahead`)
submit several guessed
continuations ("rows") of the committed text at once. They are laid out as one sequence of ``T`` new tokens whose
attention pattern is a tree: token ``i`` has a parent ``parents[i]`` (−1: it follows the committed prefix directly)
and attends to the whole KV cache of the prefix plus its ancestors and itself; its position id is the prefix length
plus its depth. Rows that share the root share its keys and values, and the prefix is never copied per row.

transformers API: ``model(input_ids, attention_mask=<(1, 1, T, L + T) additive float mask, or one per layer type>,
position_ids=(1, T), cache=DynamicCache, use_cache=True, logits_to_keep=<1-D index tensor>)`` (``past_key_values=``
before 5.24). In transformers 5.x ``masking_utils.create_causal_mask`` returns a 4D mask unchanged ("already prepared
4D mask ... returned as-is", checked in 5.24), and the eager, SDPA and this toolkit's grouped eager attention add a
float mask to the scores, so the tree pattern reaches every layer; sliding windows and per-layer-type masks are built
into it by :mod:`~accept_head.trees.attention`, which also refuses the targets a tree mask cannot serve (ALiBi).
After verification :func:`~accept_head.core.hf_compat.keep_cache_positions` keeps the prefix, the root and the
accepted row's positions.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache

from ..chain.decoding import DecodeStats, _forward
from ..core.hf_compat import cache_kwargs, keep_cache_positions
from ..core.sampling import generator_device, sample_one
from ..models.features import capture_lm_head_input
from ..models.static_target import StaticTarget
from .attention import AttentionLayout, attention_layout, layer_masks, tree_mask


@dataclass
class TreeDecodeStats(DecodeStats):
    """:class:`~accept_head.chain.decoding.DecodeStats` of a decoder that verifies several rows per target call.

    ``proposed`` / ``accepted`` hold the *winning* row's length and accepted count per call (``discarded`` sums
    their difference); ``draft_calls`` stays 0 (no draft model) and ``draft_time`` is the time spent building
    guesses.
    """

    fed: list[int] = field(default_factory=list)
    """Tokens fed to the target in each call (the root, every row and, for Lookahead, its window)."""
    rows: list[int] = field(default_factory=list)
    """Candidate rows verified in each call."""

    def record_tree_round(self, fed: int, rows: int, proposed: int, accepted: int, committed: int) -> None:
        """Count one target call that fed ``fed`` tree tokens holding ``rows`` candidate rows: the winning row's
        ``proposed`` tokens, ``accepted`` of them, ``committed`` tokens kept (see
        :meth:`~accept_head.chain.decoding.DecodeStats.record_round`)."""
        self.fed.append(fed)
        self.rows.append(rows)
        self.record_round(proposed, accepted, committed)


@dataclass(frozen=True)
class RowOrigin:
    """Where a guessed row came from: what a stop rule may read about it besides its tokens."""

    source: str
    """``context`` (copied from earlier text), ``model`` (the model bigram's chain) or ``pool`` (Lookahead's pool)."""
    rank: int
    """Rank within its source: 0 = the most recent context match, the most likely successor, the newest pool entry."""
    start: int = -1
    """For ``context`` rows: the index in the committed text where the copied continuation starts; else −1."""


class RowStop(Protocol):
    """Chooses how much of each guessed row a learning-free decoder submits (:mod:`~accept_head.engine.free_stop`).

    The decoder calls ``start`` once with the prompt, then every round ``select`` before the target call and
    ``observe`` after it. ``select`` returns one length per row in [0, len(row)]: the row's first tokens to verify
    (0 drops it). It sees only the committed text and the guesses, never the target's output, so every guess is
    fixed before verification and decoding stays lossless whatever it returns.
    """

    def start(self, tokens: Sequence[int]) -> None: ...

    def select(self, tokens: Sequence[int], rows: list[list[int]], origins: list[RowOrigin], fed: int) -> list[int]:
        """``tokens``: the committed text (its last token is the tree's root); ``fed``: tokens the call feeds
        besides the rows (the root, and Lookahead's window)."""
        ...

    def observe(
        self,
        tokens: Sequence[int],
        rows: list[list[int]],
        origins: list[RowOrigin],
        nodes: list[list[int]],
        logits: torch.Tensor,
    ) -> None:
        """After verification: ``logits[0]`` (V,) is the target's output after the root and ``logits[nodes[r][j]]``
        after ``rows[r][j]``; ``tokens`` is still the text before this round's tokens are committed."""
        ...


def apply_stop(
    stop: RowStop, tokens: Sequence[int], rows: list[list[int]], origins: list[RowOrigin], fed: int
) -> tuple[list[list[int]], list[RowOrigin]]:
    """The rows ``stop`` keeps (each cut to its selected length; empty ones dropped) and their origins."""
    if not rows:
        return rows, origins
    lengths = stop.select(tokens, rows, origins, fed)
    if len(lengths) != len(rows) or any(not 0 <= n <= len(row) for n, row in zip(lengths, rows)):
        raise ValueError(
            f"{type(stop).__name__}.select returned lengths {list(lengths)} for rows of lengths "
            f"{[len(row) for row in rows]}: it must return one length in [0, len(row)] per row."
        )
    kept = [(row[:n], origin) for n, row, origin in zip(lengths, rows, origins) if n > 0]
    return [row for row, _ in kept], [origin for _, origin in kept]


def prefill_root(target: torch.nn.Module, ids: torch.Tensor) -> DynamicCache:
    """The target's KV cache over the prompt ``ids`` (1, L) but its last token, which the first tree feeds as its
    root (tree index 0); the cache keeps lacking the last committed token from then on."""
    cache = DynamicCache()
    if ids.shape[1] > 1:
        _forward(target, ids[:, :-1].to(next(target.parameters()).device), cache, last_only=True)
    return cache


def add_rows(tokens: list[int], parents: list[int], root: int, rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """Append ``rows`` to the tree (``tokens`` / ``parents`` in place), each a chain hanging off node ``root``.

    Returns ``nodes``: ``nodes[r][j]`` is the tree index of ``rows[r][j]``.
    """
    nodes = []
    for row in rows:
        parent, indices = root, []
        for token in row:
            tokens.append(int(token))
            parents.append(parent)
            parent = len(tokens) - 1
            indices.append(parent)
        nodes.append(indices)
    return nodes


def tree_forward(
    model: torch.nn.Module,
    cache: DynamicCache,
    tokens: Sequence[int],
    parents: Sequence[int],
    keep: Sequence[int] | None = None,
    layout: AttentionLayout | None = None,
) -> torch.Tensor:
    """Run a token tree through ``model`` on top of its KV cache (prefix length L) in one forward pass.

    tokens / parents: length T. Position ids are L + depth, clamped to the model's last position
    (``max_position_embeddings`` − 1; for guesses that would run past the context: they are never committed). Each
    layer gets the mask it needs (:func:`~accept_head.trees.attention.layer_masks`: a sliding layer its window,
    counted in positions); the cache's positions must be the committed text's, 0..L − 1, as :func:`commit_nodes`
    leaves them. ``layout``: ``model``'s :class:`~accept_head.trees.attention.AttentionLayout` as the decoder's
    up-front :func:`~accept_head.trees.attention.check_masked_attention` returned it (read from the config if None).
    Returns logits (len(keep), V), rows in ``keep`` order (all T rows if ``keep`` is None). The cache grows by T
    positions; the caller keeps what was accepted with :func:`commit_nodes`.
    """
    device = next(model.parameters()).device
    dtype = getattr(model, "dtype", torch.float32)
    prefix = cache.get_seq_length()
    allowed, depths = tree_mask(parents)
    positions = prefix + depths
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None:
        positions = positions.clamp(max=limit - 1)
    out = model(
        input_ids=torch.tensor([list(tokens)], device=device),
        attention_mask=layer_masks(layout or attention_layout(model), allowed, positions, prefix, dtype, device),
        position_ids=positions[None].to(device),
        **cache_kwargs(model, cache),
        logits_to_keep=0 if keep is None else torch.tensor(list(keep), device=device),
    )
    return out.logits[0]


def tree_pass(
    model: torch.nn.Module,
    cache: DynamicCache | StaticTarget,
    tokens: Sequence[int],
    parents: Sequence[int],
    layout: AttentionLayout | None = None,
    with_hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`tree_forward` over either kind of target cache: a ``DynamicCache`` (the model's own forward; ``layout``
    as there) or a :class:`~accept_head.models.static_target.StaticTarget` (its preallocated, optionally compiled
    pass; full attention only). Returns (logits (T, V), the final hidden states (T, d) when ``with_hidden`` or the
    static pass gives them, else None)."""
    if isinstance(cache, StaticTarget):
        allowed, depths = tree_mask(parents)
        return cache.tree_forward(torch.tensor([list(tokens)], device=next(model.parameters()).device), allowed, depths)
    if not with_hidden:
        return tree_forward(model, cache, tokens, parents, layout=layout), None
    with capture_lm_head_input(model) as box:
        logits = tree_forward(model, cache, tokens, parents, layout=layout)
    return logits, box[0][0]


def commit_nodes(cache: DynamicCache | StaticTarget, prefix: int, nodes: Sequence[int]) -> None:
    """After :func:`tree_forward` (or :func:`tree_pass`) on a cache of ``prefix`` positions: keep the prefix, the root
    (tree index 0) and the tree nodes ``nodes`` (the accepted tokens, in order)."""
    if isinstance(cache, StaticTarget):
        cache.keep(prefix + 1, [prefix + n for n in nodes])
    else:
        keep_cache_positions(cache, prefix + 1, [prefix + n for n in nodes])


def verify_greedy(argmax: Sequence[int], rows: Sequence[Sequence[int]], nodes: Sequence[Sequence[int]]) -> tuple:
    """Greedy verification of rows hanging off the root (Fu et al. 2024, Alg. 3; N-Grammys' longest match).

    ``argmax[n]``: the target's greedy next token after tree node ``n`` (0 = root). A row's candidates are accepted
    while each equals the target's argmax after its predecessor. Returns (winning row or −1 if there are no rows,
    accepted count m, the target's own next token after the last accepted one). Ties go to the earlier row.
    """
    best, best_m = -1, 0
    for r, row in enumerate(rows):
        m = 0
        while m < len(row) and row[m] == argmax[nodes[r][m - 1] if m else 0]:
            m += 1
        if best < 0 or m > best_m:
            best, best_m = r, m
    last = nodes[best][best_m - 1] if best_m else 0
    return best, best_m, int(argmax[last])


def verify_sampled(
    probs: torch.Tensor,
    rows: Sequence[Sequence[int]],
    nodes: Sequence[Sequence[int]],
    generator: torch.Generator | None,
) -> tuple:
    """Lossless sampling verification of deterministic guesses (Fu et al. 2024, Alg. 4 "sample verification").

    ``probs[n]`` (V,): the target's distribution after tree node ``n`` (0 = root). At each depth the distinct
    candidate tokens of the rows still alive are tried in row order: candidate c is accepted with probability
    residual(c) / Σ residual, else its mass is removed from the residual; if none is accepted the next token is drawn
    from the residual. Each token is thereby distributed exactly as the target's (a point-mass draft makes the
    speculative-sampling ratio p/q equal p). Returns (winning row or −1, accepted count m, next token).
    """
    alive, node, m = list(range(len(rows))), 0, 0
    while True:
        live = [r for r in alive if len(rows[r]) > m]
        if not live:  # every surviving row is exhausted: the bonus token
            return (alive[0] if alive else -1), m, sample_one(probs[node], generator)
        residual, tried, accepted = probs[node].double().clone(), set(), None
        for r in live:
            token = rows[r][m]
            if token in tried:
                continue
            tried.add(token)
            u = float(torch.rand(1, generator=generator, dtype=torch.float64, device=generator_device(generator)))
            if u * float(residual.sum()) < float(residual[token]):  # p = 0 never passes, p = Σ always does
                accepted = token
                break
            residual[token] = 0.0
        if accepted is None:
            if float(residual.sum()) <= 0:  # rounding only: the removed tokens held all the mass
                residual = probs[node].double()
            return live[0], m, sample_one(residual, generator)
        alive = [r for r in live if rows[r][m] == accepted]
        node, m = nodes[alive[0]][m], m + 1


def verify_recursive(
    probs: torch.Tensor,
    children: dict[int, list[int]],
    tokens: Sequence[int],
    dists: dict[int, torch.Tensor],
    generator: torch.Generator | None,
    copied: Container[int] = (),
) -> tuple[list[int], int]:
    """Lossless verification of siblings *drawn without replacement* from the draft (recursive rejection sampling
    without replacement; Jeon et al. 2024, "Recursive Speculative Decoding").

    ``probs[n + 1]`` (V,): the target's distribution after node ``n`` (``probs[0]``: after the root); ``children[n]``
    the nodes drawn from ``dists[n]`` (the draft's q at n, −1 for the root) in draw order; ``tokens[n]`` each node's
    token. At the current node, with p its target distribution and q its draft distribution, siblings x_1, x_2, ... are
    tried in draw order: x_i is accepted with probability min(1, p_i(x_i)/q_i(x_i)); on rejection
    p_{i+1} ∝ max(0, p_i − q_i) and q_{i+1} ∝ q_i without x_i (the law of the next draw given the earlier ones). If
    none is accepted the token is drawn from what remains of p. By induction over the siblings every emitted token
    follows p whatever q is — provided how many siblings are tried was fixed before they were drawn. The first
    sibling is accepted exactly as a chain's candidate is.

    Nodes in ``copied`` are point-mass guesses fixed before verification (copied rows), not draws: when every
    drawn sibling was rejected, each is tried on what remains of p as :func:`verify_sampled` tries a guess — accepted
    with probability r(c) / Σ r, else its mass removed — which draws from r exactly. Returns (accepted nodes from
    depth 1, next token).
    """
    node, accepted = -1, []
    while True:
        kids = [k for k in children.get(node, []) if k not in copied]
        drawn = [tokens[k] for k in kids]
        kid, residual = try_siblings(probs[node + 1], dists[node] if kids else None, drawn, generator)
        if kid is None:
            guesses = [k for k in children.get(node, []) if k in copied]
            kid, residual = try_guesses(residual, [tokens[k] for k in guesses], generator)
            if kid is None:
                return accepted, sample_one(residual, generator)
            kids = guesses
        node = kids[kid]
        accepted.append(node)


def try_guesses(
    residual: torch.Tensor, guesses: Sequence[int], generator: torch.Generator | None
) -> tuple[int | None, torch.Tensor]:
    """Try distinct point-mass ``guesses`` in turn against the distribution ``residual`` (V,): guess c is accepted with
    probability r(c) / Σ r, else its mass is removed. Returns (index of the accepted guess or None, what remains of
    the distribution). Emitting the accepted guess, or a draw from what remains, draws from ``residual`` exactly."""
    residual = residual.double().clone() if guesses else residual
    for i, token in enumerate(guesses):
        u = float(torch.rand(1, generator=generator, dtype=torch.float64, device=generator_device(generator)))
        if u * float(residual.sum()) < float(residual[token]):  # r = 0 never passes
            return i, residual
        residual[token] = 0.0
    return None, residual  # a guess holding all that remained was accepted: the rest keeps mass


def try_siblings(
    p: torch.Tensor, q: torch.Tensor | None, drawn: Sequence[int], generator: torch.Generator | None
) -> tuple[int | None, torch.Tensor]:
    """One node of :func:`verify_recursive`: try the ``drawn`` tokens (drawn without replacement from ``q``, in draw
    order) against the target's ``p``. Returns (index of the accepted token, None if none was) and the distribution
    to draw the next token from when none was (p itself when nothing was drawn)."""
    if not drawn:
        return None, p
    p, q = p.double(), q.double().clone()
    for i, token in enumerate(drawn):
        u = float(torch.rand(1, generator=generator, dtype=torch.float64, device=generator_device(generator)))
        if u * float(q[token]) < float(p[token]):  # min(1, p/q): p >= q always passes
            return i, p
        residual = (p - q).clamp_min(0.0)
        q[token] = 0.0
        p_mass, q_mass = float(residual.sum()), float(q.sum())
        if p_mass <= 0:  # rounding only: q covered p, so no rejection was possible
            return None, p
        p = residual / p_mass
        if q_mass <= 0:  # q's whole support was drawn and rejected
            return None, p
        q = q / q_mass
    return None, p
