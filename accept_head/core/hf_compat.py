"""The one place that touches version-sensitive details of transformers' KV cache.

Everything else drives models through ``forward(**cache_kwargs(model, cache))``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch

CACHE_KWARGS = ("past_key_values", "cache")
"""The names a forward call or ``generate`` passes the KV cache under (``cache`` from transformers 5.24)."""


def _output_cache_field() -> str:
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


OUTPUT_CACHE_FIELD = _output_cache_field()
"""The field of ``generate``'s output that holds the KV cache (``cache`` from 5.24, ``past_key_values`` before): the
installed release's own name for the cache, read from it rather than guessed from its version."""


@functools.cache
def _cache_arg(forward_owner: type) -> str:
    """The keyword ``forward_owner.forward`` takes its KV cache under: ``cache`` where it names that parameter
    (transformers' models from 5.24, which deprecates ``past_key_values`` for removal in 5.40), ``past_key_values``
    where it names only that one (older releases, remote code), else (``**kwargs`` wrappers such as PEFT's) the
    installed release's default, :data:`OUTPUT_CACHE_FIELD`."""
    parameters = inspect.signature(forward_owner.forward).parameters
    if "cache" in parameters:
        return "cache"
    return "past_key_values" if "past_key_values" in parameters else OUTPUT_CACHE_FIELD


def cache_kwargs(model: torch.nn.Module, cache, use_cache: bool = True) -> dict:
    """Keyword arguments that hand ``model``'s forward its KV cache: ``model(input_ids=..., **cache_kwargs(model,
    cache))``, under the name this model's forward takes it (see :func:`_cache_arg`)."""
    return {_cache_arg(type(model)): cache, "use_cache": use_cache}


def passed_cache(kwargs: dict):
    """The KV cache in a forward call's or ``generate``'s keyword arguments, under either name; None if absent."""
    return next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)


def cache_length(cache) -> int:
    """Number of positions held by a ``DynamicCache`` (0 for None)."""
    return 0 if cache is None else cache.get_seq_length()


def crop_cache(cache, length: int) -> None:
    """Crop a ``DynamicCache`` in place to its first ``length`` positions (transformers 5 takes a negative count of
    positions to remove)."""
    current = cache.get_seq_length()
    if length > current:
        raise AssertionError(f"cannot crop a cache of {current} positions to {length}")
    if length == current:
        return
    cache.crop(length - current)


def has_uncroppable_sliding_layers(cache) -> bool:
    """Whether a layer of ``cache`` is a sliding-window layer (``is_sliding``) that ``crop`` cannot roll back
    (``is_croppable`` False: its window is shorter than the cache, so it rolls instead of keeping positions).
    transformers builds one for every layer its config marks sliding — ``config.layer_types``, or, without them,
    every layer when ``config.sliding_window`` is set (Mistral, Mixtral, Phi-3, Starcoder2). A version without
    ``is_croppable`` counts every sliding layer."""
    return any(
        getattr(layer, "is_sliding", False) and not getattr(layer, "is_croppable", False)
        for layer in getattr(cache, "layers", ())
    )


def keep_cache_positions(cache, keep: int, extra: Sequence[int]) -> None:
    """Keep the first ``keep`` positions of a ``DynamicCache`` followed by the positions ``extra``; drop the rest.

    In place. ``extra`` must be strictly increasing, each in [keep, cache length). After a tree-shaped verification
    pass (one sequence through the model with a custom 4D attention mask) the accepted branch's keys and values sit
    at scattered positions; this moves them next to the prefix, copying only ``len(extra)`` positions per layer (a
    plain crop when they already follow it). Layers must be full-attention ``DynamicLayer``s (5.x
    ``cache.layers[i].keys`` / ``.values``, (B, heads, S, head_dim)): a sliding-window layer holds no stable
    position index, so it is refused.
    """
    extra = [int(i) for i in extra]
    if not moved_positions(keep, extra, cache.get_seq_length()):
        crop_cache(cache, keep + len(extra))
        return
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None or any(not isinstance(x, DynamicLayer) or x.is_sliding for x in layers):
        raise NotImplementedError(
            "keep_cache_positions needs a DynamicCache of full-attention DynamicLayers (transformers >= 5); "
            f"got {type(cache).__name__} with layers {sorted({type(x).__name__ for x in layers or []})}."
        )
    move_positions([x for x in layers if x.is_initialized and x.keys.numel()], keep, extra)
    crop_cache(cache, keep + len(extra))


