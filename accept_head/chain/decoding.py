"""Lossless speculative decoding with pluggable stop policies, and the autoregressive reference.

Both decoders keep the KV caches of their models across rounds (cropped after a rejection, never re-encoding the
prefix) and return the sequences and statistics as values. Batch size 1.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields

import torch
from transformers import DynamicCache

from ..acceptance.inputs import draft_step_stats
from ..core.hf_compat import cache_kwargs, crop_cache
from ..core.sampling import SamplingConfig, argmax, generator_device, probabilities, sample, sample_one
from ..core.timing import device_timer
from ..models.drafters import Drafter, as_drafter
from ..models.features import capture_lm_head_input
from ..models.static_target import StaticTarget, target_cache
from .policies import RoundState, StopPolicy


@dataclass
class DecodeStats:
    """Counters of one generation. Rates are per generated token (SpecDec++ eq. 2.3)."""

    generated: int = 0
    target_calls: int = 0
    """Target forward passes after the prompt (one per round; one per token for autoregressive decoding)."""
    draft_calls: int = 0
    """Draft forward passes, prompt prefill included."""
    discarded: int = 0
    """Drafted candidates that were rejected or cut off."""
    proposed: list[int] = field(default_factory=list)
    """Candidates submitted in each round."""
    accepted: list[int] = field(default_factory=list)
    """Candidates accepted in each round."""
    draft_time: float = 0.0
    """Seconds spent drafting candidates, the acceptance head's scoring included."""
    head_time: float = 0.0
    """Seconds of ``draft_time`` spent in the acceptance head."""
    target_time: float = 0.0
    """Seconds of target forward passes (prefill and verification)."""
    total_time: float = 0.0
    """Wall time of the whole call."""

    @property
    def verification_rate(self) -> float:
        """N_target / N."""
        return self.target_calls / max(self.generated, 1)

    @property
    def discard_rate(self) -> float:
        """N_discarded / N."""
        return self.discarded / max(self.generated, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.total_time if self.total_time > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / max(len(self.accepted), 1)

    def record_round(self, proposed: int, accepted: int, committed: int) -> None:
        """Count one verified round: ``proposed`` candidates, ``accepted`` of them by the accept rule, ``committed``
        tokens kept (the accepted candidates and the target's token, cut after an EOS)."""
        kept = min(accepted, committed)
        self.target_calls += 1
        self.proposed.append(proposed)
        self.accepted.append(kept)
        self.discarded += proposed - kept
        self.generated += committed

    def __add__(self, other: DecodeStats) -> DecodeStats:
        """The statistics of both generations together: counts and times add, per-round lists concatenate. The sum
        has the more specific type of the two (a :class:`~accept_head.trees.verify.TreeDecodeStats` keeps its
        per-call lists), so ``sum(stats, DecodeStats())`` pools any runs of one method."""
        if not isinstance(other, DecodeStats):
            return NotImplemented
        if not isinstance(other, type(self)) and not isinstance(self, type(other)):
            raise TypeError(
                f"cannot add {type(self).__name__} and {type(other).__name__}: they count different things."
            )
        kind = type(other) if isinstance(other, type(self)) else type(self)
        out = kind()
        for f in fields(kind):
            mine, theirs = getattr(self, f.name, None), getattr(other, f.name, None)
            parts = [v for v in (mine, theirs) if v is not None]
            setattr(
                out, f.name, [x for v in parts for x in v] if isinstance(getattr(out, f.name), list) else sum(parts)
            )
        return out

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            verification_rate=self.verification_rate,
            discard_rate=self.discard_rate,
            tokens_per_second=self.tokens_per_second,
        )
        return out


@dataclass
class GenerationResult:
    sequences: torch.Tensor
    """(1, prompt_len + new_tokens) LongTensor."""
    stats: DecodeStats


