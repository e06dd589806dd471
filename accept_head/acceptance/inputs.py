"""What an acceptance head reads: the draft's hidden state and, optionally, numbers the draft computes anyway.

SpecDec++'s head (§3.2) reads only the draft's final hidden state e_k at the position whose input is the candidate
y_k. The draft's own numbers about y_k predict acceptance well by themselves (issue 39: on rollout candidates of the
committed pair log q alone ranks acceptance at AUC 0.72, the entropy 0.68, the top-1 probability 0.67), and every one
of them is a function of the draft step's logits the decoder already holds — no extra forward. A head may read any
of :data:`INPUTS`:

- ``hidden``: e_k, the draft's final hidden state (the paper's input).
- ``logq``: log q_k(y_k), the draft's log-probability of the candidate.
- ``entropy``: H(q_k) in nats, the entropy of the distribution y_k was drawn from.
- ``top1``: max_x q_k(x), that distribution's top-1 probability.
- ``depth``: k, the candidate's 1-based index in its round.
- ``path_logq``: Σ_{j≤k} log q_j(y_j), the draft's log-probability of the round's path up to and including y_k.

q_k is the distribution after the sampling transform (:mod:`accept_head.core.sampling`), the one y_k was drawn from;
under greedy decoding, whose transform is a one-hot, the draft's untempered softmax (temperature 1, no filter) — as
the label dataset's ``draft_logp`` / ``draft_entropy`` / ``draft_top1`` columns (:mod:`accept_head.acceptance.labels`).
:func:`draft_stats` is the one function that computes them, for the labels and for the decoder
(:func:`~accept_head.chain.decoding.draft_round`), so training and decoding read the same numbers.

Rollout datasets (``label_mode: rollout``) hold every scalar input: :func:`stored_inputs` reads them from their
columns (:data:`SOURCE_COLUMNS`; ``path_logq`` is the running sum of ``draft_logp`` within each round).
Token-level datasets (teacher-forced labels with token mixing) have no rounds, so they hold the hidden state only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

HIDDEN = "hidden"
INPUTS = (HIDDEN, "logq", "entropy", "top1", "depth", "path_logq")
"""Every input a head may read, in the order a head concatenates them."""
SCALAR_INPUTS = INPUTS[1:]
"""The scalar inputs; stored rows carry all of them in this order."""
SOURCE_COLUMNS: dict[str, tuple[str, ...]] = {
    "logq": ("draft_logp",),
    "entropy": ("draft_entropy",),
    "top1": ("draft_top1",),
    "depth": ("step",),
    "path_logq": ("draft_logp", "step"),
}
"""The rollout dataset columns each scalar input is read from."""
SOURCES = ("draft_logp", "draft_entropy", "draft_top1", "step")
"""Every column of :data:`SOURCE_COLUMNS`."""
REGENERATE = (
    "regenerate the labels with `python -m data_gen --config <config> --label_mode rollout --output_dir <dir>` "
    "(rollout labels store every input)"
)
"""How to get a dataset that holds every input (the fix named by a missing-input error)."""


def check_inputs(inputs: Sequence[str]) -> tuple[str, ...]:
    """``inputs`` in the canonical order of :data:`INPUTS`; ValueError when one is unknown or none is given."""
    if isinstance(inputs, str):
        inputs = [inputs]
    unknown = [name for name in inputs if name not in INPUTS]
    if unknown or not inputs:
        raise ValueError(
            f"inputs={list(inputs)!r}: a head reads a non-empty subset of {list(INPUTS)} (unknown: {unknown})."
        )
    return tuple(name for name in INPUTS if name in inputs)


def draft_stats(
    draft_logits: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log q(y), entropy of q in nats, max q) per row: draft_logits (N, V), q = the transformed draft
    distributions (N, V) the tokens (N,) were drawn from → three (N,) float32 tensors.

    When ``greedy`` (q one-hot) the numbers are those of the untempered softmax of ``draft_logits``.
    """
    tokens = tokens.to(device=q.device, dtype=torch.long)[:, None]
    if greedy:
        log_q = draft_logits.float().log_softmax(-1)
        entropy = torch.special.entr(log_q.exp()).sum(-1)  # 0·log 0 = 0 where a pruned draft has −inf
        return log_q.gather(-1, tokens).squeeze(-1), entropy, log_q.max(-1).values.exp()
    return q.gather(-1, tokens).squeeze(-1).log(), torch.special.entr(q).sum(-1), q.max(-1).values