def moved_positions(keep: int, extra: Sequence[int], length: int) -> bool:
    """Whether keeping ``keep`` positions and then ``extra`` of a cache of ``length`` moves any (False: a plain crop);
    ValueError unless ``extra`` is strictly increasing, each in [keep, length)."""
    if any(b <= a for a, b in zip(extra, extra[1:])) or (extra and (extra[0] < keep or extra[-1] >= length)):
        raise ValueError(f"extra={list(extra)} must be strictly increasing positions in [{keep}, {length}).")
    return list(extra) != list(range(keep, keep + len(extra)))


def move_positions(layers: Sequence, keep: int, extra: Sequence[int]) -> None:
    """Copy the keys and values at positions ``extra`` of each cache layer (``.keys`` / ``.values``, (B, heads, S,
    head_dim)) to positions ``keep``, ``keep`` + 1, ... in place."""
    for layer in layers:
        index = torch.tensor(list(extra), device=layer.keys.device)
        # index_select materializes the source first, so the overlapping in-place write is safe.
        layer.keys[..., keep : keep + len(extra), :] = layer.keys.index_select(-2, index)
        layer.values[..., keep : keep + len(extra), :] = layer.values.index_select(-2, index)


GQA_EAGER = "accept_head_gqa_eager"
"""Name of an attention implementation registered with transformers' public ``AttentionInterface``."""


def _gqa_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention that groups query heads onto their key/value head instead of copying K/V (``repeat_kv``).

    query (B, H, Q, D), key/value (B, KV, S, D), additive or boolean mask (B, 1, Q, S). On CPU, batched decoding
    with left padding spends most of its time in ``repeat_kv`` copies and in SDPA's flash kernel for Q = 1; this
    computes the same attention with two batched matmuls. Returns (B, Q, H, D) like transformers' eager attention.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, s_len = key.shape[1], key.shape[2]
    rep = heads // kv_heads
    q = query.reshape(batch, kv_heads, rep * q_len, dim)  # head h = kv * rep + r, as repeat_kv orders them
    scores = torch.matmul(q, key.transpose(2, 3)).mul_(scaling).view(batch, kv_heads, rep, q_len, s_len)
    if attention_mask is not None:
        mask = attention_mask[:, :, None, :, :s_len]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights.view(batch, kv_heads, rep * q_len, s_len), value)
    out = out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous()
    return out, None


def register_gqa_eager() -> str:
    """Register the grouped eager attention (idempotent) and return its name for ``attn_implementation=``."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(GQA_EAGER, _gqa_eager_attention)
    AttentionMaskInterface.register(GQA_EAGER, eager_mask)
    return GQA_EAGER


def enclosing_generate_arguments(names: tuple[str, ...] = ("streamer", "assistant_model")) -> dict:
    """The values of ``names`` in the innermost ``GenerationMixin.generate`` call on the current stack ({} if none).

    transformers 5.x (checked on 5.23) hands a ``custom_generate`` callable only the keyword arguments named in its
    signature that are *not* parameters of ``GenerationMixin._sample``: ``streamer`` (a ``_sample`` parameter) and
    ``assistant_model`` (an explicit ``generate`` parameter) are dropped, although ``generate`` itself already fed the
    prompt to the streamer. The callable reads them back from ``generate``'s frame, found by identity of its code
    object (never by name), so a user's ``generate(..., streamer=...)`` reaches the decoding loop. Pinned by
    ``tests/test_hf_generate.py``, which fails if transformers changes either behaviour.
    """
    import sys

    from transformers.generation.utils import GenerationMixin

    code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = sys._getframe(1)
    try:
        while frame is not None:
            if frame.f_code is code:
                return {name: frame.f_locals.get(name) for name in names}
            frame = frame.f_back
        return {}
    finally:
        del frame  # no reference cycle through the frame
