"""The target's cached forward over a preallocated KV cache, optionally compiled (``torch.compile``, inductor).

Eager decoding with a ``DynamicCache`` grows every layer's keys and values by concatenation and runs the model's
Python per layer and per token; on a CPU that overhead, not arithmetic, is most of a small model's forward (issue 37:
~40 ms a token for 135M parameters whose weights stream in ~10 ms). A :class:`StaticTarget` keeps one
``transformers.StaticCache`` of fixed length, writes each pass's keys and values in place at their positions, and
can hand the decoder to ``torch.compile`` — whose graphs need exactly that: fixed shapes.

Shapes. A pass of T tokens is padded to the smallest of :data:`WIDTHS` that holds it (T = 1 for autoregressive
decoding, K + 1 for a verification pass), so a compiled decoder sees a handful of shapes, each compiled once per
process; longer passes (the prompt) run eagerly through the same cache. Padding is exact: the pad tokens sit *after*
the real ones, which never attend to them (causal mask), and their keys and values, written past the kept length, are
overwritten before any later query can see them — every pass writes from the kept length on.

Compiled, a pass runs the decoder and the LM head as one graph through
:func:`~accept_head.models.row_linear.backend`: in a one-token pass its bf16 linears become a multiply and a float32
sum (faster than oneDNN's matrix-vector product on the CPUs measured), in wider passes they run on oneDNN-packed
copies of the weights (one copy, shared by every compiled width: memory for the weights once more), the rest is
inductor's. The compiled graphs check before every call that no weight changed in place since.

Rolling back a rejected speculation is :meth:`StaticTarget.crop`: only the kept length moves (``StaticCache`` writes
each pass at its running length, which ``crop`` moves back). Targets with sliding-window layers are refused (their
static layers roll a window instead of keeping positions), whether ``config.layer_types`` names them or
``config.sliding_window`` alone makes them (Mistral, Phi-3: transformers' ``StaticCache`` then builds sliding layers
too; those are kept when the window is at least the cache's length, since such a layer never slides: Phi-3-mini's
2047 for requests of up to 1,792 positions). So are targets whose logits are not the LM head over the decoder's
output (a scale or soft-capping after the head: Cohere, Granite, Gemma-2/3), since a pass here applies the head
itself, and models whose attention does not run over a ``StaticCache`` at all (Falcon with ALiBi): their first pass
fails, and the error says so.

A token tree (a chain with rows copied from the text beside it, :mod:`~accept_head.trees.chain_copies`) runs through
:meth:`StaticTarget.tree_forward`: the same padded, optionally compiled pass with an additive 4D mask over the whole
cache (each token sees the kept positions, its ancestors and itself) and rotary positions by depth;
:meth:`StaticTarget.keep` then moves the accepted branch's keys and values next to the prefix.
"""

from __future__ import annotations

import bisect

import torch
from transformers import DynamicCache, StaticCache

from ..core.hf_compat import cache_kwargs, has_uncroppable_sliding_layers, move_positions, moved_positions
from .features import logits_from_decoder
from .row_linear import backend

WIDTHS = (1, 2, 4, 8, 16)
"""Pass widths a static target pads to (each compiled on first use when compiled)."""


def padded_width(width: int) -> int:
    """The width a pass of ``width`` tokens runs at: the smallest of :data:`WIDTHS` that holds it, else ``width``."""
    return WIDTHS[bisect.bisect_left(WIDTHS, width)] if width <= WIDTHS[-1] else width


LENGTH_STEP = 256
"""Cache lengths are multiples of this, so requests of similar length share compiled graphs. Every pass attends over
the whole preallocated cache (masked past the kept length): on the EPYC a one-token pass spent 7 ms of its 32 ms in
attention over 1,040 positions, so the buckets are kept short."""


