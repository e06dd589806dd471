"""Stop policies: when to stop drafting candidates in a speculative round.

Every rule — fixed K, the SpecDec++ head threshold, and the baselines — implements the same small interface so the
decoder treats them alike and benchmarks compare like with like:

* ``should_stop(state)`` is asked before each new candidate, with ``state.n`` candidates drafted so far (0 first);
  returning True submits the current candidates to the target.
* ``score(hidden, state)`` (only for policies with ``uses_hidden`` or ``scores_at_draw``) turns the draft's final
  hidden state at the position whose input is the latest candidate y_n (and, for heads that read them, y_n's scalar
  inputs from ``state``, :func:`round_inputs`) into that candidate's predicted acceptance probability. From the hidden
  state it arrives one step late: after feeding y_n to the draft, the same forward pass yields q_{n+1} and e_n. A
  head that reads the scalars only scores y_n as it is drawn (``scores_at_draw``; ``hidden`` is None).
* ``update(state, accepted)`` is called after verification with the round as it was drafted (``state.n`` candidates
  proposed, their ``token_probs``, ...) and how many of them the target accepted; adaptive schedules learn from it, so
  no policy needs to remember the round itself.

The decoder enforces ``max_candidates`` and the token budget itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..acceptance.head import AcceptanceHead


@dataclass
class RoundState:
    """What a policy may look at while a round is being drafted."""

    n: int = 0
    """Candidates drafted so far in this round."""
    candidates: list[int] = field(default_factory=list)
    """y_1..y_n, the candidates drafted so far."""
    position: int = 0
    """Absolute index (in the full sequence) the next candidate would take."""
    token_probs: list[float] = field(default_factory=list)
    """q_i(y_i): the draft's probability of each candidate it proposed (after the sampling transform). Under greedy
    decoding q_i is one-hot, so for policies with ``uses_confidence`` it is the draft's untempered softmax instead."""
    entropies: list[float] = field(default_factory=list)
    """Entropy (nats) of the draft's distribution q_i each candidate was drawn from (only if ``uses_entropy`` or
    ``uses_draft_stats``; under greedy decoding the entropy of the untempered softmax)."""
    draft_logps: list[float] = field(default_factory=list)
    """log q_i(y_i) (only if ``uses_draft_stats``; under greedy decoding of the untempered softmax), from
    :func:`~accept_head.acceptance.inputs.draft_stats` like the label dataset's ``draft_logp``."""
    top1s: list[float] = field(default_factory=list)
    """max_x q_i(x) (only if ``uses_draft_stats``; under greedy decoding of the untempered softmax)."""
    accept_probs: list[float] = field(default_factory=list)
    """Predicted acceptance probability of candidates 1..n-1 (only for policies with ``uses_hidden``)."""
    copy_below: bool = False
    """A row copied from the text would follow the chain as drafted so far, y_1..y_n (only for policies with
    ``uses_copies``, and only under a decoder that copies: :func:`~accept_head.trees.chain_copies.chain_copy_generate`;
    False elsewhere)."""


def round_inputs(state: RoundState, names: tuple[str, ...]) -> list[float]:
    """The scalar inputs ``names`` (:data:`~accept_head.acceptance.inputs.SCALAR_INPUTS`) of the latest candidate
    y_n of a round being drafted (n = ``state.n``), as the decoder hands them to a head — the twin of
    :func:`~accept_head.acceptance.inputs.stored_inputs`, which reads them from a rollout dataset for training."""
    n, logps = state.n, state.draft_logps
    values = {
        "logq": logps[n - 1],
        "entropy": state.entropies[n - 1],
        "top1": state.top1s[n - 1],
        "depth": float(n),
        "path_logq": sum(logps[:n], 0.0),  # in order, in float64, as the dataset's column is summed
    }
    return [values[name] for name in names]


