"""Lossless speculative decoding with pluggable stop policies, and the autoregressive reference.

Both decoders keep the KV caches of their models across rounds (cropped after a rejection, never re-encoding the
prefix) and return the sequences and statistics as values. Batch size 1.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from ._hf_compat import crop_cache
from .policies import RoundState, StopPolicy
from .sampling import SamplingConfig, probabilities, sample


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


class _LastHidden:
    """Captures the input of a model's output embedding (the final, normed hidden state) during forward — no extra
    pass and no copy of the other layers' states."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.value: torch.Tensor | None = None
        self._handle = model.get_output_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.value = args[0]

    def close(self) -> None:
        self._handle.remove()


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


def _context_limit(model: torch.nn.Module) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def _check_lengths(prompt_len: int, max_new_tokens: int, *models: torch.nn.Module) -> int:
    """Validate the prompt against each model's context and return the usable number of new tokens."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0.")
    budget = max_new_tokens
    for model in models:
        limit = _context_limit(model)
        if limit is None:
            continue
        if prompt_len >= limit:
            raise ValueError(
                f"The prompt has {prompt_len} tokens but {type(model).__name__} has a context of {limit}; "
                "shorten or left-truncate the prompt."
            )
        budget = min(budget, limit - prompt_len)
    return budget


def _eos_set(eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _forward(model, ids: torch.Tensor, cache: DynamicCache, last_only: bool) -> torch.Tensor:
    """Run new tokens (1, T) through ``model`` with its cache; return logits (T, V) or (1, V) if ``last_only``."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1 if last_only else 0)
    return out.logits[0]


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
) -> GenerationResult:
    """Sample from the target alone, one token per forward pass (the reference every speed-up is measured against)."""
    sampling = SamplingConfig(temperature, top_k, top_p)
    ids = _as_input_ids(input_ids)
    device = next(target.parameters()).device
    budget = _check_lengths(ids.shape[1], max_new_tokens, target)
    eos = _eos_set(eos_token_id)
    stats = DecodeStats()
    start = time.perf_counter()
    tokens = ids[0].tolist()
    cache = DynamicCache()
    pending = ids.to(device)
    while stats.generated < budget:
        t0 = time.perf_counter()
        logits = _forward(target, pending, cache, last_only=True)
        token = int(sample(probabilities(logits[-1:], sampling), generator)[0])
        stats.target_time += time.perf_counter() - t0
        stats.target_calls += 1
        stats.generated += 1
        tokens.append(token)
        if token in eos:
            break
        pending = torch.tensor([[token]], device=device)
    stats.total_time = time.perf_counter() - start
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
    uniforms = torch.rand(k, generator=generator, device=generator.device if generator is not None else "cpu")
    rejected = uniforms.to(p.device) * q_tok >= p_tok
    m = int(rejected.int().argmax()) if bool(rejected.any()) else k
    if m < k:
        residual = (p[m] - q[m]).clamp(min=0)
        total = residual.sum()
        # Rounding can leave no positive mass when p ≈ q; p itself is then the exact residual direction.
        residual = residual / total if total > 0 else p[m]
        return m, int(sample(residual[None, :], generator)[0])
    return k, int(sample(p[k : k + 1], generator)[0])


