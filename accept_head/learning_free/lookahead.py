"""Lookahead decoding (Fu, Bailis, Stoica, Zhang, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding", ICML 2024).

Each step is ONE target call over two branches laid out as one token tree (:mod:`~accept_head.trees.verify`):

- the *lookahead branch*: a 2D window of N − 1 levels × W columns of Jacobi iterates.
  Level 0 starts with the current token x_t; the token at (level l, column i) sits at position t + l + i and attends
  to level 0's columns 0..i and to levels 1..l of column i — the trajectory of one Jacobi diagonal. The target's
  argmax after the top level gives the next level, and each column, read top-down with that argmax appended, is an
  N-gram for the pool;
- the *verification branch*: up to G (guess-set size) (N − 1)-token continuations of x_t from the
  n-gram pool, each a row off x_t, verified greedily (Alg. 3: the longest row matching the target's argmax) or, at
  temperature > 0, by sample verification (Alg. 4, :func:`~accept_head.trees.verify.verify_sampled`), which keeps
  the output distribution exactly the target's.

The window starts as one level, x_t followed by W + N − 3 tokens drawn from the prompt, and gains a level per step
(each level one Jacobi step past the previous) until it has N − 1, as the reference implementation
(github.com/hao-ai-lab/LookaheadDecoding) fills it; n-grams are collected from then on. The window advances by one
position per step whatever was accepted (the reference implementation's default). The pool maps a first token to
its G most recently produced continuations (least recently used dropped first); it can be seeded with the prompt's
and the output's own n-grams (``context_ngrams=True``) and carried across calls by passing the same
:class:`NgramPool`. Guesses already in the pool are verified while the window is still filling.

The target call is :func:`~accept_head.trees.verify.tree_forward` (the transformers API it relies on is described
there). Batch size 1.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ..chain.decoding import GenerationResult, _check_int, _prepare, _timed, _until_eos
from ..core.sampling import SamplingConfig, argmax, probabilities
from ..trees.attention import check_masked_attention
from ..trees.verify import (
    RowOrigin,
    RowStop,
    TreeDecodeStats,
    add_rows,
    apply_stop,
    commit_nodes,
    prefill_root,
    tree_forward,
    verify_greedy,
    verify_sampled,
)


def check_lookahead_params(window: int, ngram: int, guess_set: int) -> None:
    """W >= 1 columns, N >= 2 (an N-gram is a key token plus N − 1 guesses), G >= 1 guesses per key."""
    for name, value, low in (("window (W)", window, 1), ("ngram (N)", ngram, 2), ("guess_set (G)", guess_set, 1)):
        _check_int(name, value, low)


class NgramPool:
    """The n-gram pool: for each first token, up to ``guess_set`` continuations of ``ngram − 1`` tokens, least
    recently used dropped first (the reference implementation's LRU guess set)."""

    def __init__(self, ngram: int, guess_set: int, vocab_size: int) -> None:
        check_lookahead_params(1, ngram, guess_set)
        self.ngram, self.guess_set, self.vocab_size = ngram, guess_set, vocab_size
        self.table: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, continuation: Sequence[int]) -> None:
        """Insert ``key`` → ``continuation`` (N − 1 tokens) as the most recent entry of its key."""
        continuation = tuple(int(t) for t in continuation)
        if len(continuation) != self.ngram - 1:
            raise ValueError(f"a continuation has {len(continuation)} tokens; this pool holds {self.ngram - 1}.")
        entries = self.table.setdefault(int(key), [])
        if continuation in entries:
            entries.remove(continuation)
        elif len(entries) == self.guess_set:
            entries.pop(0)
        entries.append(continuation)

    def get(self, key: int) -> list[tuple[int, ...]]:
        """The continuations of ``key``, most recent first."""
        return self.table.get(int(key), [])[::-1]

    def add_sequence(self, tokens: Sequence[int], first_end: int = 0) -> None:
        """Insert every N-gram of ``tokens`` whose last token is at an index >= ``first_end``."""
        n = self.ngram
        for end in range(max(first_end, n - 1), len(tokens)):
            self.add(tokens[end - n + 1], tokens[end - n + 2 : end + 1])

    def check(self, ngram: int, guess_set: int, vocab_size: int) -> None:
        """Raise ValueError unless the pool was built for these N, G and vocabulary (tokenizer)."""
        if (self.ngram, self.guess_set) != (ngram, guess_set):
            raise ValueError(
                f"the n-gram pool holds N={self.ngram}, G={self.guess_set} but ngram={ngram}, guess_set={guess_set} "
                "were asked for; pass a pool built with the same N and G."
            )
        if self.vocab_size != vocab_size:
            raise ValueError(
                f"the n-gram pool was built for a vocabulary of {self.vocab_size} tokens but the target's has "
                f"{vocab_size}: it comes from another tokenizer."
            )


