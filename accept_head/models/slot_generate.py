"""Batched sampling built for throughput on a CPU: continuous batching over a preallocated KV cache.

``model.generate`` on a batch keeps every row to the end, grows its cache by concatenation at every step and samples
from a float32 copy of the whole batch's logits. Here every row lives in a *slot* of a :class:`SlotCache` (one
preallocated key/value buffer per layer, written in place at each row's own positions); a row that ends (EOS or
``max_new_tokens``) frees its slot, and free slots are refilled with the next prompts in one batched prefill, so the
decode step keeps its batch full until the prompts run out (then the cache is compacted to the rows still alive).
Rows of one prompt refilled together (a recipe's sampled and greedy rows) share its prefill: the prompt is fed once
and its keys and values copied to the other slots. The model runs through its own ``forward`` (any Hugging Face
causal LM whose attention takes a 4D mask and ``position_ids``, such as Llama, Qwen2, SmolLM2) with
``logits_to_keep=1``.

Once the longest live row passes half the cache, a decode step attends over the whole buffer (masked past each row's
position) instead of the first ``span`` positions: a slice of the buffer is not contiguous, and every attention matmul
copied it (on the EPYC of docs/measurements.md a 128-slot step grew from 180 to 271 ms between 60 and 235 positions
with the slice, and stays at ~197 ms over the whole buffer). Compiled (``compile=True``, :func:`compiled_forward`),
every full-width decode step attends over the whole buffer: one shape, one graph, every step through it (the tail
that decodes fewer rows runs eagerly).

With ``features=True`` the decoder stack runs alone and the LM head is applied to its last position (the same
logits), and every row also hands back what a draft trains on — the target's final hidden state and the logsumexp of
its logits at each position it computed (the prompt's, then one per written token but the last): the ``features``
stage's teacher-forced pass over the same tokens, without running the target over them a second time.

Sampling is exact: row i's token at temperature T is the inverse CDF of softmax(logits_i / T) (float32) at one
uniform u_i drawn per row and step from the caller's generator — the same distribution as ``torch.multinomial``,
with one random number per row instead of one per vocabulary entry; greedy rows take the argmax. The compiled steps
draw the same way in two levels (:func:`sample_rows_blocked`: the block of the vocabulary first, then the token inside
it), so that no float32 copy of every row's logits is made. Given the same prompts, settings and seed, the same rows
come out (the schedule of refills is itself a function of them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from ..core.hf_compat import cache_kwargs
from ..core.sampling import argmax
from .features import logits_from_decoder


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values, (slots, kv_heads, length, head_dim), written where the owning
    :class:`SlotCache` says the fed tokens go."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape = (self.owner.slots, key_states.shape[1], self.owner.length + 1, key_states.shape[-1])
        self.keys = key_states.new_zeros(shape)  # index `length` is the scratch position padding tokens write to
        self.values = value_states.new_zeros(shape[:3] + (value_states.shape[-1],))
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write (n, heads, T, d) keys/values at the fed rows' positions; return the keys/values they attend over."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, positions, span = self.owner.fed_rows, self.owner.fed_positions, self.owner.span
        self.keys[rows[:, None], :, positions] = key_states.transpose(1, 2)
        self.values[rows[:, None], :, positions] = value_states.transpose(1, 2)
        if self.owner.all_rows:  # the decode step: every slot, no copy
            return self.keys[:, :, :span], self.values[:, :, :span]
        return self.keys[rows, :, :span], self.values[rows, :, :span]

    def get_seq_length(self) -> int:
        return self.owner.span

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.span, 0

    def get_max_length(self) -> int:
        return self.owner.length

    def keep(self, slots: torch.Tensor) -> None:
        self.keys, self.values = self.keys[slots], self.values[slots]


class SlotCache(Cache):
    """A KV cache of ``slots`` independent rows of up to ``length`` positions each, for a model with ``layers``
    attention layers. Before each forward, :meth:`feed` names the slots fed and the cache position of every fed
    token; a row's position in the cache is its token's position in its own sequence (slots start at 0)."""

    def __init__(self, layers: int, slots: int, length: int) -> None:
        self.slots, self.length = slots, length
        super().__init__(layers=[SlotLayer(self) for _ in range(layers)])
        self.fed_rows = self.fed_positions = None
        self.all_rows, self.span = True, 0

    def feed(self, rows: torch.Tensor, positions: torch.Tensor, span: int) -> None:
        """The next forward feeds slots ``rows`` (n,) their tokens at cache positions ``positions`` (n, T) (padding:
        :attr:`length`, a scratch position never attended); they attend over the first ``span`` positions."""
        self.fed_rows, self.fed_positions, self.span = rows, positions, span
        self.all_rows = len(rows) == self.slots and bool((rows == torch.arange(self.slots, device=rows.device)).all())

    def copy_slots(self, sources: torch.Tensor, targets: torch.Tensor, width: int) -> None:
        """Copy the keys and values of the first ``width`` positions of slots ``sources`` (n,) into slots ``targets``
        (n,), in every layer: rows that share a prompt share its prefill."""
        for layer in self.layers:
            layer.keys[targets, :, :width] = layer.keys[sources, :, :width]
            layer.values[targets, :, :width] = layer.values[sources, :, :width]

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only ``slots`` (their order becomes the new slot order)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keep(slots)
        self.slots = len(slots)


LENGTH_STEP = 64
"""With a compiled forward the cache length is rounded up to a multiple of this, so that calls (shards) with similar
prompt lengths share the compiled graph."""


COMPILE_OPTIONS: dict = {"freezing": True}
"""Inductor options of :func:`compiled_forward`. ``freezing`` folds the weights into the graph as constants, which
lets inductor hand its linears oneDNN-prepacked weights: on the Intel Xeon (AMX) of docs/measurements.md a 128-slot
run of 192 tokens wrote 953–968 tok/s compiled with it against 841 without (eager: 620–705). A frozen graph holds the
weights it was compiled with: :func:`compiled_forward` compiles anew once any of them changed."""


def compiled_forward(model: torch.nn.Module):
    """``torch.compile(model.forward)`` (inductor, static shapes, :data:`COMPILE_OPTIONS`), built once per model and
    state of its weights: what :func:`slot_generate` runs its full-width decode steps through when asked to
    (``compile=True``). Each (slots, cache length) compiles on first use (~1 min for SmolLM2-135M on this CPU)."""
    weights = tuple((p.data_ptr(), p._version) for p in model.parameters())  # an in-place update bumps _version
    kept = model.__dict__.get("_accept_head_slot_forward")
    if kept is None or kept[0] != weights:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        options = dict(COMPILE_OPTIONS) or None
        kept = model.__dict__["_accept_head_slot_forward"] = (
            weights,
            torch.compile(model.forward, dynamic=False, options=options),
        )
    return kept[1]


def attention_bias(positions: torch.Tensor, span: int, dtype: torch.dtype) -> torch.Tensor:
    """(n, 1, T, span) additive mask: the token at cache position ``positions[i, t]`` sees positions 0..that one of
    its own slot; a padding token (at the scratch position, past ``span``) sees them all (its output is never read)."""
    visible = torch.arange(span, device=positions.device) <= positions[:, :, None]
    return torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )[:, None]


def sample_rows(logits: torch.Tensor, temperature: float, greedy: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` (n, V): the argmax where ``greedy`` (n,) is set, else the inverse CDF of
    softmax(logits / temperature) at ``uniform`` (n,) in [0, 1): the first token whose cumulative weight
    exp((logit − max) / T) (float32, never normalised) exceeds u · total — token i with probability exactly its share
    of the total. Only the sampled rows are copied to float32, and only the greedy rows are searched for a maximum."""
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy_rows, sampled_rows = greedy.nonzero().squeeze(-1), (~greedy).nonzero().squeeze(-1)
    if len(greedy_rows):
        out[greedy_rows] = argmax(logits[greedy_rows])
    if len(sampled_rows):
        weights = logits[sampled_rows].float()
        if temperature != 1.0:
            weights.div_(temperature)
        cdf = weights.sub_(weights.amax(-1, keepdim=True)).exp_().cumsum_(-1)
        total = cdf[:, -1:]
        # u * total may round up to total; the largest float below it keeps the draw on a token with weight.
        target = torch.minimum(uniform[sampled_rows, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        out[sampled_rows] = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return out


SAMPLE_BLOCK = 1024
"""Vocabulary entries per block of :func:`sample_rows_blocked`."""


def sample_rows_blocked(
    logits: torch.Tensor, temperature: float, greedy: torch.Tensor, uniform: torch.Tensor, block: int = SAMPLE_BLOCK
) -> torch.Tensor:
    """:func:`sample_rows`' draw in two levels, for a compiled decode step (:func:`compiled_sampler`): the weights
    exp((logit − max) / T) (float32) summed per block of ``block`` vocabulary entries, the block whose cumulative sum
    first exceeds u · total, then the inverse CDF inside that block alone — token i with probability its share of
    the total, as there. Compiled, the weights are never held for the whole vocabulary (the sums read the logits
    once); greedy rows take the argmax. A token of zero weight is never drawn."""
    rows, vocab = logits.shape
    weights = logits.float()
    if temperature != 1.0:
        weights = weights / temperature
    weights = weights - weights.amax(-1, keepdim=True)
    blocks = -(-vocab // block)
    padded = torch.nn.functional.pad(weights, (0, blocks * block - vocab), value=float("-inf"))
    cdf = padded.view(rows, blocks, block).exp().sum(-1).cumsum(-1)  # (rows, blocks)
    total = cdf[:, -1:]
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    chosen = torch.searchsorted(cdf, target, right=True).clamp_(max=blocks - 1)  # (rows, 1): the block holding it
    before = torch.where(chosen > 0, cdf.gather(1, (chosen - 1).clamp(min=0)), torch.zeros_like(target))
    index = chosen * block + torch.arange(block, device=logits.device)
    inside = padded.gather(1, index).exp().cumsum(-1)  # (rows, block): the chosen block's own cumulative weights
    # What is left of the target inside the block (>= 0), below the block's recomputed sum (> 0) whatever the rounding.
    rest = torch.minimum(target - before, torch.nextafter(inside[:, -1:], torch.zeros_like(target)))
    drawn = index.gather(1, torch.searchsorted(inside, rest, right=True).clamp_(max=block - 1)).squeeze(-1)
    return torch.where(greedy, argmax(logits), drawn)


@functools.cache
def compiled_sampler():
    """``torch.compile(sample_rows_blocked)`` (inductor, static shapes), built once: the full-width decode steps of a
    compiled :func:`slot_generate` sample through it."""
    return torch.compile(sample_rows_blocked, dynamic=False)


@dataclass
class _Slot:
    """The row a slot decodes: its index in the caller's list, where its next token goes, what it wrote (and, with
    features, the final hidden states and log-normalisers of the positions computed so far)."""

    row: int
    position: int
    tokens: list[int]
    hidden: list[torch.Tensor] | None = None
    lse: list[torch.Tensor] | None = None


class DecoderWithHead(torch.nn.Module):
    """A causal LM's decoder stack, then its LM head on the last position: (logits (n, V), final hidden states
    (n, T, d), logsumexp of the logits (n,) in float32) — what a decode step keeping the features needs, as one module
    so that the compiled step covers all of it. Holds the model's own modules (no copies)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()

    def forward(self, **inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.decoder(**inputs).last_hidden_state
        logits = self.head(hidden[:, -1])
        return logits, hidden, logits.float().logsumexp(-1)


class _Forward:
    """One forward of the slots: the last position's logits (n, V) and, with ``features``, the decoder's final hidden
    states (n, T, d) and the logits' log-normaliser (n,) — through ``fast`` (a compiled forward of the model, or of
    :class:`DecoderWithHead` with features) when :meth:`__call__` is told to use it."""

    def __init__(self, model: torch.nn.Module, features: bool, compile: bool) -> None:
        self.model, self.features = model, features
        if features and not logits_from_decoder(model):
            raise ValueError(
                f"slot_generate(features=True) needs {type(model).__name__}'s logits to be its LM head applied to its "
                "decoder's last_hidden_state (no norm or soft-capping outside the decoder); generate without "
                "features and teacher-force them afterwards (the recipe's `features` stage)."
            )
        self.with_head = None
        if features:  # one per model, so that a compiled graph is reused across calls
            self.with_head = model.__dict__.setdefault("_accept_head_decoder_with_head", DecoderWithHead(model))
        self.fast = compiled_forward(self.with_head if features else model) if compile else None

    def __call__(self, cache: SlotCache, use_fast: bool = False, **inputs) -> tuple:
        """(logits, hidden, lse); the last two None without features."""
        if not self.features:
            forward = self.fast if use_fast and self.fast is not None else self.model
            out = forward(**inputs, **cache_kwargs(self.model, cache), logits_to_keep=1)
            return out.logits[:, -1], None, None
        forward = self.fast if use_fast and self.fast is not None else self.with_head
        return forward(**inputs, **cache_kwargs(self.with_head.decoder, cache))


def _lse(hidden: torch.Tensor, lm_head: torch.nn.Module, chunk: int = 1024) -> torch.Tensor:
    """float32 logsumexp over the vocabulary of ``lm_head`` applied to hidden states (n, d), in row chunks so that no
    (n, V) block is held whole."""
    return torch.cat([lm_head(c).float().logsumexp(-1) for c in hidden.split(chunk)])


@torch.inference_mode()
def slot_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    greedy: Sequence[bool],
    *,
    max_new_tokens: int,
    temperature: float,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator,
    slots: int = 128,
    refill_fraction: float = 0.125,
    compile: bool = False,
    features: bool = False,
):
    """Responses of ``model`` to ``prompts`` (token id lists), in their order, decoded ``slots`` rows at a time.

    Row i takes the argmax where ``greedy[i]``, else samples at ``temperature`` (uniforms from ``generator``, which
    lives on the model's device). A response ends with its first EOS (kept) or after ``max_new_tokens``. Free slots
    are refilled with the next prompts (in order) once ``refill_fraction`` of the slots are free, or when every
    live row has ended. ``features``: return ``(responses, features)`` instead, ``features[i]`` the pair (hidden
    (P + R − 1, d) in the model's dtype, lse (P + R − 1,) float32) of row i's prompt (P tokens) and response (R):
    the final hidden state and the logsumexp of the logits at every position but the response's last — the same
    responses as without it.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy rows are chosen by `greedy`).")
    if slots < 1 or not 0 < refill_fraction <= 1 or max_new_tokens < 1:
        raise ValueError(
            f"need slots >= 1, 0 < refill_fraction <= 1 and max_new_tokens >= 1 "
            f"(got {slots}, {refill_fraction}, {max_new_tokens})."
        )
    if len(greedy) != len(prompts) or any(len(p) == 0 for p in prompts):
        raise ValueError("slot_generate needs one `greedy` flag per prompt and no empty prompt.")
    device = next(model.parameters()).device
    eos = set(int(t) for t in eos_token_ids)
    length = max((len(p) for p in prompts), default=0) + max_new_tokens
    if compile:
        length = -(-(length + 1) // LENGTH_STEP) * LENGTH_STEP - 1  # the buffer (length + 1) a multiple of the step
    cache = SlotCache(model.config.num_hidden_layers, min(slots, len(prompts)), length)
    forward, use_fast = _Forward(model, features, compile), compile
    live: list[_Slot | None] = [None] * cache.slots
    greedy_rows = torch.tensor(list(greedy), dtype=torch.bool)
    out: list = [[] for _ in prompts]
    kept: list = [None] * len(prompts) if features else None
    waiting = list(range(len(prompts)))[::-1]  # popped from the end: the prompts in order
    last = torch.full((cache.slots,), pad_token_id, dtype=torch.long)
    while True:
        free = [i for i, slot in enumerate(live) if slot is None]
        if waiting and free and len(free) >= min(refill_fraction * cache.slots, len(waiting)):
            _refill(forward, cache, live, free, waiting, prompts, greedy_rows, last, temperature, generator)
            _retire(live, out, kept, eos, max_new_tokens)
            continue
        alive = [i for i, slot in enumerate(live) if slot is not None]
        if not alive:
            return (out, kept) if features else out
        if not waiting and len(alive) <= cache.slots // 2:  # the tail: decode only the rows still alive
            keep = torch.tensor(alive)
            cache.keep(keep.to(device))
            live, last = [live[i] for i in alive], last[keep]
            use_fast = False  # another shape: the tail decodes eagerly
        _decode_step(forward, cache, live, greedy_rows, last, temperature, generator, pad_token_id, use_fast)
        _retire(live, out, kept, eos, max_new_tokens)


def _refill(forward, cache, live, free, waiting, prompts, greedy_rows, last, temperature, generator) -> None:
    """Prefill the next prompts into the ``free`` slots (left-padded into one batch) and sample their first tokens.
    A prompt taken by several of these rows (a recipe's sampled and greedy rows of one prompt) is prefilled once and
    its keys and values copied to the other slots: each row still draws its own first token from those logits."""
    model = forward.model
    device = next(model.parameters()).device
    chosen = free[: len(waiting)]
    rows = [waiting.pop() for _ in chosen]
    first = first_of_each_prompt([prompts[r] for r in rows])  # first[i]: the row whose prefill row i shares
    unique = sorted(set(first))
    at = {i: j for j, i in enumerate(unique)}  # a prefilled row's place in the batch
    width = max(len(prompts[rows[i]]) for i in unique)
    ids = torch.full((len(unique), width), 0, dtype=torch.long)
    positions = torch.full((len(unique), width), cache.length, dtype=torch.long)  # padding: the scratch position
    for j, i in enumerate(unique):
        n = len(prompts[rows[i]])
        ids[j, width - n :] = torch.as_tensor(prompts[rows[i]])
        positions[j, width - n :] = torch.arange(n)
    cache.feed(torch.tensor([chosen[i] for i in unique], device=device), positions.to(device), width)
    logits, hidden, _ = forward(
        cache,
        input_ids=ids.to(device),
        position_ids=positions.clamp(max=width - 1).to(device),
        attention_mask=attention_bias(positions.to(device), width, model.dtype),
    )
    shared = [i for i in range(len(rows)) if first[i] != i]
    if shared:
        cache.copy_slots(
            torch.tensor([chosen[first[i]] for i in shared], device=device),
            torch.tensor([chosen[i] for i in shared], device=device),
            width,
        )
    source = torch.tensor([at[first[i]] for i in range(len(rows))], device=device)
    uniform = torch.rand(len(rows), generator=generator, device=device)
    tokens = sample_rows(logits[source], temperature, greedy_rows[rows].to(device), uniform).cpu()
    states: dict = {}  # per prefilled row: its prompt's final hidden states and log-normalisers
    for i, (slot, r, token) in enumerate(zip(chosen, rows, tokens.tolist())):
        live[slot] = _Slot(row=r, position=len(prompts[r]), tokens=[token])
        last[slot] = token
        if hidden is not None:  # the prompt's positions (the row's right end of the left-padded batch)
            if first[i] not in states:
                kept = hidden[at[first[i]], width - len(prompts[r]) :]
                states[first[i]] = (kept, _lse(kept, model.get_output_embeddings()))
            live[slot].hidden, live[slot].lse = [states[first[i]][0]], [states[first[i]][1]]


def first_of_each_prompt(prompts: Sequence[Sequence[int]]) -> list[int]:
    """For each of ``prompts``, the index of the first one equal to it (its own index when it is the first)."""
    seen: dict[tuple, int] = {}
    return [seen.setdefault(tuple(prompt), i) for i, prompt in enumerate(prompts)]


def _decode_step(forward, cache, live, greedy_rows, last, temperature, generator, pad_token_id, use_fast) -> None:
    """Feed every slot its last token (free slots feed padding to the scratch position) and sample the next; with
    ``use_fast``, over the whole buffer through the compiled forward."""
    model = forward.model
    device = next(model.parameters()).device
    positions = torch.tensor([[s.position if s is not None else cache.length] for s in live])
    span = int(max(s.position for s in live if s is not None)) + 1
    if use_fast or 2 * span > cache.length:  # the whole buffer: an attention matmul would copy a slice of it
        span = cache.length + 1
    cache.feed(torch.arange(cache.slots, device=device), positions.to(device), span)
    logits, hidden, lse = forward(
        cache,
        use_fast=use_fast,
        input_ids=last[:, None].to(device),
        position_ids=positions.clamp(max=span - 1).to(device),
        attention_mask=attention_bias(positions.to(device), span, model.dtype),
    )
    greedy = torch.tensor([s is not None and bool(greedy_rows[s.row]) for s in live], device=device)
    uniform = torch.rand(cache.slots, generator=generator, device=device)
    sampler = compiled_sampler() if use_fast else sample_rows
    tokens = sampler(logits, temperature, greedy, uniform).cpu()
    for i, (slot, token) in enumerate(zip(live, tokens.tolist())):
        if slot is not None:
            slot.position += 1
            slot.tokens.append(token)
            if hidden is not None:
                slot.hidden.append(hidden[i])
                slot.lse.append(lse[i : i + 1])
    last.copy_(torch.where(torch.tensor([s is not None for s in live]), tokens, pad_token_id))


def _retire(live, out, kept, eos, max_new_tokens) -> None:
    """Free the slots whose row wrote an EOS or its last token, handing the row's tokens to ``out`` (and its hidden
    states and log-normalisers to ``kept``, when kept)."""
    for i, slot in enumerate(live):
        if slot is not None and (slot.tokens[-1] in eos or len(slot.tokens) >= max_new_tokens):
            out[slot.row] = slot.tokens
            if kept is not None:
                kept[slot.row] = (torch.cat(slot.hidden), torch.cat(slot.lse))
            live[i] = None