class StopPolicy:
    """Base class: subclasses override :meth:`should_stop` (and :meth:`score` / :meth:`update` when needed)."""

    max_candidates: int = 20
    uses_hidden: bool = False
    uses_entropy: bool = False
    uses_confidence: bool = False
    """Reads ``token_probs`` as a confidence (the decoder then takes it from the untempered softmax when greedy)."""
    uses_draft_stats: bool = False
    """Reads ``draft_logps``, ``entropies`` and ``top1s`` (the decoder records them only for policies that do)."""
    uses_spread: bool = True
    """With ``uses_draft_stats``: reads ``entropies`` or ``top1s`` too, numbers of q's whole distribution (a pass
    over the draft's vocabulary per step); when False the decoder records them as NaN."""
    scores_at_draw: bool = False
    """Scores each candidate y_n as soon as it is drawn, from its scalar inputs alone (``score(None, state)``):
    a head that reads no hidden state needs no further draft forward, so no candidate is left unscored."""
    requires_greedy: bool = False
    """Only valid for greedy decoding (the decoder raises otherwise)."""
    uses_copies: bool = False
    """Reads ``copy_below`` (a copying decoder then looks the copied row up before each decision)."""

    def should_stop(self, state: RoundState) -> bool:
        raise NotImplementedError

    def score(self, hidden: torch.Tensor, state: RoundState | None = None) -> float:
        """The predicted acceptance probability of the latest candidate y_n of ``state`` from e_n (``hidden``)."""
        raise NotImplementedError(f"{type(self).__name__} does not score hidden states.")

    def update(self, state: RoundState, accepted: int) -> None:
        """Feedback after verification: the round as drafted (``state.n`` candidates proposed) and how many of its
        candidates the target accepted. Stateless policies ignore it."""

    def reset(self) -> None:
        """Forget any cross-round state (called at the start of each generation)."""

    def describe(self) -> str:
        return type(self).__name__


def _check_candidates(min_candidates: int, max_candidates: int) -> tuple[int, int]:
    """(min_candidates, max_candidates) once they are valid bounds on the candidates per round."""
    if min_candidates < 0:
        raise ValueError(f"min_candidates={min_candidates} must be >= 0.")
    if max_candidates < 1:
        raise ValueError(f"max_candidates={max_candidates} must be >= 1.")
    if max_candidates < min_candidates:
        raise ValueError(f"max_candidates={max_candidates} must be >= min_candidates={min_candidates}.")
    return min_candidates, max_candidates


