"""The attention masks a token tree needs, layer by layer, and the one check that a model can take them.

A tree pass (:func:`~accept_head.trees.verify.tree_forward`, the tree drafters' batched draft forwards) hands the model
a ready-made 4D mask, and transformers uses a 4D mask as it is ("already prepared 4D mask ... returned as-is",
``masking_utils._preprocess_mask_arguments``, 5.24): whatever the model would have added to it itself — a sliding
window, a per-layer choice of window — must already be in it. This module builds it as transformers builds the
masks of a plain forward (``masking_utils.create_masks_for_generate``):

* the layer types are ``config.layer_types`` when the config has them (Gemma-2/3, Qwen2, Cohere2, GPT-OSS, ...),
  else every layer is sliding if ``config.sliding_window`` is set (Mistral, Phi-3), else full attention (Llama);
* a ``sliding_attention`` layer with window w lets a query at position i see keys at positions j > i − w (and
  j ≤ i): ``sliding_window_overlay``'s ``kv_idx > q_idx - sliding_window``. transformers counts in cache indices,
  which are positions in a chain; in a tree they are not (siblings sit side by side), so the window is applied to
  ``position_ids`` — what a chain holding only the node's own path would see, whatever the tree around it;
* a model whose layers mix types reads one mask per type from a dict keyed by the type (its forward's
  ``causal_mask_mapping``); a model that needs a single mask gets one tensor, as today.

Full-attention models (Llama, Qwen2 without ``use_sliding_window``) take exactly the mask they always took.

Position schemes a tree mask cannot express are refused up front by :func:`check_masked_attention`, the one check
every mask-based decoder calls: ALiBi (MPT, Bloom, Falcon with ``alibi``), whose bias transformers computes from a
key's index in the flattened input rather than from ``position_ids``; models whose forward takes no
``position_ids``; layer types other than full and sliding attention (chunked, linear/recurrent layers).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.hf_compat import GQA_EAGER

MASKED_ATTENTION = ("eager", "sdpa", GQA_EAGER)
"""Attention implementations that apply an arbitrary additive 4D mask (flash-attention kernels take none; flex
attention needs a ``BlockMask``)."""

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
"""The layer types (``config.layer_types`` entries) a tree mask can express."""

MASK_DECODERS = (
    "Draft trees (tree_generate, SpecDecPP.generate(tree=True), generate(custom_generate=...) with a tree rule), "
    "Lookahead, N-Grammys and Ouroboros"
)
"""The decoders that verify under a custom mask, as the refusals name them."""
CHAIN_DECODERS = "speculative_generate, or SpecDecPP.generate without tree=True"
"""The decoders that take any causal LM, as the refusals name them."""


@dataclass(frozen=True)
class AttentionLayout:
    """Which mask each layer of a model needs under a token tree (see the module docstring)."""

    windows: tuple[tuple[str, int | None], ...] = ((FULL_ATTENTION, None),)
    """(layer type, sliding window in positions, or None for full causal attention) per distinct layer type."""

    @property
    def full(self) -> bool:
        """Every layer attends to the whole prefix: the mask is the tree pattern alone."""
        return all(window is None for _, window in self.windows)


FULL = AttentionLayout()
"""The layout of a model whose every layer has full causal attention (Llama)."""


def _uses_alibi(config) -> bool:
    """ALiBi as transformers' configs spell it: Bloom (always), MPT (``attn_config.alibi``), Falcon (``alibi``),
    remote-code Jais-style ``position_embedding_type='alibi'``."""
    if getattr(config, "model_type", None) == "bloom" or getattr(config, "alibi", False) is True:
        return True
    attn_config = getattr(config, "attn_config", None)
    if getattr(attn_config, "alibi", False) is True or (isinstance(attn_config, dict) and attn_config.get("alibi")):
        return True
    return getattr(config, "position_embedding_type", None) == "alibi"


@functools.cache
def _takes_position_ids(model_class: type) -> bool:
    """Whether ``model_class.forward`` names a ``position_ids`` parameter (a ``**kwargs`` catch-all does not count:
    Bloom and MPT take one and never read position ids from it)."""
    return "position_ids" in inspect.signature(model_class.forward).parameters


def attention_layout(model: torch.nn.Module, role: str = "target") -> AttentionLayout:
    """The :class:`AttentionLayout` of ``model`` (a Hugging Face causal LM, or a module with a ``config``), read as
    transformers reads it (module docstring). ``role`` names the model in errors (``target`` / ``draft``).

    Raises ValueError, naming the model type and the decoders that still work on it, for what a tree mask cannot
    express: ALiBi, a forward without ``position_ids``, a layer type other than full or sliding attention, a sliding
    layer without a window.
    """
    config = getattr(model, "config", None)
    if config is None:
        return FULL
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    named = f"The {role} {type(model).__name__} (model_type {getattr(config, 'model_type', None)!r})"
    refused = f"{MASK_DECODERS} cannot take it as their {role}; decode with the chain instead: {CHAIN_DECODERS}."
    if _uses_alibi(config):
        raise ValueError(
            f"{named} uses ALiBi attention biases, which transformers computes from each key's index in the input "
            "rather than from position_ids, so the nodes of a token tree would get the biases of their places in "
            f"the flattened tree. {refused}"
        )
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(inner, torch.nn.Module) and not _takes_position_ids(type(inner)):
        raise ValueError(
            f"{named} takes no position_ids, so the nodes of a token tree would get the positions of their places "
            f"in the flattened tree. {refused}"
        )
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        if getattr(config, "attention_chunk_size", None) is not None:
            layer_types = ["chunked_attention"]
        else:
            return FULL if window is None else AttentionLayout(((SLIDING_ATTENTION, int(window)),))
    kinds = tuple(dict.fromkeys(layer_types))
    unknown = [t for t in kinds if t not in (FULL_ATTENTION, SLIDING_ATTENTION)]
    if unknown:
        raise ValueError(
            f"{named} has {unknown} layers, and a tree mask expresses only {FULL_ATTENTION} and "
            f"{SLIDING_ATTENTION} layers. {refused}"
        )
    if SLIDING_ATTENTION in kinds and window is None:
        raise ValueError(
            f"{named} has {SLIDING_ATTENTION} layers but config.sliding_window is None; set the window the model "
            "was trained with."
        )
    layout = AttentionLayout(tuple((t, int(window) if t == SLIDING_ATTENTION else None) for t in kinds))
    return FULL if layout.full else layout


def check_masked_attention(model: torch.nn.Module, role: str = "target") -> AttentionLayout:
    """The check every mask-based decoder makes before it starts: raise ValueError unless ``model`` applies custom 4D
    attention masks (:data:`MASKED_ATTENTION`) and its position scheme is one a tree mask expresses
    (:func:`attention_layout`, whose layout it returns)."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation not in MASKED_ATTENTION:
        raise ValueError(
            f"{type(model).__name__} uses attn_implementation={implementation!r}, which cannot take the custom 4D "
            f"attention mask of tree verification; load it with attn_implementation in {MASKED_ATTENTION}."
        )
    return attention_layout(model, role)


