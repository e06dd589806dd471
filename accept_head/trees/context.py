"""Guesses copied from the text itself: the continuation of an earlier occurrence of the text's last few tokens.

Code, arithmetic and tool calls repeat their own text (a variable name, a number carried into the next line, a
quoted argument), and a one-layer draft copies poorly. :class:`ContextNgrams` indexes every q-gram of the growing
text (prompt and output) to the positions that follow it; :class:`ContextRow` asks it for the longest recurring
suffix and returns what followed its latest earlier occurrence. Such a row is a deterministic function of the
committed text, so it can join any round's candidates without touching exactness: greedy verification accepts a
token iff it is the target's argmax, and sampled verification tries it as a point-mass guess
(:func:`~accept_head.trees.verify.verify_sampled`, :func:`~accept_head.trees.verify.verify_recursive`).
N-Grammys' context rows (:mod:`~accept_head.learning_free.ngrammys`) use the same index.
"""

from __future__ import annotations

from collections.abc import Sequence


class ContextNgrams:
    """Index of the q-grams of a growing token sequence (prompt and output) to the positions that follow them."""

    def __init__(self, q: int) -> None:
        self.q = q
        self.follows: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0

    def update(self, tokens: Sequence[int]) -> None:
        """Index the q-grams ending at positions not indexed yet (``tokens`` only ever grows)."""
        for end in range(max(self.indexed, self.q), len(tokens) + 1):
            self.follows.setdefault(tuple(tokens[end - self.q : end]), []).append(end)
        self.indexed = len(tokens) + 1

    def matches(self, tokens: Sequence[int], k: int, w: int) -> list[tuple[int, list[int]]]:
        """Up to k distinct continuations (up to w tokens each) of earlier occurrences of the last q tokens, most
        recent first, as (start, row) pairs: ``start`` is the index in ``tokens`` where the continuation starts."""
        self.update(tokens)
        matches: list[tuple[int, list[int]]] = []
        for start in reversed(self.follows.get(tuple(tokens[-self.q :]), [])):
            row = list(tokens[start : start + w])
            if row and all(row != other for _, other in matches):
                matches.append((start, row))
                if len(matches) == k:
                    break
        return matches


LONG_MATCH = 5
"""A recurring suffix at least this long counts as a long repeat (``CopyingChain.long_row``): after one of 5 or more
tokens, on the greedy rollout labels of 48 `head`-split prompts, a copy of 16 accepted 4.02–6.83 tokens against
1.96–3.00 for a copy of 4 (``docs/experiments/context_copies.py --by_match true``)."""


class ContextRow:
    """Up to ``length`` tokens that followed the latest earlier occurrence of the text's longest recurring suffix of
    ``longest`` down to ``shortest`` tokens (none when no suffix that long recurs) — and, given ``long_length`` and
    ``long_match``, up to ``long_length`` tokens when that suffix is at least ``long_match`` tokens long (text that
    repeats a long stretch tends to go on repeating it), looked up from ``max(longest, long_match)`` tokens down so that
    a long repeat is followed from its own latest occurrence. Chains with copies use it only on request
    (``CopyingChain(long_row=)``): 16 tokens after a match of 5 or more decoded held-out prompts 1.01–1.03× as fast
    (HumanEval 1.10–1.15×; ``docs/experiments/copy_length.py``, findings §8).

    One object follows one growing text (the prompt, then every committed token): build a new one per sequence.
    """

    def __init__(
        self,
        length: int,
        shortest: int = 2,
        longest: int = 3,
        long_length: int | None = None,
        long_match: int | None = None,
    ) -> None:
        required = {"length": length, "shortest": shortest, "longest": longest}
        optional = {"long_length": long_length, "long_match": long_match}
        for name, value in (required | {k: v for k, v in optional.items() if v is not None}).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"context row {name}={value!r} must be an integer >= 1.")
        if shortest > longest:
            raise ValueError(f"context row shortest={shortest} must be <= longest={longest}.")
        self.length = length
        self.long = (long_length, long_match) if long_length and long_match and long_length > length else None
        top = max(longest, long_match or 0) if self.long else longest
        self.indices = [ContextNgrams(q) for q in range(top, shortest - 1, -1)]

    def __call__(self, tokens: Sequence[int], length: int | None = None, path: Sequence[int] = ()) -> list[int]:
        """The copied row after ``tokens`` (its length the row's own — longer after a long match — capped at
        ``length``), or []. With ``path`` (tokens drafted after ``tokens``, not committed), the row that would follow
        ``tokens + path``: its suffix is looked up among the committed text's n-grams, and nothing is indexed from
        ``path``."""
        if length is not None and length < 1:
            return []
        text = [*tokens[-self.indices[0].q :], *path] if path else tokens
        for index in self.indices:
            index.update(tokens)
            if len(text) < index.q:
                continue
            ends = index.follows.get(tuple(text[-index.q :]), [])
            earlier = [end for end in ends if end < len(tokens)]  # a continuation exists (not the suffix itself)
            if earlier:
                row = self.long[0] if self.long and index.q >= self.long[1] else self.length
                return list(tokens[earlier[-1] : earlier[-1] + (row if length is None else min(length, row))])
        return []