class FixedK(StopPolicy):
    """Draft exactly k candidates per round (speculative decoding as in Leviathan et al. / Chen et al.).

    ``copy_k`` (copying decoders only): stop at ``copy_k`` candidates instead once a row copied from the text would
    follow them (``state.copy_below``) — the copy-aware rule's fixed-length twin (:class:`HeadThreshold`'s
    ``copy_threshold``)."""

    def __init__(self, k: int, copy_k: int | None = None) -> None:
        for name, value in (("k", k), ("copy_k", copy_k)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1 (candidates per round).")
        self.k, self.copy_k = k, copy_k
        self.max_candidates = max(k, copy_k or 0)
        self.uses_copies = copy_k is not None

    def should_stop(self, state: RoundState) -> bool:
        return state.n >= (self.copy_k if self.uses_copies and state.copy_below else self.k)

    def describe(self) -> str:
        extra = f", copy_k={self.copy_k}" if self.uses_copies else ""
        return f"FixedK(k={self.k}{extra})"


UNSCORED = (None, "confidence")


class HeadThreshold(StopPolicy):
    """SpecDec++ (Alg. 2): stop once P(at least one candidate is rejected) = 1 − Π sigmoid(f(e_j)) exceeds h.

    Thm 3.1 shows a threshold on this probability is the optimal stopping rule for the MDP whose costs are the
    discarded draft tokens and the target calls. The head score of y_j arrives one step late, so a round submits
    y_1..y_K where y_K is unscored. ``calibration`` optionally maps raw probabilities to calibrated ones.

    When the decision about drafting past y_n is taken, y_n itself has no score yet, so Alg. 2 cannot stop after
    the first candidate: every round submits at least two. ``unscored="confidence"`` (an extension, not in the
    paper) counts the draft's own probability q_n(y_n) for the unscored candidate instead, so a round can stop at
    one candidate when the draft is unsure.

    A head that reads scalar inputs besides the hidden state (:mod:`accept_head.acceptance.inputs`) gets those of the
    candidate it scores from the round (:func:`round_inputs`): the decoder records them (``uses_draft_stats``). A
    head that reads the scalars only needs nothing of the next draft forward: it scores each candidate as it is drawn
    (``scores_at_draw``), every decision reads every candidate's score, and ``unscored`` changes nothing.

    ``copy_threshold`` (an extension for decoders that copy rows from the text beside the chain,
    :func:`~accept_head.trees.chain_copies.chain_copy_generate`): the threshold that applies instead of h whenever a
    copied row would follow the chain drafted so far (``state.copy_below``). Stopping there hands the tokens after
    y_n to the copy, which costs no draft step and is verified in the same pass, so the next drafted token may be
    worth less than the plain rule prices it; a lower threshold stops sooner there. (On the embedded pair it did not
    pay: ``docs/findings.md`` §8, "A stop rule that knows a copy waits below the chain".)
    """

    def __init__(
        self,
        head: AcceptanceHead,
        threshold: float,
        min_candidates: int = 1,
        max_candidates: int = 20,
        calibration=None,
        unscored: str | None = None,
        copy_threshold: float | None = None,
    ) -> None:
        for name, value in (("threshold", threshold), ("copy_threshold", copy_threshold)):
            if value is not None and not 0.0 < value < 1.0:
                raise ValueError(f"{name}={value} must be in (0, 1): it bounds P(some candidate is rejected).")
        if unscored not in UNSCORED:
            raise ValueError(f"unscored={unscored!r} must be one of {UNSCORED}.")
        self.min_candidates, self.max_candidates = _check_candidates(min_candidates, max_candidates)
        self.head = head
        self.threshold = float(threshold)
        self.copy_threshold = None if copy_threshold is None else float(copy_threshold)
        self.uses_copies = copy_threshold is not None
        self.calibration = calibration
        self.unscored = unscored
        self.uses_confidence = unscored == "confidence"
        self.uses_draft_stats = bool(head.scalar_inputs)
        self.uses_spread = head.reads_spread
        self.uses_hidden = head.reads_hidden
        self.scores_at_draw = not head.reads_hidden
        self._scorer = None

    def reset(self) -> None:
        """A head that reads scalars only is read out as floats (:meth:`AcceptanceHead.scalar_scorer`) once per
        generation: its weights cannot change while the decoder drafts, so no token pays for checking them."""
        self._scorer = self.head.scalar_scorer() if self.head.scores_in_floats else None

    def head_inputs(self, state: RoundState | None) -> list[float] | None:
        """The scalar inputs of ``state``'s latest candidate the head reads (None for the paper's head)."""
        if not self.head.scalar_inputs:
            return None
        if state is None:
            raise ValueError(f"The head reads {list(self.head.scalar_inputs)}: score(hidden, state) needs the round.")
        return round_inputs(state, self.head.scalar_inputs)

    def raw_score(self, hidden: torch.Tensor, state: RoundState | None = None) -> float:
        """The head's probability for the latest candidate of ``state``, before calibration."""
        if self._scorer is not None:  # since reset(): the head as floats
            return self._scorer(self.head_inputs(state))
        with torch.inference_mode():
            return self.head.accept_prob_one(hidden, self.head_inputs(state))

    def score(self, hidden: torch.Tensor, state: RoundState | None = None) -> float:
        prob = self.raw_score(hidden, state)
        return float(self.calibration(prob)) if self.calibration is not None else prob

    def should_stop(self, state: RoundState) -> bool:
        if state.n < max(self.min_candidates, 1):
            return False
        all_accepted = math.prod(state.accept_probs)
        if self.unscored == "confidence":  # candidates the head has not scored yet (the latest one)
            all_accepted *= math.prod(state.token_probs[len(state.accept_probs) : state.n])
        threshold = self.copy_threshold if self.uses_copies and state.copy_below else self.threshold
        return 1.0 - all_accepted > threshold

    def describe(self) -> str:
        extra = f", unscored={self.unscored}" if self.unscored else ""
        extra += f", copy h={self.copy_threshold:g}" if self.uses_copies else ""
        return f"HeadThreshold(h={self.threshold:g}{extra})"