def tree_mask(parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention pattern of a token tree: ``mask`` (T, T) bool, True where token i may attend to token j (j is
    i or an ancestor of i), and ``depths`` (T,) long (0 for tokens whose parent is −1). Parents precede children."""
    size = len(parents)
    mask = torch.zeros(size, size, dtype=torch.bool)
    depths = torch.zeros(size, dtype=torch.long)
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}]={parent}: a parent must be -1 or an earlier token.")
        if parent >= 0:
            mask[i] = mask[parent]
            depths[i] = depths[parent] + 1
        mask[i, i] = True
    return mask, depths


def layer_masks(
    layout: AttentionLayout,
    allowed: torch.Tensor,
    positions: torch.Tensor,
    prefix: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` argument of a forward that feeds tree tokens on top of a cache of ``prefix`` positions.

    ``allowed`` (Q, S) bool: query q (the last Q of the S new tokens) may attend to new token s (its ancestors and
    itself); ``positions`` (S,) long: the new tokens' position ids. The cache's positions are 0..prefix − 1 (the
    committed text, each key at its own position). Returns additive masks (1, 1, Q, prefix + S), 0 where a query
    attends and the dtype's minimum elsewhere: one tensor when every layer needs the same mask (full attention: the
    tree pattern with the whole prefix visible, exactly as before sliding windows were handled), else a dict keyed
    by layer type, where a sliding layer with window w also hides keys at positions ≤ (the query's position) − w.
    """
    queries, total = allowed.shape
    minimum = torch.finfo(dtype).min
    mask = torch.zeros(1, 1, queries, prefix + total, dtype=dtype, device=device)
    mask[0, 0, :, prefix:] = torch.where(allowed, 0.0, minimum).to(device, dtype)
    if layout.full:
        return mask
    positions = positions.to(device)
    keys = torch.cat([torch.arange(prefix, device=device), positions])
    masks = {}
    for layer_type, window in layout.windows:
        outside = keys[None, :] <= positions[total - queries :, None] - window if window is not None else None
        masks[layer_type] = mask if outside is None else mask.masked_fill(outside[None, None], minimum)
    return masks if len(masks) > 1 else next(iter(masks.values()))
