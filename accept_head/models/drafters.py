"""Where candidate tokens come from: one small interface for every drafter.

A :class:`Drafter` proposes the next candidate's logits one token at a time and is told, after each verification,
which tokens became part of the output. Drafters that read the target (:class:`~accept_head.models.feature_draft.
FeatureDrafter`) also receive the target's final hidden states of those tokens' positions, taken from the same
verification pass — never an extra target pass. A plain Hugging Face causal LM is wrapped in a :class:`ModelDrafter`.

The life of one generation::

    drafter.start(prompt, features)        # features: (L-1, d) target states of prompt positions 0..L-2, or None
    every round:
        step = drafter.propose(None)       # read the committed tokens not read yet; logits of candidate 1
        step = drafter.propose(y_1)        # feed candidate 1; logits of candidate 2 and the hidden state of y_1
        ...
        drafter.commit(tokens, features)   # accepted candidates + the target's token; the states that predicted them

Row ``i`` of ``features`` is always the target's final hidden state (its LM head's input) at the position *before*
``tokens[i]``, i.e. the state from which the target predicted ``tokens[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from transformers import DynamicCache

from ..core.hf_compat import cache_kwargs, crop_cache
from .features import capture_lm_head_input
from .pairs import check_same_vocab


class DraftStep:
    """One drafting step: the next candidate's logits and the drafter's hidden state.

    A drafter with a pruned vocabulary may give its logits on that vocabulary only (``support``, ascending token
    ids, and ``support_logits``): the decoder then samples and computes the head's inputs over those few thousand
    entries, and :attr:`logits` over the whole vocabulary is built only when something reads it.
    """

    __slots__ = ("_logits", "hidden", "support", "support_logits", "vocab_size")

    def __init__(
        self,
        logits: torch.Tensor | None,
        hidden: torch.Tensor | None,
        *,
        support: torch.Tensor | None = None,
        support_logits: torch.Tensor | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if logits is None and (support is None or support_logits is None or vocab_size is None):
            raise ValueError("DraftStep needs logits, or support, support_logits and vocab_size.")
        self._logits = logits
        self.hidden = hidden
        """(d,) the drafter's final hidden state at the position whose input is the latest token fed — the input of
        an acceptance head (None for drafters that have none)."""
        self.support = support
        """(S,) ascending token ids outside which the logits are −inf, or None (every token may be drawn)."""
        self.support_logits = support_logits
        """(S,) the logits of ``support``'s tokens (finite), or None."""
        self.vocab_size = vocab_size if logits is None else logits.shape[-1]

    @property
    def logits(self) -> torch.Tensor:
        """(V,) next-token logits over the target's whole vocabulary; −inf outside a pruned vocabulary (q = 0)."""
        if self._logits is None:
            full = self.support_logits.new_full((self.vocab_size,), float("-inf"))
            self._logits = full.index_copy_(0, self.support, self.support_logits)
        return self._logits


class Drafter:
    """Base class of candidate sources. Subclasses implement :meth:`start`, :meth:`propose` and :meth:`commit`."""

    vocab_size: int
    """Size of the vocabulary its logits cover (the target's)."""
    hidden_size: int | None = None
    """Width of :attr:`DraftStep.hidden` (what an acceptance head for this drafter reads), None if it has none."""
    needs_target_features: bool = False
    """Whether :meth:`start` / :meth:`commit` need the target's final hidden states (the decoder captures them from
    the prefill and verification passes only for drafters that ask)."""
    context_limit: int | None = None
    """Longest sequence the drafter can read (None: unbounded)."""

    def start(self, prompt: Sequence[int], features: torch.Tensor | None) -> None:
        """Begin a generation. ``features``: (len(prompt) − 1, d) or None, see the module docstring."""
        raise NotImplementedError

    def propose(self, token: int | None) -> DraftStep | None:
        """Feed ``token`` (a new candidate; None at the start of a round) and return the next candidate's logits.

        Returns None when the drafter has nothing to propose this round (the round then submits no candidate).
        """
        raise NotImplementedError

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None) -> None:
        """Verification fixed ``tokens`` (this round's accepted candidates then the target's own token)."""
        raise NotImplementedError