class JacobiWindow:
    """The lookahead branch's 2D window: ``levels`` (N − 1 when full) lists of equal length S (W when full).

    ``levels[l][i]`` is the token at position t + l + i; ``levels[0][0]`` is the current token x_t.
    """

    def __init__(self, window: int, ngram: int, current: int, seed_tokens: Sequence[int]) -> None:
        if len(seed_tokens) != window + ngram - 3:
            raise ValueError(f"the window starts with W + N − 3 = {window + ngram - 3} seed tokens.")
        self.window, self.ngram = window, ngram
        self.levels = [[current, *seed_tokens]]

    @property
    def full(self) -> bool:
        return len(self.levels) == self.ngram - 1

    def layout(self) -> tuple[list[int], list[int], list[int]]:
        """The window as a token tree: (tokens, parents, the tree indices of the top level). Index 0 is x_t."""
        size = len(self.levels[0])
        tokens = [t for level in self.levels for t in level]
        parents = [i - 1 for i in range(size)]  # level 0: a causal chain from x_t
        for level in range(1, len(self.levels)):  # (l, i) follows (l − 1, i): one Jacobi diagonal
            parents += [(level - 1) * size + i for i in range(size)]
        top = len(self.levels) - 1
        return tokens, parents, list(range(top * size, (top + 1) * size))

    def ngrams(self, predictions: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
        """(first token, continuation) of each column of a full window, ``predictions`` (W,) appended: the target's
        argmax after each top-level token."""
        return [
            (self.levels[0][i], (*(level[i] for level in self.levels[1:]), int(predictions[i])))
            for i in range(len(predictions))
        ]

    def advance(self, current: int, predictions: Sequence[int]) -> None:
        """One position forward: a full window drops level 0 and gains ``predictions`` as its top level; while
        filling, every level drops its first column and ``predictions[1:]`` is added. ``current`` becomes x_t."""
        if self.full:
            self.levels = [*self.levels[1:], list(predictions)]
        else:
            self.levels = [level[1:] for level in self.levels] + [list(predictions[1:])]
        self.levels[0] = [current, *self.levels[0][1:]]


def lookahead_tree(
    window: JacobiWindow, guesses: Sequence[Sequence[int]]
) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """One step's input: the window then each guess as a row off x_t. Returns (tokens, parents, top-level indices,
    nodes) with ``nodes[r][j]`` the tree index of ``guesses[r][j]``; :func:`~accept_head.trees.attention.tree_mask`
    turns ``parents`` into the attention mask."""
    tokens, parents, top = window.layout()
    nodes = add_rows(tokens, parents, 0, guesses)
    return tokens, parents, top, nodes


@torch.inference_mode()
def lookahead_generate(
    target: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    *,
    window: int = 5,
    ngram: int = 4,
    guess_set: int = 5,
    pool: NgramPool | None = None,
    context_ngrams: bool = False,
    seed: int = 0,
    stop: RowStop | None = None,
) -> GenerationResult:
    """Lossless Lookahead decoding with window W = ``window``, N-gram size N = ``ngram`` and guess-set size
    G = ``guess_set`` (see the module docstring); ``seed`` picks the prompt tokens that seed the window. Each step
    feeds W·(N − 1) window tokens once the window is full (while it fills, more or fewer) plus at most G·(N − 1)
    guesses. ``stop`` (a :class:`~accept_head.trees.verify.RowStop`) chooses how much of each guess to verify (the
    window is always fed) and sees every verification pass. Returns the sequences and
    :class:`~accept_head.trees.verify.TreeDecodeStats` (``proposed`` / ``accepted``: the winning guess)."""
    check_lookahead_params(window, ngram, guess_set)
    sampling = SamplingConfig(temperature, top_k, top_p)
    pool = _checked_pool(target, pool, ngram, guess_set)
    layout = check_masked_attention(target)
    ids, budget, eos = _prepare(input_ids, max_new_tokens, eos_token_id, target)
    stats = TreeDecodeStats()
    with _timed(stats, "total_time"):
        tokens = ids[0].tolist()
        if context_ngrams:
            pool.add_sequence(tokens)
        jacobi = JacobiWindow(window, ngram, tokens[-1], random.Random(seed).choices(tokens, k=window + ngram - 3))
        if stop is not None:
            stop.start(tokens)
        with _timed(stats, "target_time"):
            cache = prefill_root(target, ids)  # lacks x_t, fed at the window's root
        while stats.generated < budget:
            # 1. Lay out the window and the pool's guesses for x_t (no longer than the budget leaves room for).
            with _timed(stats, "draft_time"):
                room = budget - stats.generated - 1
                guesses = list(dict.fromkeys(g[:room] for g in pool.get(tokens[-1]))) if room > 0 else []
                if stop is not None:
                    origins = [RowOrigin("pool", rank) for rank in range(len(guesses))]
                    fed = len(jacobi.levels) * len(jacobi.levels[0])  # the window, x_t included
                    guesses, origins = apply_stop(stop, tokens, [list(g) for g in guesses], origins, fed)
                tree, parents, top, nodes = lookahead_tree(jacobi, guesses)
                keep, row_of, nodes = _logits_rows(top, nodes)
            # 2. One target call: Jacobi step of the window and verification of the guesses.
            with _timed(stats, "target_time"):
                logits = tree_forward(target, cache, tree, parents, keep, layout)
                greedy = argmax(logits).tolist()
                if sampling.greedy:
                    row, m, next_token = verify_greedy(greedy, guesses, nodes)
                else:
                    row, m, next_token = verify_sampled(probabilities(logits, sampling), guesses, nodes, generator)
                commit_nodes(cache, len(tokens) - 1, [keep[n] for n in nodes[row][:m]] if m else [])
            if stop is not None:
                with _timed(stats, "draft_time"):
                    stop.observe(tokens, guesses, origins, nodes, logits)
            # 3. Commit (up to an EOS); harvest the window's n-grams and move it one position on.
            new = _until_eos([*guesses[row][:m], next_token] if m else [next_token], eos)
            stats.record_tree_round(len(tree), len(guesses), len(guesses[row]) if row >= 0 else 0, m, len(new))
            tokens.extend(new)
            if new[-1] in eos:
                break
            with _timed(stats, "draft_time"):
                predictions = [greedy[row_of[n]] for n in top]
                _harvest(pool, jacobi, predictions, tokens, len(new), context_ngrams)
                jacobi.advance(tokens[-1], predictions)
    return GenerationResult(torch.tensor([tokens], dtype=torch.long), stats)


def _checked_pool(target: torch.nn.Module, pool: NgramPool | None, ngram: int, guess_set: int) -> NgramPool:
    """``pool`` checked for N, G and the target's vocabulary (a fresh pool if None)."""
    vocab = int(target.config.vocab_size)
    if pool is None:
        pool = NgramPool(ngram, guess_set, vocab)
    pool.check(ngram, guess_set, vocab)
    return pool


def _logits_rows(top: list[int], nodes: list[list[int]]) -> tuple[list[int], dict[int, int], list[list[int]]]:
    """The tree indices whose logits a round reads (0, x_t, first; the window's top level ``top``; every guess
    node), the row of each among them, and the guesses' ``nodes`` renumbered to those rows."""
    keep = sorted({0, *top, *(n for row in nodes for n in row)})
    row_of = {n: i for i, n in enumerate(keep)}
    return keep, row_of, [[row_of[n] for n in row] for row in nodes]


def _harvest(
    pool: NgramPool, jacobi: JacobiWindow, predictions: list[int], tokens: list[int], new: int, context_ngrams: bool
) -> None:
    """Add to ``pool`` the full window's n-grams (each column, the target's ``predictions`` appended) and, with
    ``context_ngrams``, the n-grams of ``tokens`` that end in its ``new`` last tokens (those just committed)."""
    if jacobi.full:
        for key, continuation in jacobi.ngrams(predictions):
            pool.add(key, continuation)
    if context_ngrams:
        pool.add_sequence(tokens, len(tokens) - new)