def draft_step_stats(
    logits: torch.Tensor, q: torch.Tensor, token: int, greedy: bool, spread: bool = True
) -> tuple[float, float, float]:
    """:func:`draft_stats` of one draft step: its logits (V,), the transformed distribution q (V,) and the candidate
    drawn from it → (log q(y), entropy, top-1 probability) as floats. Without ``spread`` only log q(y) is computed
    and the entropy and top-1 are NaN: a caller whose head reads neither skips their passes over the vocabulary."""
    # :func:`draft_stats` on one row, in fewer kernel calls (a step pays each call's dispatch): the same numbers.
    if greedy:
        log_q = logits.float().log_softmax(-1)
        if not spread:
            return float(log_q[token]), math.nan, math.nan
        numbers = torch.stack((log_q[token], torch.special.entr(log_q.exp()).sum(-1), log_q.max().exp()))
    else:
        if not spread:
            return float(q[token].log()), math.nan, math.nan
        numbers = torch.stack((q[token].log(), torch.special.entr(q).sum(-1), q.max()))
    logq, entropy, top1 = numbers.tolist()  # one read back to the host
    return logq, entropy, top1


SPREAD_INPUTS = ("entropy", "top1")
"""The inputs that read q's whole distribution (a pass over the draft's vocabulary per step): a head reading neither
needs only log q(y) of the candidate."""


def path_logq(logq: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Σ_{j≤k} log q_j(y_j) within each round: logq, step (C,) for candidates listed round after round (``step``
    restarts at 1) → (C,) float32, summed in float64 in order (as the decoder sums its Python floats)."""
    out = torch.empty(len(logq), dtype=torch.float64)
    total = 0.0
    for c, (value, k) in enumerate(zip(logq.double().tolist(), step.tolist())):
        total = value if k == 1 else total + value
        out[c] = total
    return out.float()


def stored_inputs(columns: Mapping[str, Sequence | torch.Tensor], count: int | None = None) -> torch.Tensor:
    """The scalar inputs of C candidates from a rollout dataset's per-candidate lists (:data:`SOURCES`; rows may be
    concatenated, ``step`` restarts every round): (C, len(SCALAR_INPUTS)) float32 in :data:`SCALAR_INPUTS` order,
    NaN in the columns of inputs whose sources are absent (``count``: C, when no column is given)."""
    tensors = {name: torch.as_tensor(values, dtype=torch.float32) for name, values in columns.items()}
    if count is None:
        count = len(next(iter(tensors.values()))) if tensors else 0
    out = torch.full((count, len(SCALAR_INPUTS)), float("nan"))
    for i, name in enumerate(SCALAR_INPUTS):
        if not all(column in tensors for column in SOURCE_COLUMNS[name]):
            continue
        if name == "path_logq":
            out[:, i] = path_logq(tensors["draft_logp"], tensors["step"].long())
        else:
            out[:, i] = tensors[SOURCE_COLUMNS[name][0]]
    return out


def dataset_inputs(rollout: bool, column_names: Sequence[str]) -> tuple[str, ...]:
    """The inputs a label dataset holds: the hidden state (stored, or recomputed by the draft from the tokens) and,
    for rollout datasets, every scalar input whose source columns it has."""
    if not rollout:
        return (HIDDEN,)
    present = set(column_names)
    return (HIDDEN, *(name for name in SCALAR_INPUTS if set(SOURCE_COLUMNS[name]) <= present))


def require_inputs(needed: Sequence[str], available: Sequence[str], what: str) -> None:
    """ValueError naming the inputs in ``needed`` that ``available`` lacks (``what``: the data, for the message)."""
    missing = [name for name in needed if name not in available]
    if missing:
        raise ValueError(
            f"The head reads {missing} but {what} holds only {list(available)}: {REGENERATE}, or train a head "
            f"without them (--model.inputs)."
        )


def standardisation(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation per column of ``values`` (M, S); a constant column gets std 1."""
    if values.ndim != 2 or not len(values):
        raise ValueError(f"need at least one row of scalar inputs to standardise, got shape {tuple(values.shape)}.")
    if not torch.isfinite(values).all():
        raise ValueError("the scalar inputs hold NaN or infinite values; regenerate the labels.")
    mean = values.double().mean(0)
    std = values.double().std(0, unbiased=False)
    return mean.float(), torch.where(std > 1e-6, std, torch.ones_like(std)).float()
