"""On-policy rollout labels: label the candidates of real speculative rounds from the rounds' own verification passes.

Teacher-forced labels (:mod:`accept_head.acceptance.labels`, SpecDec++ §3.3) score the draft on the *target's*
response, and
token mixing only approximates the contexts a head sees at inference, where the draft reads its own candidates. A
rollout runs real speculative decoding instead: every round drafts exactly ``k_max`` candidates y_1..y_K
(:class:`~accept_head.chain.policies.FixedK` through :func:`~accept_head.chain.decoding.draft_round`, fewer only at the
end of the
token budget), and the round's ONE verification pass gives p_k = p(·|x, accepted prefix, y_<k) for every candidate —
the probability of acceptance *given that y_<k were accepted*, which is exactly what an acceptance head predicts:

    label_k = min(1, p_k(y_k) / q_k(y_k))          (greedy transform: 1[y_k = argmax p_k])

The round then goes on as ordinary speculative sampling (:func:`~accept_head.chain.decoding.verify`: accept a prefix,
add
the target's token), so the text stays distributed as the target's, and both sides commit exactly as
:func:`~accept_head.chain.decoding.speculative_generate` does: the target's cache is cropped and the drafter is told the
committed tokens (with the target's features from the same pass when it reads them). Given the same generator, the
sequence is the one ``speculative_generate(..., FixedK(k_max))`` writes.

Besides the label, each candidate carries the drafter's hidden state for y_k —
:attr:`~accept_head.models.drafters.DraftStep.
hidden` of the ``propose(y_k)`` call, the head's input. For the last candidate of a round the decoder never feeds y_K,
so data generation makes one extra ``propose(y_K)`` call after drafting; the drafter's ``commit`` crops whatever was
fed and not accepted, so its state after the round is the same as without the extra call. This is what makes rollout
labels work for drafts whose hidden states cannot be recomputed from tokens alone (a
:class:`~accept_head.models.feature_draft.FeatureDraft` reads the target's features of the accepted prefix and its own
predicted features for the candidates).

:data:`ROLLOUT_COLUMNS` is the layout ``python -m data_gen`` writes with ``label_mode: rollout`` (one row per prompt,
one list entry per candidate, the hidden states flattened row-major in ``hidden``); :func:`read_hidden` loads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from ..acceptance.inputs import SOURCES, stored_inputs
from ..acceptance.labels import COLUMNS, PER_POSITION, _list_features, position_labels
from ..core.hf_compat import crop_cache
from ..core.sampling import SamplingConfig, probabilities
from ..core.timing import device_timer
from ..models.drafters import Drafter, DraftStep, as_drafter
from .decoding import (
    DecodeStats,
    _prepare,
    _target_pass,
    _timed,
    _until_eos,
    draft_room,
    draft_round,
    prefill,
    verify,
)
from .policies import FixedK

ROLLOUT_COLUMNS: dict[str, str] = {
    **COLUMNS,
    "round": "int32",
    "step": "int32",
    "accepted": "bool",
    "hidden": "<hidden_dtype>",
}
"""Columns of a ``label_mode: rollout`` dataset; every column but ``prompt_id`` and ``source`` is a list.