def capacity(max_length: int) -> int:
    """The cache length a :class:`StaticTarget` of ``max_length`` positions keeps: the next multiple of
    :data:`LENGTH_STEP`."""
    return -(-max_length // LENGTH_STEP) * LENGTH_STEP


def _decoder_pass(decoder: torch.nn.Module, cache: dict, ids: torch.Tensor, positions: torch.Tensor):
    """The decoder's final hidden states (1, T, d) for ``ids`` (1, T) at cache ``positions`` (T,); ``cache``: the
    keyword arguments that hand it its ``StaticCache`` (:func:`~accept_head.core.hf_compat.cache_kwargs`)."""
    out = decoder(input_ids=ids, **cache, cache_position=positions, position_ids=positions[None])
    return out.last_hidden_state


def _logits_pass(decoder: torch.nn.Module, head: torch.nn.Module, cache: dict, ids: torch.Tensor, positions):
    """:func:`_decoder_pass`, then the LM head on every position: (logits (T, V), final hidden states (T, d))."""
    hidden = _decoder_pass(decoder, cache, ids, positions)[0]
    return head(hidden), hidden


def _tree_logits_pass(decoder, head, cache: dict, ids: torch.Tensor, slots: torch.Tensor, rope, mask: torch.Tensor):
    """:func:`_logits_pass` for a token tree: the tokens write their keys and values at cache ``slots`` (T,), rotate
    at positions ``rope`` (T,) (the prefix length plus their depth) and attend by the additive ``mask`` (1, 1, T,
    cache length)."""
    out = decoder(input_ids=ids, **cache, cache_position=slots, position_ids=rope[None], attention_mask=mask)
    hidden = out.last_hidden_state[0]
    return head(hidden), hidden


INDUCTOR_OPTIONS: dict = {"cpp_wrapper": True}
"""Inductor options of the compiled pass (``torch.compile(options=...)``). ``cpp_wrapper`` calls the generated
kernels from C++ instead of Python: on the EPYC of docs/measurements.md compiled autoregressive decoding ran 1.29× and
1.33× eager with it, 1.17× and 1.21× without (two runs each); ``freezing`` (oneDNN-prepacked weights) changed
nothing."""
_compiled_passes: dict = {}


def compiled_logits_pass(tree: bool = False):
    """:func:`_logits_pass` (``tree``: :func:`_tree_logits_pass`) under ``torch.compile`` (static shapes;
    :func:`~accept_head.models.row_linear.backend` with :data:`INDUCTOR_OPTIONS`), built once per process."""
    if tree not in _compiled_passes:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        function = _tree_logits_pass if tree else _logits_pass
        _compiled_passes[tree] = torch.compile(function, dynamic=False, backend=backend(INDUCTOR_OPTIONS))
    return _compiled_passes[tree]


class StaticTarget:
    """A causal LM's cached forward over a preallocated KV cache of ``max_length`` positions (rounded up to
    :data:`LENGTH_STEP`, plus room for padding), compiled when ``compile``.

    Use it where a decoder holds a ``DynamicCache`` (the chain decoders take ``target_runtime="static"`` or
    ``"compiled"``): :meth:`forward` runs new tokens after the kept ones and returns their logits and final hidden
    states; :meth:`crop` keeps a prefix. The model must expose ``get_decoder()`` whose ``last_hidden_state`` is the
    LM head's input (Llama, Qwen2, Mistral, Gemma, SmolLM2, ...) and take a ``StaticCache``.
    """

    def __init__(self, model: torch.nn.Module, max_length: int, compile: bool = False) -> None:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        if decoder is None or decoder is model or model.get_output_embeddings() is None:
            raise ValueError(
                f"{type(model).__name__} exposes no separate decoder and LM head (get_decoder(), "
                "get_output_embeddings()): decode it with target_runtime='eager'."
            )
        sliding = (
            f"{type(model).__name__} has sliding-window layers, which a StaticTarget does not roll back: decode it "
            "with target_runtime='eager'."
        )
        if "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
            raise ValueError(sliding)
        if max_length < 1:
            raise ValueError(f"max_length={max_length} must be >= 1 (the prompt plus the new tokens).")
        if not logits_from_decoder(model):
            raise ValueError(
                f"{type(model).__name__}'s logits are not its LM head applied to its decoder's output (a scale or "
                "soft-capping after the head, e.g. Cohere's logit_scale or Gemma-2's final_logit_softcapping), and a "
                "StaticTarget applies the head itself: decode it with target_runtime='eager'."
            )
        self.model, self.decoder, self.head = model, decoder, model.get_output_embeddings()
        self.compiled = compile
        self.capacity = capacity(max_length)
        parameter = next(model.parameters())
        self.slots = self.capacity + WIDTHS[-1]  # room for the padding of a pass that ends at the capacity
        self.cache = StaticCache(config=model.config, max_cache_len=self.slots)
        if has_uncroppable_sliding_layers(self.cache):  # sliding_window without layer_types (Mistral, Phi-3, ...)
            raise ValueError(  # (a window as long as the cache never slides: it keeps positions, and is kept)
                f"{type(model).__name__} has sliding-window layers (sliding_window={model.config.sliding_window}) "
                f"shorter than this StaticTarget's {self.slots} positions, which a StaticTarget does not roll back: "
                "decode it with target_runtime='eager'."
            )
        self._cache_kwargs = cache_kwargs(decoder, self.cache)
        # Allocate the buffers at the shapes the model's attention writes (not the config's), with a pass of two
        # tokens: a model whose attention cannot run over a StaticCache fails here, not in the middle of a decode.
        two = torch.zeros(1, 2, dtype=torch.long, device=parameter.device)
        try:
            with torch.no_grad():
                _decoder_pass(decoder, self._cache_kwargs, two, torch.arange(2, device=parameter.device))
        except (RuntimeError, IndexError) as error:
            raise ValueError(
                f"{type(model).__name__} cannot run over a preallocated StaticCache ({type(error).__name__}: "
                f"{error}): decode it with target_runtime='eager'."
            ) from error
        self.cache.crop(-2)
        self.length = 0
        self._compiled = compiled_logits_pass() if compile else None
        self._compiled_tree = compiled_logits_pass(tree=True) if compile else None

    def reset(self) -> None:
        """Forget every kept position (the buffers stay allocated; the next pass overwrites them)."""
        self.crop(0)

    def forward(self, ids: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``ids`` (1, T) after the kept positions. Returns (logits (T, V), or (1, V) if ``last_only``; the final
        hidden states (T, d)); the T positions are kept."""
        width = ids.shape[1]
        if self.length + width > self.capacity:
            raise ValueError(
                f"a pass of {width} tokens after {self.length} kept positions exceeds this StaticTarget's "
                f"{self.capacity} positions: build it with a larger max_length."
            )
        padded = padded_width(width)
        if padded > width:
            ids = torch.cat([ids, ids[:, -1:].expand(1, padded - width)], dim=1)
        positions = torch.arange(self.length, self.length + padded, device=ids.device)
        if self._compiled is not None and padded <= WIDTHS[-1]:
            logits, hidden = self._compiled(self.decoder, self.head, self._cache_kwargs, ids, positions)
            logits, hidden = logits[:width], hidden[:width]
        else:  # eager, or the prompt: any length
            hidden = _decoder_pass(self.decoder, self._cache_kwargs, ids, positions)[0, :width]
            logits = None
        if padded > width:
            self.cache.crop(width - padded)  # the pads' keys and values are overwritten by the next pass
        self.length += width
        if logits is None:
            return self.head(hidden[-1:] if last_only else hidden), hidden
        return (logits[-1:] if last_only else logits), hidden

    def tree_forward(self, ids: torch.Tensor, allowed: torch.Tensor, depths: torch.Tensor):
        """Run a token tree ``ids`` (1, T) after the kept positions: token i attends to the kept positions and to the
        tree tokens ``allowed[i]`` marks (T, T bool: its ancestors and itself), at position (kept length + its depth
        ``depths[i]``). Returns (logits (T, V), final hidden states (T, d)); the T positions are kept until
        :meth:`keep` chooses among them. Padded and compiled as :meth:`forward`."""
        width, start = ids.shape[1], self.length
        if start + width > self.slots:
            raise ValueError(
                f"a tree of {width} tokens after {start} kept positions exceeds this StaticTarget's "
                f"{self.capacity} positions: build it with a larger max_length."
            )
        padded = padded_width(width)
        if start + padded > self.slots:
            padded = width  # the last positions of the cache: run unpadded (eagerly)
        device = ids.device
        if padded > width:  # pads follow the tree, each seeing only the prefix and itself
            ids = torch.cat([ids, ids[:, -1:].expand(1, padded - width)], dim=1)
            grown = torch.eye(padded, dtype=torch.bool)
            grown[:width, :width] = allowed
            allowed, depths = grown, torch.cat([depths, depths.new_zeros(padded - width)])
        mask = torch.full((1, 1, padded, self.slots), torch.finfo(self.model.dtype).min)
        mask[0, 0, :, :start] = 0.0
        mask[0, 0, :, start : start + padded].masked_fill_(allowed, 0.0)
        mask = mask.to(device, self.model.dtype)
        slots = torch.arange(start, start + padded, device=device)
        rope = (start + depths).to(device)
        run = self._compiled_tree if self._compiled_tree is not None and padded <= WIDTHS[-1] else _tree_logits_pass
        logits, hidden = run(self.decoder, self.head, self._cache_kwargs, ids, slots, rope, mask)
        if padded > width:
            self.cache.crop(width - padded)
        self.length += width
        return logits[:width], hidden[:width]

    def keep(self, keep: int, extra: list[int]) -> None:
        """Keep the first ``keep`` positions and then the positions ``extra`` (strictly increasing, each in [keep,
        length)), moved next to them: what a verified tree pass keeps of its tokens (the root and the accepted
        path)."""
        extra = [int(i) for i in extra]
        if moved_positions(keep, extra, self.length):
            move_positions(self.cache.layers, keep, extra)
        self.crop(keep + len(extra))

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (what a rejected speculation rolls back to)."""
        if not 0 <= length <= self.length:
            raise AssertionError(f"cannot crop a StaticTarget holding {self.length} positions to {length}")
        if length < self.length:
            self.cache.crop(length - self.length)
        self.length = length


RUNTIMES = ("eager", "static", "compiled")
"""How a decoder runs its target: ``eager`` (a ``DynamicCache``, the model's own forward), ``static``
(:class:`StaticTarget`, not compiled) or ``compiled`` (:class:`StaticTarget` under ``torch.compile``)."""


def check_runtime(runtime: str) -> None:
    """ValueError naming ``runtime`` unless it is one of :data:`RUNTIMES`."""
    if runtime not in RUNTIMES:
        raise ValueError(f"target_runtime={runtime!r} must be one of {list(RUNTIMES)}.")


def target_cache(model: torch.nn.Module, runtime: str, max_length: int):
    """What a decoder keeps the target's KV cache in for ``runtime`` (:data:`RUNTIMES`): a fresh ``DynamicCache`` or
    a :class:`StaticTarget` of ``max_length`` positions (reused across calls for the same model, length bucket and
    runtime, so a compiled one compiles once)."""
    check_runtime(runtime)
    if runtime == "eager":
        return DynamicCache()
    key = (capacity(max_length), runtime)
    kept: dict = model.__dict__.setdefault("_accept_head_static_targets", {})
    if key not in kept:
        kept[key] = StaticTarget(model, max_length, compile=runtime == "compiled")
    kept[key].reset()
    return kept[key]