def _as_input_ids(input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise NotImplementedError(
            f"Only batch size 1 is supported; got input_ids of shape {tuple(ids.shape)}. Loop over prompts instead."
        )
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty: pass at least one prompt token.")
    return ids


def _check_int(name: str, value, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}.")


def _prepare(
    input_ids: torch.Tensor | Sequence[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None, target
) -> tuple[torch.Tensor, int, set[int]]:
    """The checked prompt (1, L), the usable number of new tokens (:func:`_check_lengths` against the target) and
    the set of EOS ids: the prologue every decoder shares."""
    ids = _as_input_ids(input_ids)
    return ids, _check_lengths(ids.shape[1], max_new_tokens, target), _eos_set(eos_token_id)


def _context_limit(model) -> int | None:
    """The longest sequence ``model`` (a Hugging Face model or a :class:`Drafter`) can read, None if unbounded."""
    config = getattr(model, "config", None)
    return getattr(model, "context_limit", None) or getattr(config, "max_position_embeddings", None)


class ContextLimitWarning(UserWarning):
    """A request asks for more tokens than the target's context holds; decoding stops at the context's end."""


def _check_lengths(prompt_len: int, max_new_tokens: int, target) -> int:
    """Validate the prompt against the target's context and return the usable number of new tokens.

    Every decoder stops at the target's context (``max_position_embeddings``): a prompt that fills it raises
    ValueError, and a request that would run past it warns at the start (:class:`ContextLimitWarning`, saying how many
    tokens it will return) and returns only the tokens that fit. transformers' own ``generate`` instead goes on past
    ``max_position_embeddings`` with a "friendly reminder" once it is there; positions the model was not trained for
    are not a text this toolkit vouches for, so it stops, but never without a word.

    Only the target bounds the output. A draft with a shorter context is not checked here: it drafts fewer
    candidates as it runs out of room, then none (:func:`draft_room`), and the target goes on alone.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0.")
    limit = _context_limit(target)
    if limit is None:
        return max_new_tokens
    if prompt_len >= limit:
        raise ValueError(
            f"The prompt has {prompt_len} tokens but {type(target).__name__} has a context of {limit}; "
            "shorten or left-truncate the prompt."
        )
    if prompt_len + max_new_tokens > limit:
        warnings.warn(
            f"The prompt has {prompt_len} tokens and max_new_tokens={max_new_tokens}, but {type(target).__name__} "
            f"has a context of {limit} positions (max_position_embeddings): decoding stops at its end, after at most "
            f"{limit - prompt_len} new tokens. Ask for at most {limit - prompt_len} or shorten the prompt.",
            ContextLimitWarning,
            stacklevel=3,
        )
    return min(max_new_tokens, limit - prompt_len)


def draft_room(draft, length: int) -> int:
    """How many candidates ``draft`` (a :class:`Drafter` or a Hugging Face draft model) can still propose after a
    committed sequence of ``length`` tokens without reading past its own context.

    K candidates make a drafter read at most ``length + K − 1`` positions (every committed token, then y_1..y_{K−1};
    a feature draft reads one fewer), so K ≤ context − length + 1. Zero or less means the round submits no
    candidate: a plain target step, which keeps the output the target's whatever the draft's context.
    """
    limit = _context_limit(draft)
    return sys.maxsize if limit is None else limit - length + 1


def _eos_set(eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS id (all of them if there is none)."""
    ended = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if ended is None else tokens[: ended + 1]


def _forward(model, ids: torch.Tensor, cache: DynamicCache | StaticTarget, last_only: bool) -> torch.Tensor:
    """Run new tokens (1, T) through ``model`` with its cache (or its :class:`StaticTarget`); return logits (T, V) or
    (1, V) if ``last_only``."""
    if isinstance(cache, StaticTarget):
        return cache.forward(ids, last_only)[0]
    out = model(input_ids=ids, **cache_kwargs(model, cache), logits_to_keep=1 if last_only else 0)
    return out.logits[0]


def _crop(cache: DynamicCache | StaticTarget, length: int) -> None:
    """Keep the first ``length`` positions of the target's cache."""
    if isinstance(cache, StaticTarget):
        cache.crop(length)
    else:
        crop_cache(cache, length)


@torch.inference_mode()
def autoregressive_generate(
    target: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    target_runtime: str = "eager",
) -> GenerationResult:
    """Sample from the target alone, one token per forward pass (the reference every speed-up is measured against).
    ``target_runtime``: ``eager`` (a ``DynamicCache``), ``static`` or ``compiled`` (a preallocated cache, compiled
    with ``torch.compile``: :mod:`~accept_head.models.static_target`)."""
    sampling = SamplingConfig(temperature, top_k, top_p)
    ids, budget, eos = _prepare(input_ids, max_new_tokens, eos_token_id, target)
    device = next(target.parameters()).device
    stats = DecodeStats()
    tokens = ids[0].tolist()
    cache = target_cache(target, target_runtime, ids.shape[1] + budget)
    pending = ids.to(device)
    with _timed(stats, "total_time", device):
        while stats.generated < budget:
            with _timed(stats, "target_time", device):
                logits = _forward(target, pending, cache, last_only=True)
                drawn = sample(probabilities(logits[-1:], sampling), generator)  # (1,) on the target's device
                token = int(drawn[0])  # the one host read per token (EOS check, the returned ids)
            stats.target_calls += 1
            stats.generated += 1
            tokens.append(token)
            if token in eos:
                break
            pending = drawn[None, :]  # already on the device: no host-to-device copy per token
    return GenerationResult(torch.tensor([tokens], dtype=torch.long), stats)


def verify(
    p: torch.Tensor, q: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Speculative sampling's accept/reject step for one round.

    p: (K+1, V) target distributions, q: (K, V) draft distributions, candidates: (K,) tokens drawn from q.
    Returns (number accepted m, the next token): the residual Norm[(p_m − q_m)+] at the first rejection, else the
    bonus token from p_K. The output is distributed exactly as the target's (Leviathan et al. 2023, Thm 1).
    """
    k = candidates.shape[0]
    rows = torch.arange(k, device=p.device)
    p_tok, q_tok = p[rows, candidates], q[rows, candidates]
    # Accept y_i iff u_i < p_i(y_i) / q_i(y_i), u_i ~ U[0, 1): probability min(1, p/q). Written as a rejection test
    # u·q >= p so that p = 0 always rejects (even for u = 0) and p >= q always accepts — exact in the greedy limit.
    uniforms = torch.rand(k, generator=generator, device=generator_device(generator))
    rejected = uniforms.to(p.device) * q_tok >= p_tok
    # The first rejection, or k when every candidate is accepted (a True appended at k): one host read, not two.
    m = int(torch.cat([rejected, rejected.new_ones(1)]).int().argmax())
    if m < k:
        residual = (p[m] - q[m]).clamp(min=0)
        total = residual.sum()
        # Rounding can leave no positive mass when p ≈ q; p itself is then the exact residual direction.
        residual = residual / total if total > 0 else p[m]
        return m, sample_one(residual, generator)
    return k, sample_one(p[k], generator)


def verify_argmax(logits: torch.Tensor, candidates: Sequence[int]) -> tuple[int, int]:
    """Greedy verification of one round from the target's logits (K+1, V) alone: candidates are accepted while each
    equals the target's argmax after its prefix (the first maximum on ties, as :func:`probabilities` takes it), and
    the next token is the argmax after the last accepted one. The same (m, next token) as :func:`verify` over the
    greedy one-hot p and q, without building K + 1 distributions over the vocabulary."""
    picks = argmax(logits).tolist()
    m = next((i for i, (y, pick) in enumerate(zip(candidates, picks)) if y != pick), len(candidates))
    return m, picks[m]


@contextmanager
def _timed(
    stats: DecodeStats, field_name: str, device: torch.device | Iterable[torch.device] | None = None
) -> Iterator[None]:
    """Add the wall time of the ``with`` block, the work it queued on ``device`` included, to
    ``stats.<field_name>`` (``device=None``: the current CUDA device, if any; see
    :func:`~accept_head.core.timing.synchronize`)."""
    with device_timer(device) as watch:
        yield
    setattr(stats, field_name, getattr(stats, field_name) + watch.seconds)


def _target_pass(
    target, ids: torch.Tensor, cache: DynamicCache, with_features: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``ids`` (1, T) through the target with its cache: logits (T, V) and, if asked, its final hidden states
    (T, d) from the same pass."""
    if not with_features:
        return _forward(target, ids, cache, last_only=False), None
    if isinstance(cache, StaticTarget):
        return cache.forward(ids)
    with capture_lm_head_input(target) as box:
        logits = _forward(target, ids, cache, last_only=False)
    return logits, box[0][0]


def prefill(target: torch.nn.Module, drafter: Drafter, ids: torch.Tensor, cache: DynamicCache) -> None:
    """Start a generation from the prompt ``ids`` (1, L): the target's ``cache`` takes all tokens but the last (the
    first verification pass feeds it), and ``drafter`` starts on the prompt with the target's final hidden states
    (L − 1, d) of that pass when it reads them."""
    with_features = drafter.needs_target_features
    features = ids.new_zeros((0, 0)) if with_features else None
    if ids.shape[1] > 1:
        _, features = _target_pass(target, ids[:, :-1], cache, with_features)
    drafter.start(ids[0].tolist(), features)


def _check_pair(drafter: Drafter, policy: StopPolicy, sampling: SamplingConfig) -> None:
    head = getattr(policy, "head", None)
    if head is not None and head.hidden_size != drafter.hidden_size:
        raise ValueError(
            f"The acceptance head expects hidden size {head.hidden_size} but the draft's is "
            f"{drafter.hidden_size}; train a head for this draft."
        )
    if policy.requires_greedy and not sampling.greedy:
        raise ValueError(
            f"{policy.describe()} is only defined for greedy decoding but temperature={sampling.temperature}; "
            "pass temperature=0 or pick another policy."
        )


def draw(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """One candidate from ``logits`` (S,) under ``sampling``: its index and the transformed distribution (S,) it was
    drawn from (greedy: the argmax — the first maximum, as ``argmax`` breaks ties — and its one-hot)."""
    if sampling.greedy:
        index = int(argmax(logits))
        q = torch.zeros(logits.shape[-1], device=logits.device)
        q[index] = 1.0
        return index, q
    q = probabilities(logits, sampling)
    return sample_one(q, generator), q


def draft_round(
    drafter: Drafter,
    policy: StopPolicy,
    sampling: SamplingConfig,
    limit: int,
    position: int,
    generator: torch.Generator | None,
    stats: DecodeStats,
    copy_below: Callable[[Sequence[int]], bool] | None = None,
) -> tuple[RoundState, list[torch.Tensor]]:
    """Draft up to ``limit`` candidates, asking ``policy`` before each one. Returns the round (its candidates
    ``state.candidates`` and what the policy saw, for :meth:`StopPolicy.update`) and the draft distributions
    q_1..q_K (each (V,)) the candidates were sampled from.

    The policy is asked once before the first candidate (it may submit none) and then after each candidate y_n,
    when the scores of y_1..y_{n-1} are known: the score of y_n arrives with the step that drafts y_{n+1} — or at
    once, for a policy that ``scores_at_draw`` (a head of the draft's numbers alone). ``copy_below`` (a copying
    decoder's): whether a copied row would follow the candidates drafted so far, asked before each decision of a
    policy that ``uses_copies`` (``state.copy_below``).
    """

    def stop() -> bool:
        if copy_below is not None and policy.uses_copies:
            state.copy_below = copy_below(state.candidates)
        return policy.should_stop(state)

    # A one-hot q carries no confidence: greedy confidence/entropy rules read the draft's untempered softmax.
    untempered = sampling.greedy and (policy.uses_confidence or policy.uses_entropy)
    state = RoundState(position=position)
    q_rows: list[torch.Tensor] = []
    if limit <= 0 or stop():
        return state, q_rows
    step = drafter.propose(None)
    while step is not None:
        stats.draft_calls += 1
        # Over the drafter's support when it gives one (a pruned vocabulary): the same draw and numbers as over
        # the whole vocabulary, whose other entries have q = 0, at a third of the cost for the embedded pair.
        logits = step.logits if step.support is None else step.support_logits
        index, q = draw(logits, sampling, generator)
        y = index if step.support is None else int(step.support[index])
        state.candidates.append(y)
        q_rows.append(q if step.support is None else q.new_zeros(step.vocab_size).index_copy_(0, step.support, q))
        state.n += 1
        state.position += 1
        confidence = logits.float().softmax(-1) if untempered else q
        state.token_probs.append(float(confidence[index]))
        if policy.uses_draft_stats:  # the head's scalar inputs, computed as the labels' draft_* columns are
            with _timed(stats, "head_time", getattr(drafter, "device", None)):
                logq, entropy, top1 = draft_step_stats(logits, q, index, sampling.greedy, policy.uses_spread)
            state.draft_logps.append(logq)
            state.entropies.append(entropy)
            state.top1s.append(top1)
            if policy.scores_at_draw:  # a head of the draft's numbers: y_n's score needs no further forward
                with _timed(stats, "head_time", getattr(drafter, "device", None)):
                    state.accept_probs.append(policy.score(None, state))
        elif policy.uses_entropy:
            state.entropies.append(float(-(confidence * confidence.clamp_min(1e-30).log()).sum()))
        if state.n >= limit or stop():
            break
        step = drafter.propose(y)  # reads y_n: the next candidate's logits and y_n's hidden state
        if policy.uses_hidden:
            with _timed(stats, "head_time", getattr(drafter, "device", None)):
                state.accept_probs.append(policy.score(step.hidden, state))
    return state, q_rows


@torch.inference_mode()
def speculative_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module | Drafter,
    input_ids: torch.Tensor | Sequence[int],
    policy: StopPolicy,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    target_runtime: str = "eager",
) -> GenerationResult:
    """Lossless speculative decoding whose candidate length per round is chosen by ``policy``.

    ``draft`` is a Hugging Face causal LM sharing the target's tokenizer, a
    :class:`~accept_head.models.feature_draft.FeatureDraft`, or any :class:`~accept_head.models.drafters.Drafter`. Each
    round:
    the drafter proposes y_1..y_K (the policy decides K), the target scores them in one pass, :func:`verify`
    accepts a prefix and adds one token of its own, and both sides keep only what was accepted.

    Every decoder of this toolkit stops at the target's context: a request past ``max_position_embeddings`` warns
    at the start (:class:`ContextLimitWarning`) and returns the tokens that fit (:func:`_check_lengths`).
    ``target_runtime`` runs the target eagerly (``eager``), over a preallocated cache (``static``) or compiled
    (``compiled``), as in :func:`autoregressive_generate`.
    """
    sampling = SamplingConfig(temperature, top_k, top_p)
    drafter = as_drafter(draft, target, with_hidden=policy.uses_hidden)
    _check_pair(drafter, policy, sampling)
    ids, budget, eos = _prepare(input_ids, max_new_tokens, eos_token_id, target)
    device = next(target.parameters()).device
    stats = DecodeStats()
    policy.reset()
    tokens = ids[0].tolist()
    cache = target_cache(target, target_runtime, ids.shape[1] + budget)  # always lacks the last token
    draft_device = getattr(drafter, "device", None)
    with _timed(stats, "total_time", {device, draft_device or device}):
        with _timed(stats, "target_time", device):
            prefill(target, drafter, ids.to(device), cache)
        while stats.generated < budget:
            # 1. Draft: the target always adds a token of its own, so at most budget - generated - 1 candidates, and
            #    never past the draft's own context.
            limit = min(policy.max_candidates, budget - stats.generated - 1, draft_room(drafter, len(tokens)))
            with _timed(stats, "draft_time", draft_device):
                state, q_rows = draft_round(drafter, policy, sampling, limit, len(tokens), generator, stats)
            candidates = state.candidates
            # 2. Verify: one target pass over [last token, y_1..y_K] gives p_1..p_{K+1}.
            with _timed(stats, "target_time", device):
                verify_ids = torch.tensor([[tokens[-1], *candidates]], device=device)
                logits, hidden = _target_pass(target, verify_ids, cache, drafter.needs_target_features)
                if sampling.greedy:
                    m, next_token = verify_argmax(logits, candidates)
                else:
                    p = probabilities(logits, sampling)
                    q = torch.stack(q_rows) if q_rows else p[:0]
                    m, next_token = verify(p, q, verify_ids[0, 1:], generator)
            policy.update(state, m)
            # 3. Commit: accepted candidates and the target's token (up to an EOS), then crop both sides to them.
            new = _until_eos(candidates[:m] + [next_token], eos)
            stats.record_round(len(candidates), m, len(new))
            _crop(cache, len(tokens) + m)  # the target holds the old prefix plus [tokens[-1], y_1..y_m]
            with _timed(stats, "draft_time", draft_device):
                drafter.commit(new, None if hidden is None else hidden[: len(new)])
            tokens.extend(new)
            if new[-1] in eos:
                break
    return GenerationResult(torch.tensor([tokens], dtype=torch.long), stats)
