"""Drafters that grow a token tree: every node of one depth fed in ONE batched draft forward under a tree mask.

The chain drafters (:mod:`~accept_head.models.drafters`, :mod:`~accept_head.models.feature_draft`) feed one candidate
per forward.
A tree round instead feeds a *batch* of nodes per forward, each hanging off a node fed earlier in the round (or off
the committed text). The drafter's KV cache holds the committed prefix (``P`` positions) followed by every node fed
this round, in feeding order ("slots"); a new node attends to the whole prefix, to its ancestors' slots and to
itself, and takes position id ``P + depth − 1`` — exactly what it would see in a chain holding only its own path, so
its logits and hidden state equal those of that chain.

The life of one generation::

    drafter.start(prompt, features)          # features: (L-1, d) target states (feature drafts only) or None
    every round:
        step = drafter.root()                # read the committed tokens not read yet: logits (1, V) at the root
                                             # (or (1, S) over step.support, a pruned draft's kept ids)
        step = drafter.expand(tokens, parents)   # n nodes (parents: slot indices, −1 = root): logits/hidden (n, ·)
        ...
        drafter.commit(tokens, features, slots)  # accepted tokens + the target's; the accepted nodes' slots

After verification both drafters keep exactly the accepted path: :class:`ModelTreeDrafter` moves the accepted slots'
keys and values next to the prefix (they were computed over the accepted path alone, so they equal a fresh prefill
of it); :class:`FeatureTreeDrafter` drops every slot (they were read with the draft's own predicted features) and
re-reads the accepted positions with the target's features from the verification pass, as the chain drafter does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..core.hf_compat import cache_kwargs, crop_cache, keep_cache_positions
from ..models.drafters import ModelDrafter, check_kept_ids
from ..models.feature_draft import FeatureDraft, FeatureDrafter
from ..models.features import capture_lm_head_input
from ..models.pairs import check_same_vocab
from .attention import FULL, AttentionLayout, attention_layout, layer_masks, tree_mask


@dataclass
class TreeStep:
    """One batched draft forward over ``n`` tree nodes (n = 1 for the root step)."""

    logits: torch.Tensor
    """(n, V) next-token logits after each node over the target's whole vocabulary (−inf outside a pruned one) — or,
    when ``support`` is given, (n, S) over those ids alone."""
    hidden: torch.Tensor
    """(n, d) the drafter's final hidden state at each node: the input of an acceptance head."""
    support: torch.Tensor | None = None
    """(S,) the ids ``logits`` covers, ascending (a pruned draft's kept vocabulary: q = 0 elsewhere), or None. In
    ascending order a row's argmax tie-break and cumulative sum are those of the whole vocabulary's row, so children
    are drawn as over the whole vocabulary, at a third of the cost for the embedded pair."""

    def over_vocabulary(self, vocab_size: int) -> TreeStep:
        """This step with ``logits`` over the whole vocabulary (−inf outside ``support``)."""
        if self.support is None:
            return self
        full = self.logits.new_full((self.logits.shape[0], vocab_size), float("-inf"))
        return TreeStep(full.index_copy_(1, self.support, self.logits), self.hidden)


def slot_attention(
    slot_parents: Sequence[int],
    new: int,
    prefix: int,
    dtype: torch.dtype,
    device: torch.device,
    layout: AttentionLayout = FULL,
) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """The attention mask and position ids of the last ``new`` slots of a round.

    ``slot_parents[s]``: the slot of node s's parent (−1: the node follows the prefix directly); parents precede
    children. Returns ``mask`` (1, 1, new, prefix + S) — 0 where a new slot may attend (every prefix position, its
    ancestors' slots, itself), the dtype's minimum elsewhere; for a draft with sliding-window layers (``layout``,
    :func:`~accept_head.trees.attention.attention_layout`) also outside the window, one mask per layer type where
    they differ — and ``positions`` (1, new) = prefix + depth − 1.
    """
    allowed, depths = tree_mask(slot_parents)
    total = len(slot_parents)
    positions = prefix + depths
    mask = layer_masks(layout, allowed[total - new :], positions, prefix, dtype, device)
    return mask, positions[total - new :][None].to(device)