@torch.inference_mode()
def speculative_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    policy: StopPolicy,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Lossless speculative decoding whose candidate length per round is chosen by ``policy``.

    Each round: the draft proposes y_1..y_K (the policy decides K, scoring hidden states when it uses them), the
    target scores all of them in one pass, :func:`verify` accepts a prefix and adds one token of its own.
    """
    sampling = SamplingConfig(temperature, top_k, top_p)
    ids = _as_input_ids(input_ids)
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(
            f"target vocab_size={target.config.vocab_size} != draft vocab_size={draft.config.vocab_size}: "
            "the pair must share one tokenizer."
        )
    head = getattr(policy, "head", None)
    if head is not None and head.hidden_size != draft.config.hidden_size:
        raise ValueError(
            f"The acceptance head expects hidden size {head.hidden_size} but the draft's is "
            f"{draft.config.hidden_size}; train a head for this draft."
        )
    if policy.requires_greedy and not sampling.greedy:
        raise ValueError(
            f"{policy.describe()} is only defined for greedy decoding but temperature={temperature}; "
            "pass temperature=0 or pick another policy."
        )
    # A one-hot q carries no confidence: greedy confidence/entropy rules read the draft's untempered softmax.
    untempered_features = sampling.greedy and (policy.uses_confidence or policy.uses_entropy)
    device = next(target.parameters()).device
    budget = _check_lengths(ids.shape[1], max_new_tokens, target, draft)
    eos = _eos_set(eos_token_id)
    stats = DecodeStats()
    policy.reset()
    hidden = _LastHidden(draft) if policy.uses_hidden else None
    start = time.perf_counter()
    try:
        tokens = ids[0].tolist()
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        if len(tokens) > 1:  # prefill the target with all but the last prompt token
            t0 = time.perf_counter()
            _forward(target, ids[:, :-1].to(device), target_cache, last_only=True)
            stats.target_time += time.perf_counter() - t0
        draft_pending = list(tokens)  # tokens the draft has not consumed yet
        done = budget == 0
        while not done:
            remaining = budget - stats.generated
            limit = min(policy.max_candidates, remaining - 1)  # the target always adds one token
            state = RoundState(position=len(tokens))
            candidates: list[int] = []
            q_rows: list[torch.Tensor] = []
            t0 = time.perf_counter()
            # Ask once before the first candidate (a policy may submit none: then the draft is not run this round and
            # catches up next round); then after each new candidate y_n, when scores of y_1..y_{n-1} are known: the
            # score of y_n arrives with the pass that drafts y_{n+1}.
            drafting = limit > 0 and not policy.should_stop(state)
            if drafting:
                logits = _forward(draft, torch.tensor([draft_pending], device=device), draft_cache, last_only=True)
                stats.draft_calls += 1
                draft_pending = []
            while drafting:
                q = probabilities(logits[-1], sampling)
                y = int(sample(q[None, :], generator)[0])
                candidates.append(y)
                q_rows.append(q)
                state.n += 1
                state.position += 1
                features = logits[-1].float().softmax(-1) if untempered_features else q
                state.token_probs.append(float(features[y]))
                if policy.uses_entropy:
                    state.entropies.append(float(-(features * features.clamp_min(1e-30).log()).sum()))
                if state.n >= limit or policy.should_stop(state):
                    break
                logits = _forward(draft, torch.tensor([[y]], device=device), draft_cache, last_only=True)
                stats.draft_calls += 1
                if hidden is not None:
                    t1 = time.perf_counter()
                    state.accept_probs.append(policy.score(hidden.value[0, -1]))
                    stats.head_time += time.perf_counter() - t1
            stats.draft_time += time.perf_counter() - t0
            # The last candidate was not fed to the draft (its hidden state is never needed this round).
            k = len(candidates)
            t0 = time.perf_counter()
            verify_ids = torch.tensor([[tokens[-1], *candidates]], device=device)
            p = probabilities(_forward(target, verify_ids, target_cache, last_only=False), sampling)
            q_mat = torch.stack(q_rows) if q_rows else p.new_zeros((0, p.shape[-1]))
            m, next_token = verify(p, q_mat, torch.tensor(candidates, device=device, dtype=torch.long), generator)
            stats.target_time += time.perf_counter() - t0
            stats.target_calls += 1
            policy.update(k, m)
            new = candidates[:m] + [next_token]
            for i, token in enumerate(new):  # EOS inside an accepted run ends generation there
                if token in eos:
                    new = new[: i + 1]
                    done = True
                    break
            stats.proposed.append(k)
            stats.accepted.append(min(m, len(new)))
            stats.discarded += k - min(m, len(new))
            stats.generated += len(new)
            # Caches: the target holds the old prefix plus [tokens[-1], y_1..y_m]; the draft everything it consumed.
            crop_cache(target_cache, len(tokens) + m)
            draft_len = draft_cache.get_seq_length()
            keep = min(draft_len, len(tokens) + m)
            crop_cache(draft_cache, keep)
            tokens.extend(new)
            draft_pending = tokens[keep:]
            done = done or stats.generated >= budget
    finally:
        if hidden is not None:
            hidden.close()
    stats.total_time = time.perf_counter() - start
    return GenerationResult(torch.tensor([tokens], dtype=torch.long), stats)
