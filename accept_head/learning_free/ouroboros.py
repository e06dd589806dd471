"""Ouroboros (Zhao, Huang, Han et al., "Ouroboros: Generating Longer Drafts Phrase by Phrase for Faster Speculative
Decoding", EMNLP 2024): a draft model that drafts phrase by phrase from a pool the target's verification keeps filling.

Each round:

1. *Phrase-level drafting.* The draft model (a Hugging Face causal LM on its own KV cache) builds a sentence draft
   of at most ``gamma`` tokens. Before each draft forward the pool's phrases that start with the draft's last token
   are laid out as rows of one token tree (:mod:`~accept_head.trees.verify`); that single forward verifies them in
   parallel against the draft's own greedy choice and keeps the longest agreeing prefix plus the draft's next token.
   So one draft forward yields 1 + (accepted phrase tokens) tokens, and the sentence draft is exactly the draft
   model's greedy continuation, however good or bad the pool is.
2. *Lengthening.* Up to K − 1 pool phrases that start with the sentence draft's last token are appended to it, each
   a branch hanging off the draft's last node, so the K candidates share the draft's keys and values.
3. *Verification.* ONE target call over the tree [last committed token, sentence draft, branches] under the custom
   4D mask: the longest row matching the target's argmax wins (Fu et al. 2024, Alg. 3), or at temperature > 0
   multi-candidate sample verification (Alg. 4, :func:`~accept_head.trees.verify.verify_sampled`), which keeps the
   output distribution exactly the target's because every candidate is deterministic given the committed text.
4. *Candidate inspiration and refinement.* The target's own argmax at every node of every row is a continuation it
   produced for free. Along each row the text [last committed token, target argmax after it, target argmax after
   each row token] is cut into β-token windows and inserted into the pool (inspiration; beyond the first rejection
   these are the "discarded" verification tokens the paper recycles). A lengthening phrase whose first appended
   token the target rejected — observed only when the whole sentence draft was accepted — is removed (refinement);
   the target's own version of it, keyed by the same token, arrives through inspiration.

The pool (:class:`PhrasePool`) keeps at most W phrases of β tokens per start token, least recently used dropped
first; a phrase moves to the front when it is inserted again or helps a draft or a candidate. Warm start: pass the
same pool to later calls, or :meth:`PhrasePool.save` it (JSON with the vocabulary size and the tokenizer's
fingerprint) and :meth:`PhrasePool.load` it for another session.

Simplifications against the paper, all of which cost speed only, never exactness (the target verifies everything):

- The pool is keyed by a single start token (as Lookahead decoding's n-gram pool), and only the phrases starting
  with the draft's *last* token lengthen it (no retrieval on longer suffixes).
- Phrases come from the target's verification (inspiration), earlier generations (warm start) and, optionally, the
  prompt. Other phrase sources of the paper's implementation (such as n-grams the draft model mints itself) are not
  reproduced.
- Refinement is reduced to removing a lengthening phrase whose first appended token the target rejected (step 4).
- Drafting is always greedy. Sampling at temperature > 0 is an addition: the rows are verified by Alg. 4 sample
  verification, which is lossless for any candidates fixed before the target's draw.
- Batch size 1; a ``DynamicCache`` for both models (no static cache or CUDA graphs), each run through
  :func:`~accept_head.trees.verify.tree_forward` (the transformers API it relies on is described there).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from ..chain.decoding import GenerationResult, _check_int, _prepare, _timed, _until_eos, draft_room
from ..core.hf_compat import crop_cache, keep_cache_positions
from ..core.sampling import SamplingConfig, argmax, probabilities
from ..models.drafters import Drafter
from ..models.pairs import check_same_vocab
from ..trees.attention import AttentionLayout, attention_layout, check_masked_attention
from ..trees.verify import (
    TreeDecodeStats,
    add_rows,
    commit_nodes,
    prefill_root,
    tree_forward,
    verify_greedy,
    verify_sampled,
)

POOL_FORMAT = "accept_head.ouroboros.pool/1"

Phrase = tuple[int, ...]


def check_ouroboros_params(gamma: int, phrase_length: int, phrases_per_token: int, candidates: int) -> None:
    """gamma >= 1 draft tokens, β >= 2 (a start token and at least one token to append), W >= 1 phrases per start
    token, K in [1, W + 1] candidates (the sentence draft plus at most W phrases continuing it)."""
    _check_int("gamma", gamma, 1)
    _check_int("phrase_length (β)", phrase_length, 2)
    _check_int("phrases_per_token (W)", phrases_per_token, 1)
    high = phrases_per_token + 1
    if isinstance(candidates, bool) or not isinstance(candidates, int) or not 1 <= candidates <= high:
        raise ValueError(
            f"candidates (K)={candidates!r} must be an integer in [1, phrases_per_token + 1 = {high}]: the sentence "
            "draft plus at most W pool phrases continuing it."
        )


def vocab_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary (every token string and its id): pools built over token ids of one
    tokenizer are meaningless under another, even one of the same size."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


class PhrasePool:
    """The phrase candidate pool: for each start token, up to ``phrases_per_token`` (W) phrases of
    ``phrase_length`` (β) tokens whose first token is that start token, most recently used first.

    ``vocab_size``: the token-id range the phrases live in (the target's ``config.vocab_size``). ``fingerprint``:
    :func:`vocab_fingerprint` of the tokenizer, if known; a pool is refused by a model or tokenizer it does not fit.
    """

    def __init__(
        self, phrase_length: int, phrases_per_token: int, vocab_size: int, fingerprint: str | None = None
    ) -> None:
        _check_int("phrase_length (β)", phrase_length, 2)
        _check_int("phrases_per_token (W)", phrases_per_token, 1)
        _check_int("vocab_size", vocab_size, 1)
        self.phrase_length, self.phrases_per_token, self.vocab_size = phrase_length, phrases_per_token, vocab_size
        self.fingerprint = fingerprint
        self.table: dict[int, list[Phrase]] = {}

    def __len__(self) -> int:
        return sum(len(phrases) for phrases in self.table.values())

    def __contains__(self, phrase: Sequence[int]) -> bool:
        phrase = tuple(int(t) for t in phrase)
        return bool(phrase) and phrase in self.table.get(phrase[0], [])

    def get(self, token: int) -> list[Phrase]:
        """The phrases starting with ``token``, most recently used first (a copy)."""
        return list(self.table.get(int(token), []))

    def add(self, phrase: Sequence[int]) -> None:
        """Insert ``phrase`` (β tokens) at the front of its start token's list; a phrase already there moves to the
        front, and a full list drops its last (least recently used) phrase."""
        phrase = tuple(int(t) for t in phrase)
        if len(phrase) != self.phrase_length:
            raise ValueError(f"a phrase has {len(phrase)} tokens; this pool holds phrases of β={self.phrase_length}.")
        phrases = self.table.setdefault(phrase[0], [])
        if phrase in phrases:
            phrases.remove(phrase)
        elif len(phrases) == self.phrases_per_token:
            phrases.pop()
        phrases.insert(0, phrase)

    def touch(self, phrase: Sequence[int]) -> bool:
        """Move ``phrase`` to the front of its list (it was just used); False if it is not in the pool."""
        if phrase not in self:
            return False
        self.add(phrase)
        return True

    def remove(self, phrase: Sequence[int]) -> bool:
        """Drop ``phrase``; False if it is not in the pool."""
        phrase = tuple(int(t) for t in phrase)
        if phrase not in self:
            return False
        phrases = self.table[phrase[0]]
        phrases.remove(phrase)
        if not phrases:
            del self.table[phrase[0]]
        return True

    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Insert every β-token window of ``tokens``, left to right (the last window ends most recent)."""
        for start in range(len(tokens) - self.phrase_length + 1):
            self.add(tokens[start : start + self.phrase_length])

    def check(
        self,
        phrase_length: int,
        phrases_per_token: int,
        vocab_size: int,
        fingerprint: str | None = None,
        source: str = "the phrase pool",
    ) -> None:
        """Raise ValueError unless the pool holds β / W phrases over this vocabulary (size and, where both sides
        know it, tokenizer fingerprint)."""
        if (self.phrase_length, self.phrases_per_token) != (phrase_length, phrases_per_token):
            raise ValueError(
                f"{source} holds phrases of β={self.phrase_length}, W={self.phrases_per_token} per start token, but "
                f"phrase_length={phrase_length}, phrases_per_token={phrases_per_token} were asked for; pass a pool "
                "built with the same β and W."
            )
        if self.vocab_size != vocab_size:
            raise ValueError(
                f"{source} was built for a vocabulary of {self.vocab_size} tokens but the model's has {vocab_size}: "
                "it comes from another tokenizer; start from an empty PhrasePool."
            )
        if fingerprint is not None and self.fingerprint is not None and fingerprint != self.fingerprint:
            raise ValueError(
                f"{source} was built for a tokenizer with vocabulary fingerprint {self.fingerprint}, not this one "
                f"({fingerprint}): it comes from another tokenizer; start from an empty PhrasePool."
            )

    def save(self, path: str | Path) -> Path:
        """Write the pool as JSON (sorted keys, a format version; each start token's phrases most recent first)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "format": POOL_FORMAT,
            "phrase_length": self.phrase_length,
            "phrases_per_token": self.phrases_per_token,
            "vocab_size": self.vocab_size,
            "fingerprint": self.fingerprint,
            "phrases": {str(token): [list(p) for p in phrases] for token, phrases in self.table.items()},
        }
        path.write_text(json.dumps(data, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None, tokenizer=None) -> PhrasePool:
        """Read a pool written by :meth:`save`, the exact inverse. With ``vocab_size`` (the model's) and/or
        ``tokenizer``, refuse a pool built over another tokenizer."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no phrase pool at {path}; write one with PhrasePool.save(path).")
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != POOL_FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise ValueError(f"{path} is not an Ouroboros phrase pool (format {found!r}, expected {POOL_FORMAT!r}).")
        missing = [k for k in ("phrase_length", "phrases_per_token", "vocab_size", "phrases") if k not in data]
        if missing:
            raise ValueError(f"{path} lacks {missing}: it was not written by PhrasePool.save.")
        pool = cls(data["phrase_length"], data["phrases_per_token"], data["vocab_size"], data.get("fingerprint"))
        for key, phrases in data["phrases"].items():
            if len(phrases) > pool.phrases_per_token:
                raise ValueError(f"{path}: start token {key} holds {len(phrases)} phrases, more than W.")
            for phrase in reversed(phrases):  # oldest first, so the stored order is restored
                if phrase[:1] != [int(key)] or not all(0 <= t < pool.vocab_size for t in phrase):
                    raise ValueError(f"{path}: phrase {phrase} under start token {key} is malformed.")
                pool.add(phrase)
        if vocab_size is not None or tokenizer is not None:
            size = int(vocab_size) if vocab_size is not None else len(tokenizer)
            fingerprint = None if tokenizer is None else vocab_fingerprint(tokenizer)
            pool.check(pool.phrase_length, pool.phrases_per_token, size, fingerprint, source=str(path))
        return pool


class PhraseDraft:
    """A Hugging Face causal LM drafting greedily phrase by phrase on its own ``DynamicCache``.

    The cache always holds a prefix of the text being drafted from; the rest is fed at the next forward, so the
    text's last token is always fed again, as the root the pool's phrases hang off.
    """

    def __init__(self, model: torch.nn.Module, layout: AttentionLayout | None = None) -> None:
        self.model = model
        self.layout = layout if layout is not None else attention_layout(model, "draft")
        self.cache = DynamicCache()
        self.calls = 0
        """Draft forward passes (the prompt's prefill is part of the first)."""

    def step(self, context: Sequence[int], pool: PhrasePool, room: int) -> tuple[list[int], Phrase | None]:
        """One draft forward after ``context``: the pool's phrases for its last token (cut to ``room`` appended
        tokens) verified in parallel against the draft's greedy choice. Returns the new draft tokens — the longest
        agreeing phrase prefix then the draft's own next token — and the phrase they came from (None if none)."""
        prefix = self.cache.get_seq_length()
        pending = list(context[prefix:])
        assert pending, "the cache must lack at least the context's last token"
        phrases = lengthening_phrases(pool, pending, pool.phrases_per_token, room)
        rows = [phrase[1 : room + 1] for phrase in phrases]
        root = len(pending) - 1  # the pending text is a causal chain; the phrases hang off its last token
        tokens, parents = list(pending), list(range(-1, root))
        nodes = add_rows(tokens, parents, root, rows)
        logits = tree_forward(self.model, self.cache, tokens, parents, range(root, len(tokens)), self.layout)
        greedy = argmax(logits).tolist()  # greedy[0]: after the root
        row, m, next_token = verify_greedy(greedy, rows, [[n - root for n in row_nodes] for row_nodes in nodes])
        keep_cache_positions(self.cache, prefix + len(pending), [prefix + n for n in nodes[row][:m]] if m else [])
        self.calls += 1
        return [*rows[row][:m], next_token] if m else [next_token], phrases[row] if m else None

    def draft(self, committed: Sequence[int], pool: PhrasePool, gamma: int) -> list[int]:
        """The sentence draft after ``committed``: ``gamma`` tokens of the draft model's greedy continuation (fewer
        draft forwards when pool phrases agree with it). Phrases that contributed move to the front of the pool."""
        drafted: list[int] = []
        while len(drafted) < gamma:
            new, phrase = self.step([*committed, *drafted], pool, gamma - len(drafted) - 1)
            drafted += new
            if phrase is not None:
                pool.touch(phrase)
        return drafted

    def commit(self, committed_length: int, drafted: Sequence[int], new: Sequence[int]) -> None:
        """The target committed ``new`` after ``committed_length`` tokens: keep the cached draft tokens that agree
        with it, leaving the last committed token unread."""
        match = 0
        while match < min(len(drafted), len(new)) and drafted[match] == new[match]:
            match += 1
        keep = min(self.cache.get_seq_length(), committed_length + match, committed_length + len(new) - 1)
        crop_cache(self.cache, keep)


def lengthening_phrases(pool: PhrasePool, drafted: Sequence[int], count: int, room: int) -> list[Phrase]:
    """Up to ``count`` pool phrases that start with the draft's last token and would append distinct token runs
    when cut to ``room`` tokens, most recently used first."""
    if not drafted or count < 1 or room < 1:
        return []
    chosen: dict[Phrase, Phrase] = {}
    for phrase in pool.get(drafted[-1]):
        chosen.setdefault(phrase[1 : room + 1], phrase)
        if len(chosen) == count:
            break
    return list(chosen.values())


def candidate_tree(
    root: int, drafted: Sequence[int], extensions: Sequence[Sequence[int]]
) -> tuple[list[int], list[int], list[list[int]], list[list[int]]]:
    """The verification tree: ``root`` (the last committed token, index 0), the sentence draft as a chain off it,
    and each extension as a branch off the draft's last token. Returns (tokens, parents, rows, nodes): row 0 is the
    draft, row r ≥ 1 the draft followed by ``extensions[r − 1]``; ``nodes[r][j]`` is the tree index of
    ``rows[r][j]``. No draft, no rows."""
    tokens, parents = [int(root)], [-1]
    if not drafted:
        return tokens, parents, [], []
    (draft_nodes,) = add_rows(tokens, parents, 0, [drafted])
    branch_nodes = add_rows(tokens, parents, draft_nodes[-1], extensions)
    rows = [list(drafted)] + [[*drafted, *extension] for extension in extensions]
    nodes = [draft_nodes] + [draft_nodes + branch for branch in branch_nodes]
    return tokens, parents, rows, nodes


def inspiration_phrases(
    root: int, argmax: Sequence[int], nodes: Sequence[Sequence[int]], phrase_length: int, winner: int = -1
) -> list[Phrase]:
    """Phrases from one verification pass: along each row the text [root, the target's argmax after the root, the
    target's argmax after each row token], cut into every ``phrase_length``-token window. Distinct phrases in
    insertion order, the rows in order with the ``winner`` row last (its phrases become the most recent)."""
    order = [r for r in range(len(nodes)) if r != winner] + ([winner] if 0 <= winner < len(nodes) else [])
    phrases: dict[Phrase, None] = {}
    for r in order:
        text = [int(root), int(argmax[0]), *(int(argmax[n]) for n in nodes[r])]
        for start in range(len(text) - phrase_length + 1):
            phrase = tuple(text[start : start + phrase_length])
            phrases.pop(phrase, None)  # seen again: move it to the end (most recent)
            phrases[phrase] = None
    return list(phrases)


def refine_pool(pool: PhrasePool, draft_length: int, extensions: Sequence[Phrase], verified: Sequence[int]) -> None:
    """Candidate refinement after verifying the draft of ``draft_length`` tokens lengthened by ``extensions``.

    ``verified``: the accepted tokens then the target's own next token. If the whole draft was accepted, the target
    ruled on each extension's first appended token (``verified[draft_length]``): a phrase it rejected is removed from
    the pool, one it accepted moves to the front. Otherwise the extensions were never reached and are left alone.
    """
    if len(verified) <= draft_length:
        return
    chosen = int(verified[draft_length])
    for phrase in extensions:
        if phrase[1] == chosen:
            pool.touch(phrase)
        else:
            pool.remove(phrase)


@dataclass
class OuroborosStats(TreeDecodeStats):
    """:class:`~accept_head.trees.verify.TreeDecodeStats` of Ouroboros; ``draft_calls`` counts the draft model's
    forward passes (its prompt prefill included), ``rows`` the K candidates of each call."""

    drafted: list[int] = field(default_factory=list)
    """Sentence-draft tokens the draft model produced in each round (before lengthening with pool phrases)."""


@torch.inference_mode()
def ouroboros_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    *,
    gamma: int = 8,
    phrase_length: int = 4,
    phrases_per_token: int = 5,
    candidates: int = 4,
    pool: PhrasePool | None = None,
    prompt_phrases: bool = False,
) -> GenerationResult:
    """Lossless Ouroboros decoding (see the module docstring): a sentence draft of up to ``gamma`` tokens drafted
    phrase by phrase, lengthened into ``candidates`` (K) rows with pool phrases of ``phrase_length`` (β) tokens, at
    most ``phrases_per_token`` (W) per start token, all verified in one target call.

    ``draft``: a Hugging Face causal LM sharing the target's tokenizer. ``pool``: a :class:`PhrasePool` to warm-start
    from and keep filling (a fresh one if None). ``prompt_phrases``: also insert the prompt's β-token windows.
    Returns the sequences and :class:`OuroborosStats` (``proposed`` / ``accepted``: the winning row).
    Here a pool is checked for β, W and the vocabulary size; its tokenizer fingerprint is checked when it is read,
    by ``PhrasePool.load(path, tokenizer=...)``.
    """
    check_ouroboros_params(gamma, phrase_length, phrases_per_token, candidates)
    sampling = SamplingConfig(temperature, top_k, top_p)
    pool = _checked_pair_and_pool(target, draft, pool, phrase_length, phrases_per_token)
    layout = check_masked_attention(target)
    draft_layout = check_masked_attention(draft, "draft")
    ids, budget, eos = _prepare(input_ids, max_new_tokens, eos_token_id, target)
    stats = OuroborosStats()
    with _timed(stats, "total_time"):
        tokens = ids[0].tolist()
        if prompt_phrases:
            pool.add_sequence(tokens)
        drafter = PhraseDraft(draft, draft_layout)
        with _timed(stats, "target_time"):
            cache = prefill_root(target, ids)  # lacks the last token: the next round's root
        while stats.generated < budget:
            # 1. Draft phrase by phrase, then lengthen with pool phrases (no row may outrun the budget: the target
            #    always adds a token of its own).
            room = budget - stats.generated - 1
            with _timed(stats, "draft_time"):
                gamma_now = min(gamma, room, draft_room(draft, len(tokens)))  # never past the draft's context
                drafted = drafter.draft(tokens, pool, gamma_now) if gamma_now > 0 else []
                extensions = lengthening_phrases(pool, drafted, candidates - 1, room - len(drafted))
                appended = [p[1 : room - len(drafted) + 1] for p in extensions]
                tree, parents, rows, nodes = candidate_tree(tokens[-1], drafted, appended)
            # 2. One target call verifies every candidate.
            with _timed(stats, "target_time"):
                logits = tree_forward(target, cache, tree, parents, layout=layout)
                greedy = argmax(logits).tolist()
                if sampling.greedy:
                    row, m, next_token = verify_greedy(greedy, rows, nodes)
                else:
                    row, m, next_token = verify_sampled(probabilities(logits, sampling), rows, nodes, generator)
                commit_nodes(cache, len(tokens) - 1, nodes[row][:m] if m else [])
            # 3. Commit the winning row's accepted tokens and the target's own (up to an EOS).
            verified = [*rows[row][:m], next_token] if m else [next_token]
            new = _until_eos(verified, eos)
            stats.record_tree_round(len(tree), len(rows), len(rows[row]) if row >= 0 else 0, m, len(new))
            stats.drafted.append(len(drafted))
            drafter.commit(len(tokens), drafted, new)
            tokens.extend(new)
            # 4. Refinement, then inspiration: the target's own continuations become phrases.
            with _timed(stats, "draft_time"):
                refine_pool(pool, len(drafted), extensions, verified)
                for phrase in inspiration_phrases(tree[0], greedy, nodes, phrase_length, row):
                    pool.add(phrase)
            if new[-1] in eos:
                break
    stats.draft_calls = drafter.calls
    return GenerationResult(torch.tensor([tokens], dtype=torch.long), stats)


def _checked_pair_and_pool(
    target: torch.nn.Module, draft, pool: PhrasePool | None, phrase_length: int, phrases_per_token: int
) -> PhrasePool:
    """Check that ``draft`` is a Hugging Face causal LM sharing the target's vocabulary; return ``pool`` checked for
    β, W and that vocabulary (a fresh pool if None)."""
    if isinstance(draft, Drafter) or not isinstance(draft, torch.nn.Module) or not hasattr(draft, "config"):
        raise TypeError(
            f"Ouroboros drafts with a Hugging Face causal LM (it verifies phrases in the draft's own forward pass); "
            f"got a {type(draft).__name__}."
        )
    check_same_vocab(target, draft)
    vocab = int(target.config.vocab_size)
    if pool is None:
        pool = PhrasePool(phrase_length, phrases_per_token, vocab)
    pool.check(phrase_length, phrases_per_token, vocab)
    return pool