class TreeDrafter:
    """Base class of tree drafters (see the module docstring)."""

    vocab_size: int
    hidden_size: int
    needs_target_features: bool = False
    context_limit: int | None = None

    def start(self, prompt: Sequence[int], features: torch.Tensor | None) -> None:
        raise NotImplementedError

    def root(self) -> TreeStep | None:
        """Read the committed tokens not read yet; the logits (1, V) after the last one (None: nothing to draft)."""
        raise NotImplementedError

    def expand(self, tokens: Sequence[int], parents: Sequence[int]) -> TreeStep:
        """Feed ``tokens`` (n,) as new nodes whose parents are the slots ``parents`` (−1: the root) in one forward.
        The new nodes take the next n slots, in order."""
        raise NotImplementedError

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None, slots: Sequence[int]) -> None:
        """Verification fixed ``tokens`` (the accepted nodes then the target's token); ``slots``: the slots of the
        accepted nodes that were fed (a prefix of the accepted path: a node is fed before its children exist)."""
        raise NotImplementedError


class ModelTreeDrafter(TreeDrafter):
    """A standalone Hugging Face causal LM as a tree drafter. ``kept_ids`` prunes its vocabulary (q = 0 elsewhere)."""

    def __init__(self, model: torch.nn.Module, kept_ids: torch.Tensor | None = None) -> None:
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.hidden_size = int(model.config.hidden_size)
        self.context_limit = getattr(model.config, "max_position_embeddings", None)
        self.layout = attention_layout(model, "draft")
        self.device = next(model.parameters()).device
        self.dtype = getattr(model, "dtype", torch.float32)
        self.kept_ids = None if kept_ids is None else check_kept_ids(kept_ids, self.vocab_size).to(self.device)
        self.cache = DynamicCache()
        self.committed: list[int] = []
        self.prefix = 0  # committed tokens held by the cache
        self.slot_parents: list[int] = []

    def start(self, prompt: Sequence[int], features: torch.Tensor | None) -> None:
        self.cache, self.committed, self.prefix, self.slot_parents = DynamicCache(), list(prompt), 0, []

    def _run(self, ids: list[int], **kwargs) -> TreeStep:
        with capture_lm_head_input(self.model) as box:
            x = torch.tensor([ids], device=self.device)
            out = self.model(input_ids=x, **cache_kwargs(self.model, self.cache), **kwargs)
        logits = out.logits[0]
        if self.kept_ids is not None:
            logits = torch.full_like(logits, float("-inf")).index_copy(1, self.kept_ids, logits[:, self.kept_ids])
        return TreeStep(logits, box[0][0, -logits.shape[0] :])

    def root(self) -> TreeStep:
        pending = self.committed[self.prefix :]
        self.prefix = len(self.committed)
        return self._run(pending, logits_to_keep=1)

    def expand(self, tokens: Sequence[int], parents: Sequence[int]) -> TreeStep:
        self.slot_parents.extend(parents)
        mask, positions = slot_attention(
            self.slot_parents, len(tokens), self.prefix, self.dtype, self.device, self.layout
        )
        return self._run(list(tokens), attention_mask=mask, position_ids=positions)

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None, slots: Sequence[int]) -> None:
        # The accepted slots attended to the prefix and their ancestors only: their keys/values are the path's own.
        keep_cache_positions(self.cache, self.prefix, [self.prefix + s for s in slots])
        self.prefix += len(slots)
        self.committed.extend(tokens)
        self.slot_parents = []


