"""The stop rules a user could pick instead of a trained head, behind the same interface as FixedK / HeadThreshold.

* :class:`Heuristic` — HF transformers' ``num_assistant_tokens_schedule="heuristic"``: K += 2 after a fully accepted
  round, K −= 1 otherwise.
* :class:`ConfidenceThreshold` — HF's ``assistant_confidence_threshold`` (DISCO's unsupervised variant): stop once
  the draft's probability of the token it just proposed falls below τ; τ can be tuned on (q(y), accepted) pairs with
  HF's ROC rule (:func:`roc_threshold`), offline or online during decoding.
* :class:`PathConfidenceStop` — SpecDec++'s stopping rule with the head ablated: stop once the probability that
  some candidate is rejected, estimated by the draft's own path probability 1 − Π q(y_j), exceeds h (EAGLE-2's path
  confidence, applied to a chain). Training-free.
* :class:`EntropyStop` — AdaEDL (Agrawal, Jeon, Lee 2024): stop once the entropy lower bound on the acceptance
  probability, 1 − sqrt(γ · H(q)), falls below λ. Training-free.
* :class:`Oracle` — the greedy hindsight oracle of SpecDec++ Lemma 2.1: with the target's greedy continuation known,
  stop exactly before every position where the draft's greedy token is wrong, so N_target = |S| + 1 and nothing is
  discarded. The limit any stopping rule can reach for a pair.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..models.features import lm_head_input
from .decoding import DecodeStats, _as_input_ids, autoregressive_generate
from .policies import RoundState, StopPolicy, _check_candidates

UNBOUNDED = 2**31 - 1
"""``max_candidates`` of a policy without a cap of its own (the decoder still stops at the token budget)."""


class Heuristic(StopPolicy):
    """HF assisted generation's ``"heuristic"`` schedule: draft K candidates; K += 2 after a round whose candidates
    were all accepted, K −= 1 (floor 1) otherwise.

    ``persistent=True`` keeps K across generations, like HF's ``"heuristic"`` (which writes K back to the assistant's
    generation config); ``False`` restarts from ``initial_k`` every generation (``"heuristic_transient"``).
    ``initial_k`` defaults to 5, HF's former default (current transformers versions start at 20).
    """

    def __init__(self, initial_k: int = 5, persistent: bool = True, max_candidates: int | None = None) -> None:
        if not isinstance(initial_k, int) or initial_k < 1:
            raise ValueError(f"initial_k={initial_k!r} must be an integer >= 1 (candidates in the first round).")
        cap = UNBOUNDED if max_candidates is None else max_candidates
        _check_candidates(1, cap)
        self.initial_k = initial_k
        self.persistent = persistent
        self.max_candidates = cap
        self.k = min(initial_k, cap)

    def should_stop(self, state: RoundState) -> bool:
        return state.n >= self.k

    def update(self, state: RoundState, accepted: int) -> None:
        if state.n == 0:  # the token budget left no room for candidates: nothing was learned
            return
        # HF: `if num_matches == len(scores[0]) - 1: K += 2 else: K = max(1, K - 1)`.
        self.k = min(self.k + 2, self.max_candidates) if accepted >= state.n else max(1, self.k - 1)

    def reset(self) -> None:
        if not self.persistent:
            self.k = min(self.initial_k, self.max_candidates)

    def describe(self) -> str:
        return f"Heuristic(k0={self.initial_k})"


def roc_threshold(
    probs: Sequence[float] | np.ndarray,
    accepted: Sequence[float] | np.ndarray,
    fn_cost: float = 3.0,
) -> float:
    """HF's auto-tuning of ``assistant_confidence_threshold``: the τ on the ROC curve of (q(y), accepted) pairs that
    minimises fpr + fn_cost · fnr.

    Positives are accepted candidates; a candidate "predicted positive" has q(y) >= τ (drafting continues past it).
    fpr is the share of rejected candidates drafted past (wasted drafts), fnr the share of accepted ones at which
    drafting stopped (lost tokens); HF weighs the latter 3×. Soft labels in [0, 1] (e.g. ``data_gen``'s
    ``accept_prob``) count as ℓ positive and 1 − ℓ negative. May return ``inf`` (always stop) like scikit-learn.

    probs: (N,) draft probabilities of the proposed tokens; accepted: (N,) labels in [0, 1].
    """
    from sklearn.metrics import roc_curve

    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    y = np.asarray(accepted, dtype=np.float64).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(f"probs has {p.size} values but accepted has {y.size}; pass one label per probability.")
    if p.size == 0:
        raise ValueError("roc_threshold needs at least one (probability, label) pair.")
    if ((y < 0) | (y > 1)).any():
        raise ValueError("accepted labels must lie in [0, 1] (1 = accepted, soft labels allowed).")
    if not fn_cost > 0:
        raise ValueError(f"fn_cost={fn_cost} must be > 0 (HF uses 3).")
    positive, negative = y.sum(), (1 - y).sum()
    if positive <= 0 or negative <= 0:
        raise ValueError(
            "roc_threshold needs both accepted and rejected candidates; got only "
            f"{'rejected' if positive <= 0 else 'accepted'} ones. Collect pairs from more rounds."
        )
    truth = np.concatenate([np.ones_like(y), np.zeros_like(y)])
    weight = np.concatenate([y, 1 - y])
    keep = weight > 0  # with hard labels this is exactly HF's roc_curve(matches, probs)
    fpr, tpr, thresholds = roc_curve(truth[keep], np.concatenate([p, p])[keep], sample_weight=weight[keep])
    costs = fpr + fn_cost * (1 - tpr)
    return float(thresholds[int(np.argmin(costs))])


def confidence_pairs_from_dataset(
    path: str | Path, prob_column: str = "draft_logp", label_column: str = "accept_prob"
) -> tuple[np.ndarray, np.ndarray]:
    """(q(y), acceptance) pairs of every labelled position of a ``data_gen`` dataset (one list per prompt).

    ``draft_logp`` is log q_i(Y_i) — from the untransformed softmax when the dataset was made greedy, which is the
    confidence the decoder gives :class:`ConfidenceThreshold` under greedy decoding. A column name containing
    ``logp`` is read as log-probabilities. Returns two flat float64 arrays (M,), (M,).
    """
    from ..acceptance.labels import load_label_dataset

    dataset, _ = load_label_dataset(path)
    for column in (prob_column, label_column):
        if column not in dataset.column_names:
            raise ValueError(
                f"{path} has no column {column!r} (columns: {dataset.column_names}); set prob_column/label_column."
            )
    empty = [np.zeros(0)]
    probs = np.concatenate([np.asarray(row, dtype=np.float64) for row in dataset[prob_column]] or empty)
    labels = np.concatenate([np.asarray(row, dtype=np.float64) for row in dataset[label_column]] or empty)
    if "logp" in prob_column:
        probs = np.exp(probs)
    if probs.shape != labels.shape:
        raise ValueError(f"{path}: {prob_column} and {label_column} hold different numbers of positions.")
    if ((probs < 0) | (probs > 1 + 1e-6)).any():
        raise ValueError(f"{path}: {prob_column} holds values outside [0, 1]; is it a log-probability column?")
    return probs, labels


class ConfidenceThreshold(StopPolicy):
    """Stop once the draft's probability of the candidate it just proposed is below τ (the candidate is still
    submitted), as HF's ``ConfidenceCriteria`` does for ``assistant_confidence_threshold``.

    With ``auto_tune=True`` τ is re-tuned after every round with :func:`roc_threshold` on the (q(y), accepted) pairs
    seen so far in this generation — HF's online rule: the candidates up to and including the first rejection, at
    least ``min_pairs + 1`` pairs and both outcomes — and restarts from the initial τ at each generation.
    Under greedy decoding q(y) is the draft's untempered softmax probability (``uses_confidence``).
    """

    uses_confidence = True

    def __init__(
        self,
        tau: float = 0.4,
        min_candidates: int = 1,
        max_candidates: int = 20,
        auto_tune: bool = False,
        fn_cost: float = 3.0,
        min_pairs: int = 5,
    ) -> None:
        if not tau >= 0:
            raise ValueError(f"tau={tau} must be >= 0 (a probability threshold; 0 never stops early).")
        self.min_candidates, self.max_candidates = _check_candidates(min_candidates, max_candidates)
        self.initial_tau = float(tau)
        self.tau = float(tau)
        self.auto_tune = auto_tune
        self.fn_cost = fn_cost
        self.min_pairs = min_pairs
        self.probs: list[float] = []
        self.matches: list[int] = []

    def should_stop(self, state: RoundState) -> bool:
        return state.n >= max(self.min_candidates, 1) and state.token_probs[-1] < self.tau

    def update(self, state: RoundState, accepted: int) -> None:
        if not self.auto_tune or state.n == 0:
            return
        # HF: every accepted candidate is a match, the first rejected one a miss; later ones were never judged.
        judged = min(accepted + 1, state.n)
        self.probs.extend(state.token_probs[:judged])
        self.matches.extend([1] * accepted + [0] * (judged - accepted))
        if len(self.probs) > self.min_pairs and 0 in self.matches and 1 in self.matches:
            self.tau = roc_threshold(self.probs, self.matches, self.fn_cost)

    def reset(self) -> None:
        self.tau = self.initial_tau
        self.probs, self.matches = [], []

    def describe(self) -> str:
        return f"ConfidenceThreshold(tau={self.initial_tau:g}{', auto' if self.auto_tune else ''})"


class PathConfidenceStop(StopPolicy):
    """SpecDec++'s rule (:class:`~accept_head.chain.policies.HeadThreshold`) with the head ablated: stop once
    1 − Π_{j≤n} q(y_j) > h, the draft's own probabilities of the round's candidates standing in for the head's.

    The product is EAGLE-2's path confidence; as a chain stop rule it is what a trained head has to beat, and it
    needs no head call. Under greedy decoding q(y) is the draft's untempered softmax probability (``uses_confidence``).
    Training-free; tune h on validation prompts.
    """

    uses_confidence = True

    def __init__(self, threshold: float = 0.8, min_candidates: int = 1, max_candidates: int = 20) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold={threshold} must be in (0, 1): it bounds P(some candidate is rejected).")
        self.min_candidates, self.max_candidates = _check_candidates(min_candidates, max_candidates)
        self.threshold = float(threshold)

    def should_stop(self, state: RoundState) -> bool:
        if state.n < max(self.min_candidates, 1):
            return False
        return 1.0 - math.prod(state.token_probs[: state.n]) > self.threshold

    def describe(self) -> str:
        return f"PathConfidenceStop(h={self.threshold:g})"


def entropy_lower_bound(entropy: float, gamma: float) -> float:
    """AdaEDL's approximate lower bound on the acceptance probability of a token drawn from q: 1 − sqrt(γ · H(q)).

    The acceptance probability Σ_x min(p(x), q(x)) equals 1 − TV(p, q); AdaEDL bounds the total variation by a
    square root of a divergence (Pinsker-style) and approximates that unknown divergence by the draft's entropy
    scaled by γ, so the bound needs nothing but the draft's logits.
    """
    return 1.0 - math.sqrt(max(gamma * entropy, 0.0))


class EntropyStop(StopPolicy):
    """AdaEDL-style early draft stopping: stop once 1 − sqrt(γ · H(q_n)) < λ for the candidate just drafted.

    H(q_n) is the entropy (nats) of the draft distribution y_n was drawn from. The rule is checked on the candidate
    already sampled, which is still submitted (as in HF's confidence rule): AdaEDL checks the same entropy before
    sampling and drops that token, but submitting it costs no extra draft pass and can only add accepted tokens.
    For a fixed γ the rule is an entropy threshold H > (1 − λ)² / γ, so sweeping λ covers every γ; AdaEDL's online
    adaptation of λ is not implemented (tune λ on validation prompts instead). Training-free.
    """

    uses_entropy = True

    def __init__(
        self,
        threshold: float = 0.5,
        gamma: float = 0.2,
        min_candidates: int = 1,
        max_candidates: int = 20,
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold={threshold} must be in [0, 1]: it bounds an acceptance probability (λ).")
        if not gamma > 0:
            raise ValueError(f"gamma={gamma} must be > 0 (AdaEDL's entropy scale).")
        self.min_candidates, self.max_candidates = _check_candidates(min_candidates, max_candidates)
        self.threshold = float(threshold)
        self.gamma = float(gamma)

    def should_stop(self, state: RoundState) -> bool:
        if state.n < max(self.min_candidates, 1):
            return False
        return entropy_lower_bound(state.entropies[-1], self.gamma) < self.threshold

    def describe(self) -> str:
        return f"EntropyStop(lambda={self.threshold:g}, gamma={self.gamma:g})"


def teacher_forced_argmax(
    target: torch.nn.Module, draft: torch.nn.Module, sequence: torch.Tensor, n: int
) -> torch.Tensor:
    """The draft's greedy prediction of each of the ``n`` tokens before the last one of ``sequence`` (1, L), reading
    the true prefix (teacher forcing) — for a feature draft, with the target's own features: (n,) on the CPU."""
    from ..models.feature_draft import FeatureDraft

    device = next(draft.parameters()).device
    length = sequence.shape[1]
    if isinstance(draft, FeatureDraft):
        # Pair t reads (f_t, x_{t+1}) and predicts x_{t+2}: tokens L-1-n .. L-2 come from pairs L-3-n .. L-4.
        if length - 3 - n < 0:
            raise ValueError(f"A feature draft needs a prompt of at least 2 tokens to predict {n} tokens.")
        draft.bind(target)
        features = lm_head_input(target, sequence[:, : length - 3].to(device))  # f_0 .. f_{L-4}
        predicted = draft(features, sequence[:, 1 : length - 2].to(device))[0, -n:]
        return draft.full_logits(predicted).argmax(-1).cpu()
    # Logits at positions L-2-n .. L-3 predict tokens L-1-n .. L-2.
    logits = draft(input_ids=sequence[:, :-2].to(device), logits_to_keep=n).logits[0]
    return logits.argmax(-1).cpu()


class Oracle(StopPolicy):
    """The greedy hindsight oracle (SpecDec++ Lemma 2.1) for one prompt.

    S = the positions where the draft's greedy token, teacher-forced on the target's greedy continuation, differs
    from the target's. The oracle drafts while the next position is not in S and stops right before one that is, so
    each round ends with the target writing a token of S (or the final token): N_target = |S| + 1, zero discards.
    S covers all positions but the last generated one, which the target always writes itself.

    Build it with :meth:`from_models`; it is valid only for greedy decoding of that exact prompt.
    """

    requires_greedy = True

    def __init__(self, prompt_length: int, continuation: Sequence[int], mismatches: Iterable[int]) -> None:
        if prompt_length < 1:
            raise ValueError(f"prompt_length={prompt_length} must be >= 1.")
        self.prompt_length = prompt_length
        self.continuation = [int(t) for t in continuation]
        self.mismatches = frozenset(int(p) for p in mismatches)
        self.end = prompt_length + len(self.continuation)
        outside = sorted(p for p in self.mismatches if not prompt_length <= p < self.end - 1)
        if outside:
            raise ValueError(
                f"mismatch positions {outside[:5]} lie outside [{prompt_length}, {self.end - 1}) "
                "(absolute indices of the continuation, last token excluded)."
            )
        self.max_candidates = max(len(self.continuation), 1)

    def limit_stats(self) -> DecodeStats:
        """The counters of decoding with this oracle exactly as Lemma 2.1 defines it: N_target = |S| + 1 rounds,
        one draft step per candidate, zero discards (no timing). Decoding in bf16 can drift from the greedy
        continuation the oracle was built on (verifying several tokens at once may flip a near-tie argmax); these
        counts are the limit itself, free of that drift."""
        # Each run of matching positions is drafted and accepted, and the target writes the mismatch (or the final
        # token) that ends it; 0 candidates in a round that starts on a mismatch.
        rounds, position = [], self.prompt_length
        while position < self.end:
            k = 0
            while position + k < self.end - 1 and position + k not in self.mismatches:
                k += 1
            rounds.append(k)
            position += k + 1
        return DecodeStats(
            generated=len(self.continuation),
            target_calls=len(rounds),
            draft_calls=sum(rounds),
            discarded=0,
            proposed=list(rounds),
            accepted=list(rounds),
        )

    def should_stop(self, state: RoundState) -> bool:
        if state.n == 0 and state.position < self.prompt_length:
            raise ValueError(
                f"This Oracle was built for a prompt of {self.prompt_length} tokens and a {len(self.continuation)}-"
                f"token continuation, but a round starts at position {state.position}; build one per prompt with "
                "Oracle.from_models(...) and the same max_new_tokens."
            )
        # At or past the continuation's last token the target writes alone. Decoding can get there and beyond: in bf16
        # a multi-token verification may flip a near-tie argmax, and the drifted sequence need not end where the
        # greedy continuation did (its counts are not the oracle's anyway: see limit_stats).
        return state.position in self.mismatches or state.position >= self.end - 1

    def describe(self) -> str:
        return "Oracle"

    @classmethod
    @torch.inference_mode()
    def from_models(
        cls,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        prompt_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> Oracle:
        """Run the target greedily on ``prompt_ids`` (1, P) for up to ``max_new_tokens``, teacher-force the draft on
        the result in one pass and collect the mismatch set S."""
        ids = _as_input_ids(prompt_ids)
        prompt_length = ids.shape[1]
        result = autoregressive_generate(target, ids, max_new_tokens, temperature=0.0, eos_token_id=eos_token_id)
        sequence = result.sequences  # (1, P + N)
        continuation = sequence[0, prompt_length:]
        n = continuation.shape[0]
        if n <= 1:
            return cls(prompt_length, continuation.tolist(), ())
        predicted = teacher_forced_argmax(target, draft, sequence, n - 1)
        wrong = torch.nonzero(predicted != continuation[:-1]).reshape(-1)
        return cls(prompt_length, continuation.tolist(), (prompt_length + wrong).tolist())