class ModelDrafter(Drafter):
    """A standalone Hugging Face causal LM as the drafter (classic speculative decoding).

    ``kept_ids`` (optional, a 1-D LongTensor of token ids) prunes the draft's vocabulary: q = 0 outside it, which
    stays lossless because verification and the residual still cover every token (FR-Spec). When the model exposes
    a separate ``base_model`` the LM head is evaluated on the kept rows only, which is where the time saving is.
    """

    def __init__(self, model: torch.nn.Module, kept_ids: torch.Tensor | None = None, with_hidden: bool = True) -> None:
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.hidden_size = int(model.config.hidden_size)
        self.context_limit = getattr(model.config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.kept_ids = None if kept_ids is None else check_kept_ids(kept_ids, self.vocab_size).to(self.device)
        self._base = getattr(model, "base_model", model)
        self._pruned_head = self.kept_ids is not None and self._base is not model
        # The kept rows of the LM head, gathered once (a copy: re-create the drafter if the model is trained further).
        self._kept_weight = model.get_output_embeddings().weight[self.kept_ids].detach() if self._pruned_head else None
        self.with_hidden = with_hidden
        self.cache = DynamicCache()
        self.committed: list[int] = []
        self.consumed = 0
        self.fed: list[int] = []

    def start(self, prompt: Sequence[int], features: torch.Tensor | None) -> None:
        self.cache = DynamicCache()
        self.committed, self.consumed, self.fed = list(prompt), 0, []

    def _run(self, ids: list[int]) -> DraftStep:
        x = torch.tensor([ids], device=self.device)
        if self._pruned_head:
            hidden = self._base(input_ids=x, **cache_kwargs(self._base, self.cache)).last_hidden_state[0, -1]
            logits = torch.full((self.vocab_size,), float("-inf"), device=self.device, dtype=hidden.dtype)
            logits[self.kept_ids] = torch.nn.functional.linear(hidden, self._kept_weight)
            return DraftStep(logits, hidden)
        with capture_lm_head_input(self.model) if self.with_hidden else nullcontext([None]) as box:
            logits = self.model(input_ids=x, **cache_kwargs(self.model, self.cache), logits_to_keep=1).logits[0, -1]
        if self.kept_ids is not None:  # a model without a separate base: mask instead of slicing the head
            logits = torch.full_like(logits, float("-inf")).index_copy(0, self.kept_ids, logits[self.kept_ids])
        return DraftStep(logits, None if box[0] is None else box[0][0, -1])

    def propose(self, token: int | None) -> DraftStep:
        if token is None:
            pending = self.committed[self.consumed :]
            self.consumed = len(self.committed)
            return self._run(pending)
        self.fed.append(token)
        return self._run([token])

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None) -> None:
        # The cache holds the committed prefix plus the candidates fed this round; keep those that were accepted.
        # The last committed token is always left unread: the next round's first step must feed something.
        matched = 0
        while matched < min(len(self.fed), len(tokens) - 1) and self.fed[matched] == tokens[matched]:
            matched += 1
        self.consumed += matched
        crop_cache(self.cache, self.consumed)
        self.committed.extend(tokens)
        self.fed = []


def check_kept_ids(kept_ids: torch.Tensor | Sequence[int], vocab_size: int) -> torch.Tensor:
    """Validate a pruned vocabulary: distinct token ids in [0, vocab_size). Returns a LongTensor."""
    ids = torch.as_tensor(kept_ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise ValueError("kept_ids is empty: a pruned draft vocabulary needs at least one token.")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"kept_ids holds token id {hi if hi >= vocab_size else lo}, outside the tokenizer's vocabulary "
            f"[0, {vocab_size}); the vocabulary map was built for another tokenizer."
        )
    if ids.unique().numel() != ids.numel():
        raise ValueError("kept_ids holds duplicate token ids; pass each kept token once.")
    return ids


def as_drafter(draft, target: torch.nn.Module, with_hidden: bool = True) -> Drafter:
    """A :class:`Drafter` for ``draft``: drafters pass through, a draft model that brings its own drafter (one with a
    ``make_drafter(target)`` method, such as a :class:`~accept_head.models.feature_draft.FeatureDraft`) makes it bound
    to
    ``target``, any other ``nn.Module`` is treated as a Hugging Face causal LM sharing the target's tokenizer.

    The interface names no implementation: a draft model that needs more than :class:`ModelDrafter` says so itself."""
    if isinstance(draft, Drafter):
        return draft
    make_drafter = getattr(draft, "make_drafter", None)
    if callable(make_drafter):
        return make_drafter(target)
    if isinstance(draft, torch.nn.Module):
        check_same_vocab(target, draft)
        return ModelDrafter(draft, with_hidden=with_hidden)
    raise TypeError(f"Cannot draft with a {type(draft).__name__}: pass an HF causal LM, a FeatureDraft or a Drafter.")