class FeatureTreeDrafter(TreeDrafter):
    """A :class:`~accept_head.models.feature_draft.FeatureDraft` as a tree drafter: node ``c`` with parent ``n`` is fed
    the
    pair (f̂_n, c) — the feature the draft predicted at its parent (at the root: at the last committed token) — and
    predicts f̂_c, which is both c's hidden state (the head's input) and the source of its children's logits."""

    needs_target_features = True

    def __init__(self, draft: FeatureDraft, target: torch.nn.Module) -> None:
        self.model = draft.bind(target)
        self.vocab_size = draft.config.vocab_size
        self.hidden_size = draft.config.hidden_size
        self.context_limit = draft.config.max_position_embeddings
        self.layout = attention_layout(draft.decoder, "draft")  # one Llama layer: full attention
        self.device = draft.kept_ids.device
        self.dtype = draft.decoder.norm.weight.dtype  # the draft's dtype (its linear layers may hold int8 weights)
        self.cache = DynamicCache()
        self.prefix = 0  # pairs in the cache read with the target's true features
        self.pending_features: torch.Tensor | None = None
        self.pending_tokens: list[int] = []
        self.slot_parents: list[int] = []
        self.predicted: list[torch.Tensor] = []  # f̂ per slot
        self.root_predicted: torch.Tensor | None = None
        self.lean = draft.lean_step()  # the root's call (built once: re-create the drafter after training the draft)

    def start(self, prompt: Sequence[int], features: torch.Tensor | None) -> None:
        if features is None or features.shape[0] != len(prompt) - 1:
            raise ValueError(
                f"FeatureTreeDrafter.start needs the target's features of prompt positions 0..{len(prompt) - 2}, "
                f"got {None if features is None else tuple(features.shape)}."
            )
        self.cache, self.prefix, self.slot_parents, self.predicted = DynamicCache(), 0, [], []
        self.pending_features, self.pending_tokens = features, list(prompt[1:])

    def _run(self, features: torch.Tensor, tokens: Sequence[int], mask, positions) -> TreeStep:
        ids = torch.tensor([list(tokens)], device=self.device)
        predicted = self.model(features[None].to(self.device), ids, self.cache, mask, positions, use_cache=True)[0]
        support, logits = self.model.support_logits(predicted)
        return TreeStep(logits, predicted, support)

    def root(self) -> TreeStep | None:
        if not self.pending_tokens:
            return None  # a one-token prompt: no target feature yet
        # The verified tokens fed at once; only the last one's f̂ and logits are read (FeatureDraft.extend).
        features = self.pending_features.to(self.device)
        start = self.cache.get_seq_length()
        self.root_predicted = self.model.extend(features, self.pending_tokens, self.cache, start, self.lean)
        self.prefix += len(self.pending_tokens)
        self.pending_features, self.pending_tokens = None, []
        support, logits = self.model.support_logits(self.root_predicted[None])
        return TreeStep(logits, self.root_predicted[None], support)

    def expand(self, tokens: Sequence[int], parents: Sequence[int]) -> TreeStep:
        self.slot_parents.extend(parents)
        features = torch.stack([self.root_predicted if p < 0 else self.predicted[p] for p in parents])
        mask, positions = slot_attention(
            self.slot_parents, len(tokens), self.prefix, self.dtype, self.device, self.layout
        )
        step = self._run(features, tokens, mask, positions)
        self.predicted.extend(step.hidden)
        return step

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None, slots: Sequence[int]) -> None:
        # Every slot was read with predicted features: drop them and re-read the accepted positions with the target's.
        crop_cache(self.cache, self.prefix)
        assert features is not None and features.shape[0] == len(tokens)
        if self.pending_tokens:  # the draft did not run this round: keep what it has not read yet
            features = torch.cat([self.pending_features.to(features), features])
            tokens = [*self.pending_tokens, *tokens]
        self.pending_features, self.pending_tokens = features, list(tokens)
        self.slot_parents, self.predicted = [], []


def as_tree_drafter(draft, target: torch.nn.Module) -> TreeDrafter:
    """A :class:`TreeDrafter` for ``draft``: tree drafters pass through, a :class:`FeatureDraft` (or a chain
    ``FeatureDrafter``) is bound to ``target``, a chain ``ModelDrafter`` or any other ``nn.Module`` is treated as a
    Hugging Face causal LM sharing the target's tokenizer (a ``ModelDrafter``'s pruned vocabulary is kept)."""
    if isinstance(draft, TreeDrafter):
        return draft
    if isinstance(draft, FeatureDraft | FeatureDrafter):
        return FeatureTreeDrafter(draft.model if isinstance(draft, FeatureDrafter) else draft, target)
    if isinstance(draft, ModelDrafter):
        check_same_vocab(target, draft.model)
        return ModelTreeDrafter(draft.model, draft.kept_ids)
    if isinstance(draft, torch.nn.Module):
        check_same_vocab(target, draft)
        return ModelTreeDrafter(draft)
    raise TypeError(
        f"Cannot draft a tree with a {type(draft).__name__}: pass an HF causal LM, a FeatureDraft or a TreeDrafter."
    )