``response_ids`` is the text the rollout wrote (distributed as the target's). Every other list has one entry per
*candidate* (C entries, rounds in order, candidates in order within a round) — not per response token. A round's
candidates are listed up to its first drafted EOS: the ones after it would be read in a context holding an accepted
EOS, which decoding never reaches, so they are neither labelled nor counted as accepted.

- ``draft_ids``: the candidate y_k; ``round``: its round (0-based); ``step``: k, its index in the round (1-based).
- ``accept_prob``: min(1, p_k(y_k)/q_k(y_k)) from the round's verification pass (1[y_k = argmax p_k] when greedy).
- ``target_logp`` / ``draft_logp`` / ``expected_accept`` / ``draft_entropy`` / ``draft_top1``: as in
  :data:`accept_head.acceptance.labels.COLUMNS` (from the untransformed softmax when the transform is greedy).
- ``accepted``: whether the decode accepted y_k (the accept rule drew its own uniforms; the label is the
  probability, this is the one outcome).
- ``hidden``: the drafter's hidden states of the C candidates, (C, d) flattened row-major into C·d values of the
  dataset's ``hidden_dtype`` (float16 or float32; d is ``meta.json["rollout"]["hidden_size"]``). Row c is the state
  at the position whose input is candidate c — the acceptance head's input for it.

``hidden`` and the columns ``draft_logp``, ``draft_entropy``, ``draft_top1`` and ``step`` are every input a head may
read (:mod:`accept_head.acceptance.inputs`; ``meta.json["head_inputs"]`` lists them): the decoder computes the same
numbers from the same draft steps (:func:`~accept_head.acceptance.inputs.draft_stats`).

The names the token-level format shares keep :func:`accept_head.acceptance.labels.load_label_dataset` and the readers of
``draft_logp`` / ``accept_prob`` working on rollout datasets; readers that align ``draft_ids`` with ``response_ids``
(token mixing) must check ``meta.json["label_mode"]`` first.
"""

ROLLOUT_PER_CANDIDATE = (*PER_POSITION, "round", "step", "accepted")
"""The per-candidate list columns other than ``hidden``."""

HIDDEN_DTYPES = ("float16", "float32")


def rollout_features(hidden_dtype: str = "float16"):
    """The ``datasets.Features`` of a rollout dataset (see :data:`ROLLOUT_COLUMNS`)."""
    if hidden_dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden_dtype={hidden_dtype!r} must be one of {HIDDEN_DTYPES}.")
    return _list_features(ROLLOUT_COLUMNS | {"hidden": hidden_dtype})


@dataclass
class RolloutLabels:
    """What one rollout wrote and measured. C = candidates over all rounds; tensors on the CPU."""

    response_ids: torch.Tensor
    """(N,) LongTensor: the generated tokens (the target's distribution), EOS included when one was produced."""
    draft_ids: torch.Tensor
    """(C,) LongTensor: the candidates y_k, rounds in order."""
    accept_prob: torch.Tensor
    """(C,) min(1, p_k(y_k)/q_k(y_k)) under the sampling transform; 1[y_k = argmax p_k] when greedy."""
    target_logp: torch.Tensor
    """(C,) log p_k(y_k) (untransformed softmax when greedy; −inf where a top-k/top-p filter removed y_k)."""
    draft_logp: torch.Tensor
    """(C,) log q_k(y_k), the draft's probability of its own candidate (untransformed softmax when greedy)."""
    expected_accept: torch.Tensor
    """(C,) Σ_x min(p_k(x), q_k(x)): the acceptance probability averaged over y_k ~ q_k."""
    draft_entropy: torch.Tensor
    """(C,) entropy of q_k in nats (untransformed softmax when greedy)."""
    draft_top1: torch.Tensor
    """(C,) max_x q_k(x) (untransformed softmax when greedy)."""
    round: torch.Tensor
    """(C,) LongTensor: the round of each candidate (0-based)."""
    step: torch.Tensor
    """(C,) LongTensor: k, the candidate's index within its round (1-based)."""
    accepted: torch.Tensor
    """(C,) BoolTensor: whether the decode accepted the candidate (a prefix of each round)."""
    hidden: torch.Tensor
    """(C, d) float32: the drafter's hidden state at the position whose input is y_k (the head's input)."""
    stats: DecodeStats
    """Counters and timings of the decode (the extra ``propose(y_K)`` calls are counted in ``draft_calls``)."""
    label_seconds: float = 0.0
    """Seconds spent only because labels were asked for (the extra draft steps and the label maths)."""

    def inputs(self) -> torch.Tensor:
        """(C, S) the scalar head inputs of every candidate (:data:`~accept_head.acceptance.inputs.SCALAR_INPUTS`
        order), as training reads them from the dataset's columns (:func:`~accept_head.acceptance.inputs.
        stored_inputs`)."""
        return stored_inputs({column: getattr(self, column) for column in SOURCES})

    def row(self, hidden_dtype: str = "float16") -> dict[str, list | np.ndarray]:
        """The per-candidate lists of a rollout dataset row (:data:`ROLLOUT_COLUMNS`); ``hidden`` is the (C·d,)
        array of ``hidden_dtype`` (the (C, d) states flattened row-major)."""
        out = {name: getattr(self, name).tolist() for name in ROLLOUT_PER_CANDIDATE}
        out["hidden"] = self.hidden.to(getattr(torch, hidden_dtype)).reshape(-1).numpy()
        return out


class _RecordingDrafter(Drafter):
    """Passes every call on to ``inner`` and keeps the :class:`DraftStep` of each ``propose`` of the current round
    (``None`` included), so :func:`draft_round` can be used unchanged and its steps read afterwards."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.model = getattr(inner, "model", inner)
        self.vocab_size = inner.vocab_size
        self.hidden_size = inner.hidden_size
        self.needs_target_features = inner.needs_target_features
        self.context_limit = inner.context_limit
        self.steps: list[DraftStep | None] = []

    def start(self, prompt: Sequence[int], features: torch.Tensor | None) -> None:
        self.inner.start(prompt, features)

    def propose(self, token: int | None) -> DraftStep | None:
        step = self.inner.propose(token)
        self.steps.append(step)
        return step

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None) -> None:
        self.inner.commit(tokens, features)


def check_k_max(k_max: int, flag: str = "k_max") -> None:
    """Raise ValueError unless ``k_max`` is an integer >= 1 (candidates per rollout round)."""
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
        raise ValueError(
            f"{flag}={k_max!r} must be an integer >= 1: the number of candidates each rollout round drafts and "
            "labels (e.g. 8; the head's max_candidates at inference is a natural choice)."
        )


@torch.inference_mode()
def rollout_labels(
    target: torch.nn.Module,
    draft: torch.nn.Module | Drafter,
    prompt_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    k_max: int,
    sampling: SamplingConfig,
    eos_token_ids: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> RolloutLabels:
    """Decode one prompt speculatively with ``k_max`` candidates per round and label every candidate on-policy.

    Args:
        target: the target causal LM (batch size 1).
        draft: a Hugging Face causal LM sharing the target's tokenizer, a
            :class:`~accept_head.models.feature_draft.FeatureDraft` or a :class:`~accept_head.models.drafters.Drafter`
            whose steps carry hidden states.
        prompt_ids: (L,) or (1, L) prompt token ids.
        max_new_tokens: longest response; it ends earlier at an EOS id.
        k_max: candidates drafted per round (fewer only when the token budget runs out).
        sampling: the transform of decoding and of the labels (temperature 0: greedy).
        eos_token_ids: ids that end the response.
        generator: the only source of randomness (draws of y_k, the accept rule, the residual/bonus tokens).

    Returns the response and, per candidate, its label, features, round, step and hidden state (see
    :class:`RolloutLabels`). Each label comes from the verification pass of its round: no extra target pass.
    """
    check_k_max(k_max)
    policy = FixedK(k_max)
    inner = _hidden_drafter(draft, target)
    ids, budget, eos = _prepare(prompt_ids, max_new_tokens, eos_token_ids, target)
    drafter = _RecordingDrafter(inner)
    device = next(target.parameters()).device
    draft_device = getattr(inner, "device", None)
    stats = DecodeStats()
    label_seconds = 0.0
    tokens = ids[0].tolist()
    cache = DynamicCache()  # the target's: it always lacks the last token, which the next pass feeds
    parts: list[dict[str, torch.Tensor]] = []
    with _timed(stats, "total_time", {device, draft_device or device}):
        with _timed(stats, "target_time", device):
            prefill(target, drafter, ids.to(device), cache)
        while stats.generated < budget:
            # 1. Draft exactly min(k_max, room) candidates, then feed y_K once more for its hidden state (one more
            #    position than decoding reads, hence the draft's room less one).
            limit = min(k_max, budget - stats.generated - 1, draft_room(inner, len(tokens)) - 1)
            with _timed(stats, "draft_time", draft_device):
                candidates, q_rows, extra = _draft_and_feed(drafter, policy, sampling, limit, tokens, generator, stats)
            label_seconds += extra
            # 2. Verify: one target pass over [last token, y_1..y_K] gives p_1..p_{K+1}.
            with _timed(stats, "target_time", device):
                verify_ids = torch.tensor([[tokens[-1], *candidates]], device=device)
                logits, hidden = _target_pass(target, verify_ids, cache, drafter.needs_target_features)
                p = probabilities(logits, sampling)
                q = torch.stack(q_rows) if q_rows else p[:0]
                candidate_ids = verify_ids[0, 1:]
                m, next_token = verify(p, q, candidate_ids, generator)
            # 3. Label every candidate from the same pass (before the accept rule, whatever it decides) up to the
            #    first drafted EOS: past it, a candidate's context holds an accepted EOS, which decoding never reaches.
            if labelled := len(_until_eos(candidates, eos)):
                with device_timer(device) as watch:
                    part = _round_labels(drafter, logits, candidate_ids, labelled, m, len(stats.proposed), sampling)
                parts.append(part)
                label_seconds += watch.seconds
            # 4. Commit exactly as speculative_generate does.
            new = _until_eos(candidates[:m] + [next_token], eos)
            stats.record_round(len(candidates), m, len(new))
            crop_cache(cache, len(tokens) + m)  # the target holds the old prefix plus [tokens[-1], y_1..y_m]
            with _timed(stats, "draft_time", draft_device):
                drafter.commit(new, None if hidden is None else hidden[: len(new)])
            tokens.extend(new)
            if new[-1] in eos:
                break
    return RolloutLabels(
        response_ids=torch.tensor(tokens[ids.shape[-1] :], dtype=torch.long),  # after the prompt
        **_cat(parts, inner.hidden_size),
        stats=stats,
        label_seconds=label_seconds,
    )


def _hidden_drafter(draft: torch.nn.Module | Drafter, target: torch.nn.Module) -> Drafter:
    """``draft`` as a :class:`Drafter` whose steps carry hidden states; ValueError when it exposes none."""
    inner = as_drafter(draft, target, with_hidden=True)
    if inner.hidden_size is None:
        raise ValueError(
            f"{type(inner).__name__} exposes no hidden state: rollout labels need the drafter's hidden state of each "
            "candidate (the acceptance head's input)."
        )
    return inner


def _draft_and_feed(
    drafter: _RecordingDrafter,
    policy: FixedK,
    sampling: SamplingConfig,
    limit: int,
    tokens: list[int],
    generator: torch.Generator | None,
    stats: DecodeStats,
) -> tuple[list[int], list[torch.Tensor], float]:
    """Step 1 of a rollout round: :func:`draft_round`, then one more ``propose(y_K)`` for y_K's hidden state.
    ``tokens``: the committed text. Returns the candidates, their q rows and the seconds of that extra call
    (``drafter.steps`` holds the round's steps)."""
    round_index = len(stats.proposed)  # the rounds verified before this one
    drafter.steps = []
    state, q_rows = draft_round(drafter, policy, sampling, limit, len(tokens), generator, stats)
    if not state.n:
        return state.candidates, q_rows, 0.0
    if len(drafter.steps) != state.n:  # the drafter returned None after y_K: no hidden state for y_K
        raise ValueError(
            f"{type(drafter.inner).__name__} stopped proposing after candidate {state.n} of round {round_index}; "
            "rollout labels need a hidden state for every candidate."
        )
    # y_K's hidden state; commit() crops what was fed and not accepted
    with device_timer(getattr(drafter.inner, "device", None)) as watch:
        drafter.propose(state.candidates[-1])
    stats.draft_calls += 1
    return state.candidates, q_rows, watch.seconds


def _round_labels(
    drafter: _RecordingDrafter,
    logits: torch.Tensor,
    candidate_ids: torch.Tensor,
    labelled: int,
    accepted: int,
    round_index: int,
    sampling: SamplingConfig,
) -> dict[str, torch.Tensor]:
    """Step 3 of a rollout round: the per-candidate columns of its first ``labelled`` candidates, from the
    verification pass's ``logits`` (K+1, V) and the round's draft steps (``drafter.steps[k]`` holds y_k's hidden
    state); ``accepted``: how many the decode accepted; ``round_index``: the rounds verified before this one."""
    steps = drafter.steps
    if any(s is None or s.hidden is None for s in steps[1 : labelled + 1]):
        raise ValueError(f"{type(drafter.inner).__name__} returned a step without a hidden state.")
    draft_logits = torch.stack([s.logits for s in steps[:labelled]]).to(logits.device)
    labels = position_labels(
        logits[:labelled], draft_logits, transform=sampling, uniforms=None, draft_ids=candidate_ids[:labelled]
    )
    part = {name: getattr(labels, name) for name in PER_POSITION}
    part["round"] = torch.full((labelled,), round_index, dtype=torch.long)
    part["step"] = torch.arange(1, labelled + 1, dtype=torch.long)
    part["accepted"] = torch.arange(labelled) < accepted
    part["hidden"] = torch.stack([s.hidden for s in steps[1 : labelled + 1]]).float().cpu()
    return part


def _cat(parts: list[dict[str, torch.Tensor]], width: int) -> dict[str, torch.Tensor]:
    """Concatenate the per-round tensors (empty tensors of the right dtype and shape when there was no candidate)."""
    names = (*ROLLOUT_PER_CANDIDATE, "hidden")
    if parts:
        return {name: torch.cat([part[name].cpu() for part in parts]) for name in names}
    dtypes = {"draft_ids": torch.long, "round": torch.long, "step": torch.long, "accepted": torch.bool}
    empty = {name: torch.zeros(0, dtype=dtypes.get(name, torch.float32)) for name in ROLLOUT_PER_CANDIDATE}
    return empty | {"hidden": torch.zeros((0, width))}


def read_hidden(dataset, hidden_size: int, counts: Sequence[int] | None = None) -> list[torch.Tensor]:
    """The ``hidden`` column of a rollout dataset as one (C_r, d) tensor per row, in the column's dtype.

    Reads the Arrow column in one piece (no Python lists): the values of all rows are one flat buffer that is
    reshaped and split by the rows' candidate counts (``counts``, default: the lengths of ``accept_prob``).
    """
    if "hidden" not in dataset.column_names:
        raise ValueError("The dataset has no `hidden` column: it was not written with label_mode: rollout.")
    if counts is None:
        counts = [len(labels) for labels in dataset["accept_prob"]]
    column = dataset.select_columns(["hidden"]).with_format("arrow")[:]["hidden"]
    chunks = column.chunks if hasattr(column, "chunks") else [column]
    flats = [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in chunks if len(chunk)]
    flat = np.concatenate(flats) if flats else np.zeros(0, dtype=np.float16)
    total = sum(counts)
    if flat.size != total * hidden_size:
        raise ValueError(
            f"The `hidden` column holds {flat.size} values but {total} candidates × hidden size {hidden_size} = "
            f"{total * hidden_size} were expected; the dataset is corrupt or was made for another draft."
        )
    matrix = torch.from_numpy(flat.reshape(total, hidden_size).copy())
    return list(torch.split(matrix, list(counts)))
