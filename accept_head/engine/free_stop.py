"""Adaptive stopping for the learning-free decoders (N-Grammys, Lookahead): a calibrated predictor of whether each
guessed token will be accepted, trained from the decoders' own verification passes, decides how much of each
guessed row to verify.

The decoders guess rows for free (:mod:`~accept_head.learning_free.ngrammys`: context n-grams and the model bigram;
:mod:`~accept_head.learning_free.lookahead`: the n-gram pool) and verify all of them in one target call. Which rows,
and how deep,
is their static setting (k rows of w tokens; G guesses of N − 1). Here, as SpecDec++ does for a draft model, a
small predictor scores every guessed token instead, and the stop keeps what is worth verifying:

1. *Features* (:class:`GuessFeatures`, all read from what the decoder already holds): the row's source (context
   n-gram, model bigram, pool) crossed with the token's depth in the row; the row's rank within its source; for a
   context row, how many tokens before the copied continuation match the current text (its match length); the
   token's rank among its predecessor's successors in the target's cached bigram table (:class:`~accept_head.
   ngrammys.ModelBigram`); how often the text's own q-gram before the token was followed by it (context n-gram
   agreement: seen, agreement fraction, most recent follower, log count); and whether the previous token of the row
   agreed with the context n-grams or was its predecessor's top bigram successor. The list is
   :data:`FEATURE_NAMES`.
2. *Labels* (:func:`collect_labels`, :class:`LabelRecorder`): the decoder runs on training prompts with a generous
   static setting; after each verification pass every guessed token y_d of every row gets ℓ = p_target(y_d | text,
   y_<d) under the decoding's sampling transform — the target's distribution after the token's parent node, which
   the pass computed anyway. Greedy: ℓ = 1[y_d = argmax], i.e. "accepted, given the row's earlier tokens were"; at
   temperature > 0, the probability that sample verification accepts a lone candidate y_d. This is SpecDec++'s
   label P(y_i accepted | y_<i accepted) with the guess as a point-mass draft (q(y_d) = 1, so min(1, p/q) = p).
   Tokens behind a rejected one are labelled too: the pass conditions each token on its own row's prefix, so its
   label is still the conditional the survival product below needs for every candidate the stop weighs
   (``GuessLabels.prefix`` keeps P(the earlier tokens are accepted) for those who want on-path data only).
3. *Predictor* (:class:`GuessPredictor`): logistic regression (scikit-learn) on those features, soft labels fitted
   as weighted positive/negative copies; calibrated on out-of-fold predictions (folds by prompt) by temperature
   scaling or isotonic regression, whichever has the lower held-out ECE (raw competes too,
   :func:`~accept_head.acceptance.calibration.choose_calibration`). Stored as JSON (coefficients, calibration knots, the
   feature configuration), never pickled. :func:`fit_predictor` collects the labels and fits through the engine.
4. *Stop rule* (:class:`AdaptiveRowStop`): with p̂_d the calibrated acceptance of a row's d-th token, the row
   survives to depth d with probability S_d = Π_{j≤d} p̂_j. The SpecDec++ rule (Alg. 2), applied per row: extend the
   row while P(some candidate of the row is rejected) = 1 − S_d ≤ h, i.e. keep tokens with S_d ≥ 1 − h; h is swept
   on validation prompts. Optionally priced by a measured cost-per-tree-size curve
   (:class:`~accept_head.core.costs.TreeCost`): rows with distinct first tokens cannot both be accepted beyond the
   root, so with greedy verification the expected tokens of a round are 1 + Σ S over the distinct tree prefixes;
   taking tokens in decreasing S (parents before children), the stop keeps the number n that maximises
   (1 + Σ_{i≤n} S_i) / t(fed + n) — tokens per second of this round — where t(·) is the curve and ``fed`` what the
   call feeds besides the rows (the root; Lookahead's window). A token that repeats a prefix another row already
   holds adds no value, and a row left as a prefix of another kept row is dropped. At temperature > 0 candidates
   that share a prefix compete in sample verification, so the survival product is an approximation there.

Lossless by construction: the stop sees only committed text and guesses, chooses a prefix of each row before the
target runs, and the decoders verify whatever they submit exactly as before (greedy matching or sample verification).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..acceptance.calibration import Calibration, apply_calibration, choose_calibration
from ..chain.decoding import _check_int
from ..core.costs import TreeCost
from ..core.prompts import EncodedPrompt
from ..core.sampling import SamplingConfig, probabilities
from ..learning_free.ngrammys import ModelBigram
from ..trees.context import ContextNgrams
from ..trees.verify import RowOrigin
from .runner import MethodSpec, Runner

PREDICTOR_FORMAT = "accept_head.free_stop.predictor/1"

SOURCES = ("context", "model", "pool")
"""Row sources with features (:class:`~accept_head.trees.verify.RowOrigin`)."""

DEPTH_BUCKETS = ((1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (7, None))
RANK_BUCKETS = ((0, 0), (1, 1), (2, 3), (4, None))
MATCH_BUCKETS = ((1, 1), (2, 2), (3, 3), (4, 7), (8, None))
BIGRAM_BUCKETS = ((0, 0), (1, 1), (2, 3), (4, 9), (10, None))
MAX_MATCH = 16
"""Context match lengths are counted up to this many tokens."""
LOG_COUNT_CAP = 255
"""n-gram counts are capped here before log1p(count) / log1p(cap) scales them to [0, 1]."""


def _names(prefix: str, buckets: Sequence[tuple[int, int | None]]) -> list[str]:
    return [
        f"{prefix}={lo}" if lo == hi else f"{prefix}={lo}+" if hi is None else f"{prefix}={lo}-{hi}"
        for lo, hi in buckets
    ]


@functools.cache
def _bucket(value: int, buckets: Sequence[tuple[int, int | None]]) -> int:
    for i, (lo, hi) in enumerate(buckets):
        if value >= lo and (hi is None or value <= hi):
            return i
    return 0  # below the first bucket (a match length under 1 cannot occur)


FEATURE_NAMES: tuple[str, ...] = (
    *[f"{source}:{name}" for source in SOURCES for name in _names("depth", DEPTH_BUCKETS)],
    *_names("rank", RANK_BUCKETS),
    *_names("match", MATCH_BUCKETS),
    *_names("bigram_rank", BIGRAM_BUCKETS),
    "bigram_absent",
    "bigram_unknown",
    "ngram_seen",
    "ngram_agree_frac",
    "ngram_agree_last",
    "ngram_log_count",
    "prev_ngram_agree",
    "prev_bigram_top1",
)
"""One column per feature of a guessed token (one-hot buckets, flags, fractions); see the module docstring."""

_COLUMN = {name: i for i, name in enumerate(FEATURE_NAMES)}
_DEPTH = {s: [_COLUMN[f"{s}:{n}"] for n in _names("depth", DEPTH_BUCKETS)] for s in SOURCES}
_RANK = [_COLUMN[n] for n in _names("rank", RANK_BUCKETS)]
_MATCH = [_COLUMN[n] for n in _names("match", MATCH_BUCKETS)]
_BIGRAM = [_COLUMN[n] for n in _names("bigram_rank", BIGRAM_BUCKETS)]


def match_length(tokens: Sequence[int], start: int, cap: int = MAX_MATCH) -> int:
    """How many tokens before index ``start`` equal the last tokens of ``tokens`` (up to ``cap``): the length of
    the context match behind a continuation copied from ``start``."""
    n, length = len(tokens), 0
    while length < cap and start - 1 - length >= 0 and tokens[start - 1 - length] == tokens[n - 1 - length]:
        length += 1
    return length


class GuessFeatures:
    """Feature vectors of guessed tokens (:data:`FEATURE_NAMES`) from the committed text, the rows and their
    origins; ``bigram`` is the target's cached table (without it the bigram features read ``bigram_unknown``).

    ``q``: length of the text's own n-gram index used for the agreement features (independent of N-Grammys' q);
    ``max_matches``: most recent occurrences read per lookup. Call :meth:`start` with each new prompt: the index
    grows with the text of one generation.
    """

    def __init__(self, bigram: ModelBigram | None = None, q: int = 2, max_matches: int = 16) -> None:
        for name, value in (("q", q), ("max_matches", max_matches)):
            _check_int(name, value)
        self.bigram, self.q, self.max_matches = bigram, q, max_matches
        self.index = ContextNgrams(q)
        self._ranks: dict[int, dict[int, int]] = {}

    @property
    def config(self) -> dict:
        """What a predictor must be used with: the index's ``q`` and ``max_matches``, and the bigram table's ``top``
        and fingerprint (None without one)."""
        return {
            "q": self.q,
            "max_matches": self.max_matches,
            "bigram_top": None if self.bigram is None else self.bigram.top,
            "bigram_fingerprint": None if self.bigram is None else self.bigram.fingerprint,
        }

    def start(self, tokens: Sequence[int]) -> None:
        self.index = ContextNgrams(self.q)
        self.index.update(tokens)

    def successor_ranks(self, token: int) -> dict[int, int]:
        """token → its rank among ``token``'s successors in the bigram table (cached)."""
        ranks = self._ranks.get(token)
        if ranks is None:
            if len(self._ranks) > 16384:
                self._ranks.clear()
            ranks = {t: r for r, t in enumerate(self.bigram.next_tokens[token].tolist())}
            self._ranks[token] = ranks
        return ranks

    def __call__(
        self, tokens: Sequence[int], rows: Sequence[Sequence[int]], origins: Sequence[RowOrigin]
    ) -> np.ndarray:
        """Features (N, F) float32 of every guessed token, rows in order and each row's tokens in order."""
        if len(rows) != len(origins):
            raise ValueError(f"{len(rows)} rows but {len(origins)} origins.")
        self.index.update(tokens)
        n, q = len(tokens), self.q
        out = np.zeros((sum(len(row) for row in rows), len(FEATURE_NAMES)), dtype=np.float32)
        i = 0
        for row, origin in zip(rows, origins):
            if origin.source not in SOURCES:
                raise ValueError(f"row source {origin.source!r} has no features; known sources: {SOURCES}.")
            depth_columns = _DEPTH[origin.source]
            rank_column = _RANK[_bucket(origin.rank, RANK_BUCKETS)]
            match_column = None
            if origin.source == "context":
                match_column = _MATCH[_bucket(match_length(tokens, origin.start), MATCH_BUCKETS)]
            previous, prev_agree, prev_top1 = tokens[-1], 0.0, 0.0
            for d, token in enumerate(row, 1):
                f = out[i]
                f[depth_columns[_bucket(d, DEPTH_BUCKETS)]] = 1.0
                f[rank_column] = 1.0
                if match_column is not None:
                    f[match_column] = 1.0
                top1 = 0.0
                if self.bigram is None:
                    f[_COLUMN["bigram_unknown"]] = 1.0
                else:
                    rank = self.successor_ranks(previous).get(token)
                    if rank is None:
                        f[_COLUMN["bigram_absent"]] = 1.0
                    else:
                        f[_BIGRAM[_bucket(rank, BIGRAM_BUCKETS)]] = 1.0
                        top1 = float(rank == 0)
                # The q tokens before this one (text, then the row's earlier tokens), looked up in the text's index.
                before = row[: d - 1]
                key = tuple(before[-q:]) if len(before) >= q else (*tokens[n - (q - len(before)) :], *before)
                follows = self.index.follows.get(key, []) if len(key) == q else []
                total = len(follows) - (1 if follows and follows[-1] >= n else 0)  # the text's own end has no follower
                followers = [tokens[e] for e in reversed(follows) if e < n][: self.max_matches]
                agree = 0.0
                if followers:
                    agree = float(token in followers)
                    f[_COLUMN["ngram_seen"]] = 1.0
                    f[_COLUMN["ngram_agree_frac"]] = followers.count(token) / len(followers)
                    f[_COLUMN["ngram_agree_last"]] = float(followers[0] == token)
                    f[_COLUMN["ngram_log_count"]] = math.log1p(min(total, LOG_COUNT_CAP)) / math.log1p(LOG_COUNT_CAP)
                f[_COLUMN["prev_ngram_agree"]] = prev_agree
                f[_COLUMN["prev_bigram_top1"]] = prev_top1
                previous, prev_agree, prev_top1 = token, agree, top1
                i += 1
        return out


# ---- labels from verification passes -----------------------------------------------------------------------------


@dataclass
class GuessLabels:
    """Guessed tokens with their features and labels, collected from verification passes.

    ``features`` (N, F) float32; ``labels`` (N,) ℓ ∈ [0, 1] (greedy: 0/1); ``groups`` (N,) the prompt each came
    from (folds never split a prompt); ``depth`` (N,) position in its row (1 = first); ``prefix`` (N,) the product
    of the row's earlier labels, P(the row's earlier tokens are accepted) (greedy: 1 iff they all were);
    ``feature_config``: :attr:`GuessFeatures.config` of the extractor.
    """

    features: np.ndarray
    labels: np.ndarray
    groups: np.ndarray
    depth: np.ndarray
    prefix: np.ndarray
    feature_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.labels)
        if self.features.shape != (n, len(FEATURE_NAMES)):
            raise ValueError(f"features {self.features.shape} must be ({n}, {len(FEATURE_NAMES)}).")
        if not all(len(a) == n for a in (self.groups, self.depth, self.prefix)):
            raise ValueError("features, labels, groups, depth and prefix must all hold one entry per guessed token.")

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def empty(cls, feature_config: dict | None = None) -> GuessLabels:
        return cls(
            np.zeros((0, len(FEATURE_NAMES)), np.float32),
            np.zeros(0),
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0),
            dict(feature_config or {}),
        )


class LabelRecorder:
    """A :class:`~accept_head.trees.verify.RowStop` that verifies every guess whole (the static decoder, unchanged)
    and records each guessed token's features and label after every verification pass (see the module docstring).

    ``group``: the prompt index written with the next records (:func:`collect_labels` sets it).
    """

    def __init__(
        self, features: GuessFeatures, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None
    ) -> None:
        self.features = features
        self.sampling = SamplingConfig(temperature, top_k, top_p)
        self.group = 0
        self._records: list[tuple[np.ndarray, list[float], list[int], list[float], int]] = []

    def start(self, tokens: Sequence[int]) -> None:
        self.features.start(tokens)

    def select(self, tokens, rows, origins, fed: int) -> list[int]:
        return [len(row) for row in rows]

    def observe(self, tokens, rows, origins, nodes, logits: torch.Tensor) -> None:
        if not rows:
            return
        parents = [p for row_nodes in nodes for p in [0, *row_nodes[:-1]]]  # the node each guessed token follows
        chosen = torch.tensor([t for row in rows for t in row])
        labels = probabilities(logits[parents], self.sampling)[torch.arange(len(parents)), chosen].double().tolist()
        depth, prefix, i = [], [], 0
        for row in rows:
            survival = 1.0  # prefix: the product of the row's earlier labels
            for d in range(1, len(row) + 1):
                depth.append(d)
                prefix.append(survival)
                survival *= labels[i]
                i += 1
        self._records.append((self.features(tokens, rows, origins), labels, depth, prefix, self.group))

    def labels(self) -> GuessLabels:
        """Everything recorded so far."""
        if not self._records:
            return GuessLabels.empty(self.features.config)
        return GuessLabels(
            features=np.concatenate([r[0] for r in self._records]),
            labels=np.array([v for r in self._records for v in r[1]], dtype=np.float64),
            groups=np.array([r[4] for r in self._records for _ in r[1]], dtype=np.int64),
            depth=np.array([v for r in self._records for v in r[2]], dtype=np.int64),
            prefix=np.array([v for r in self._records for v in r[3]], dtype=np.float64),
            feature_config=self.features.config,
        )


def collect_labels(
    decode: Callable[[list[int], LabelRecorder], Any],
    prompts: Sequence[Sequence[int]],
    features: GuessFeatures,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> GuessLabels:
    """Run ``decode(prompt_ids, stop)`` on every prompt with a :class:`LabelRecorder` as its stop and return the
    labels of every guessed token, grouped by prompt. ``decode`` must pass ``stop`` to the decoder and decode at
    the same ``temperature`` / ``top_k`` / ``top_p`` as given here (the labels' sampling transform), e.g.
    ``lambda ids, stop: ngrammys_generate(target, ids, 96, 0, bigram=bigram, k=10, w=8, stop=stop)``."""
    recorder = LabelRecorder(features, temperature, top_k, top_p)
    for index, prompt in enumerate(prompts):
        recorder.group = index
        decode(list(prompt), recorder)
    return recorder.labels()


# ---- the predictor ------------------------------------------------------------------------------------------------


def _logistic_regression(x: np.ndarray, labels: np.ndarray, c: float):
    """Logistic regression on soft labels: each row as a positive with weight ℓ and a negative with weight 1 − ℓ."""
    from sklearn.linear_model import LogisticRegression

    xs = np.concatenate([x, x])
    ys = np.concatenate([np.ones(len(x)), np.zeros(len(x))])
    weights = np.concatenate([labels, 1.0 - labels])
    keep = weights > 0
    model = LogisticRegression(C=c, max_iter=1000)
    model.fit(xs[keep], ys[keep], sample_weight=weights[keep])
    return model


@dataclass
class GuessPredictor:
    """Calibrated P(guessed token accepted | the row's earlier tokens were): sigmoid(x·coef + intercept) through
    ``calibration``; fitted by :meth:`fit`, stored by :meth:`save` as JSON."""

    coef: list[float]
    intercept: float
    calibration: Calibration | None = None
    feature_config: dict = field(default_factory=dict)
    """:attr:`GuessFeatures.config` of the features it was fitted on."""
    provenance: dict = field(default_factory=dict)
    """How it was fitted: label counts, the calibration choice and its held-out scores."""

    def __post_init__(self) -> None:
        if len(self.coef) != len(FEATURE_NAMES):
            raise ValueError(f"coef has {len(self.coef)} entries; the features have {len(FEATURE_NAMES)}.")

    @classmethod
    def fit(
        cls,
        labels: GuessLabels,
        c: float = 1.0,
        calibration_methods: Sequence[str] = ("temperature", "isotonic"),
        folds: int = 2,
        seed: int = 0,
    ) -> GuessPredictor:
        """Fit on ``labels``: logistic regression with inverse regularisation ``c``; out-of-fold logits (``folds``
        by prompt, seeded) choose and fit the calibration map; the final regression uses every label."""
        x, y = labels.features.astype(np.float64), labels.labels.astype(np.float64)
        if len(y) == 0:
            raise ValueError("no guessed tokens to fit on: collect labels on more (or longer) prompts.")
        if not (y > 0).any() or not (y < 1).any():
            raise ValueError(
                f"all {len(y)} labels are {'0' if not (y > 0).any() else '1'}: a predictor needs accepted and "
                "rejected guesses; collect labels on more prompts or with a wider static setting."
            )
        if not c > 0:
            raise ValueError(f"c={c} must be > 0.")
        groups = labels.groups
        unique = np.unique(groups)
        fold_of = np.random.default_rng(seed).permutation(len(unique)) % max(folds, 1)
        fold = fold_of[np.searchsorted(unique, groups)]
        oof = np.zeros(len(y))
        cross_fit = folds >= 2 and len(unique) >= folds
        for k in range(folds if cross_fit else 0):
            held = fold == k
            train = ~held
            if not (y[train] > 0).any() or not (y[train] < 1).any():
                cross_fit = False
                break
            oof[held] = _logistic_regression(x[train], y[train], c).decision_function(x[held])
        final = _logistic_regression(x, y, c)
        if not cross_fit:
            oof = final.decision_function(x)
        choice = choose_calibration(
            torch.from_numpy(oof), torch.from_numpy(y), torch.from_numpy(groups), list(calibration_methods), folds, seed
        )
        provenance = {
            "labels": len(y),
            "prompts": len(unique),
            "mean_label": float(y.mean()),
            "c": c,
            "calibration": {"chosen": choice.chosen, "evaluation": choice.evaluation, "scores": choice.scores},
            "out_of_fold": cross_fit,
        }
        return cls(
            coef=[float(v) for v in final.coef_[0]],
            intercept=float(final.intercept_[0]),
            calibration=choice.calibration,
            feature_config=dict(labels.feature_config),
            provenance=provenance,
        )

    def logits(self, features: np.ndarray) -> np.ndarray:
        """Raw logits (N,) of features (N, F)."""
        if features.ndim != 2 or features.shape[1] != len(FEATURE_NAMES):
            raise ValueError(f"features must be (N, {len(FEATURE_NAMES)}); got {features.shape}.")
        return features.astype(np.float64) @ np.asarray(self.coef) + self.intercept

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Calibrated acceptance probabilities (N,) of features (N, F)."""
        raw = 1.0 / (1.0 + np.exp(-np.clip(self.logits(features), -30, 30)))
        if self.calibration is None:
            return raw
        return apply_calibration(self.calibration, torch.from_numpy(raw)).numpy()

    def evaluate(self, labels: GuessLabels) -> dict[str, float]:
        """ECE, Brier, soft AUC and mean prediction vs mean label of this predictor on ``labels`` (e.g. held out)."""
        from ..acceptance.metrics import brier_score, expected_calibration_error, soft_auc

        probs, y = torch.from_numpy(self.predict(labels.features)), torch.from_numpy(labels.labels.astype(np.float64))
        return {
            "n": float(len(y)),
            "ece": expected_calibration_error(probs, y),
            "brier": brier_score(probs, y),
            "auc": soft_auc(probs, y),
            "mean_pred": float(probs.mean()) if len(y) else math.nan,
            "mean_label": float(y.mean()) if len(y) else math.nan,
        }

    def to_dict(self) -> dict:
        return {
            "format": PREDICTOR_FORMAT,
            "feature_names": list(FEATURE_NAMES),
            "coef": list(self.coef),
            "intercept": self.intercept,
            "calibration": None if self.calibration is None else self.calibration.to_dict(),
            "feature_config": dict(self.feature_config),
            "provenance": self.provenance,
        }

    @classmethod
    def from_dict(cls, raw: dict, source: str = "the predictor") -> GuessPredictor:
        if not isinstance(raw, dict) or raw.get("format") != PREDICTOR_FORMAT:
            found = raw.get("format") if isinstance(raw, dict) else None
            raise ValueError(f"{source} is not a guess predictor (format {found!r}, expected {PREDICTOR_FORMAT!r}).")
        missing = [k for k in ("feature_names", "coef", "intercept") if k not in raw]
        if missing:
            raise ValueError(f"{source} lacks {missing}: it was not written by GuessPredictor.save.")
        if list(raw["feature_names"]) != list(FEATURE_NAMES):
            raise ValueError(
                f"{source} was fitted on other features ({len(raw['feature_names'])} named columns, this version "
                f"computes {len(FEATURE_NAMES)}): refit it on labels collected with this version."
            )
        calibration = raw.get("calibration")
        return cls(
            coef=[float(v) for v in raw["coef"]],
            intercept=float(raw["intercept"]),
            calibration=None if calibration is None else Calibration.from_dict(calibration),
            feature_config=dict(raw.get("feature_config") or {}),
            provenance=dict(raw.get("provenance") or {}),
        )

    def save(self, path: str | Path) -> Path:
        """Write JSON (sorted keys, a format version, the feature names); :meth:`load` is its inverse."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> GuessPredictor:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no guess predictor at {path}; write one with GuessPredictor.save(path).")
        return cls.from_dict(json.loads(path.read_text()), source=str(path))

    def features_for(self, bigram: ModelBigram | None) -> GuessFeatures:
        """A :class:`GuessFeatures` configured as the one this predictor was fitted on; raises ValueError if
        ``bigram`` is not the table it was fitted with (missing, or another ``top`` / model)."""
        config = self.feature_config
        wanted = config.get("bigram_fingerprint")
        if wanted is not None and bigram is None:
            raise ValueError(
                "this predictor was fitted with model-bigram features: pass the same table, "
                f"bigram=ModelBigram.load_or_build(target, dir, top={config.get('bigram_top')})."
            )
        if bigram is not None and wanted is None:
            raise ValueError("this predictor was fitted without model-bigram features: pass bigram=None.")
        if bigram is not None and (bigram.fingerprint, bigram.top) != (wanted, config.get("bigram_top")):
            raise ValueError(
                f"this predictor was fitted with the bigram table of model {wanted} (top={config.get('bigram_top')}), "
                f"not this one ({bigram.fingerprint}, top={bigram.top}); refit it or pass the matching table."
            )
        return GuessFeatures(bigram, q=int(config.get("q", 2)), max_matches=int(config.get("max_matches", 16)))


def fit_predictor(
    runner: Runner,
    spec: MethodSpec,
    training: Sequence[EncodedPrompt],
    validation: Sequence[EncodedPrompt],
    q: int = 2,
    c: float = 1.0,
    seed: int = 0,
) -> tuple[GuessPredictor, GuessLabels, dict[str, float]]:
    """Fit a :class:`GuessPredictor` (inverse regularisation ``c``, calibration folds seeded by ``seed``) on the labels
    of tree decoder ``spec`` (N-Grammys or Lookahead, verifying its guesses whole) decoded by ``runner`` over the
    ``training`` prompts, each with generator seed ``seed``; features over ``runner``'s bigram table and a q-gram
    index (``q``). Returns the predictor, its training labels and its scores on labels collected the same way on the
    ``validation`` prompts (:meth:`GuessPredictor.evaluate`)."""
    bigram = runner.bigram(runner.bigram_top)

    def decode(ids: list[int], stop: LabelRecorder):
        labelled = MethodSpec(spec.kind, spec.params | {"stop": stop}, label=spec.name)
        return runner.decoder(labelled)(ids, torch.Generator().manual_seed(seed))

    def labels(prompts: Sequence[EncodedPrompt]) -> GuessLabels:
        ids = [p.ids for p in prompts]
        return collect_labels(decode, ids, GuessFeatures(bigram, q=q), runner.temperature, **runner.sampling)

    train = labels(training)
    predictor = GuessPredictor.fit(train, c=c, seed=seed)
    return predictor, train, predictor.evaluate(labels(validation))


# ---- the stop rule ------------------------------------------------------------------------------------------------


class AdaptiveRowStop:
    """The adaptive stop (module docstring, step 4): keep the guessed tokens whose row survives to them with
    predicted probability ≥ 1 − ``threshold`` (SpecDec++'s h: stop a row once P(some candidate rejected) > h), then,
    with a ``cost`` curve, only as many of them (most likely first) as maximise this round's modeled tokens per
    second. ``threshold=1`` leaves the choice to the cost curve alone.

    ``predictor``: a fitted :class:`GuessPredictor`; ``bigram``: the table it was fitted with (None if none).
    """

    def __init__(
        self,
        predictor: GuessPredictor,
        threshold: float,
        bigram: ModelBigram | None = None,
        cost: TreeCost | None = None,
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 <= threshold <= 1:
            raise ValueError(f"threshold={threshold!r} must be a number in [0, 1] (h of SpecDec++).")
        if cost is not None and not isinstance(cost, TreeCost):
            raise ValueError(f"cost must be a TreeCost (seconds per tokens fed), not a {type(cost).__name__}.")
        self.predictor, self.threshold, self.cost = predictor, float(threshold), cost
        self.features = predictor.features_for(bigram)

    def start(self, tokens: Sequence[int]) -> None:
        self.features.start(tokens)

    def observe(self, tokens, rows, origins, nodes, logits) -> None:
        return None

    def select(self, tokens: Sequence[int], rows: list[list[int]], origins: list[RowOrigin], fed: int) -> list[int]:
        if not rows:
            return []
        probs = self.predictor.predict(self.features(tokens, rows, origins))
        return choose_lengths(rows, probs, self.threshold, self.cost, fed)


def choose_lengths(
    rows: Sequence[Sequence[int]],
    accept: Sequence[float],
    threshold: float,
    cost: TreeCost | None = None,
    fed: int = 1,
) -> list[int]:
    """How many tokens of each row to verify, given each token's predicted acceptance ``accept`` (rows in order,
    flattened): the rule of :class:`AdaptiveRowStop` as a pure function.

    Survival S of a token = product of ``accept`` along its row up to it. Kept: S ≥ 1 − ``threshold``; with
    ``cost``, of those, taken in decreasing S (parents first), the count n maximising (1 + Σ value) / cost(fed + n),
    where a token's value is S unless an earlier row already holds the same prefix (then 0). A row whose kept part
    is a prefix of another kept row is dropped (0).
    """
    guessed = sum(len(row) for row in rows)
    if len(accept) != guessed:
        raise ValueError(f"{len(accept)} acceptance values for {guessed} guessed tokens.")
    floor = 1.0 - threshold - 1e-12  # S ≥ 1 − h up to rounding (1 − 0.7 is 0.30000000000000004)
    candidates = []  # (survival, depth, row, value)
    seen: set[tuple[int, ...]] = set()
    i = 0
    for r, row in enumerate(rows):
        survival = 1.0
        for d in range(1, len(row) + 1):
            survival *= float(accept[i])
            i += 1
            prefix = tuple(row[:d])
            candidates.append((survival, d, r, 0.0 if prefix in seen else survival))
            seen.add(prefix)
    kept = sorted((c for c in candidates if c[0] >= floor), key=lambda c: (-c[0], c[1], c[2]))
    if cost is not None:
        best, best_rate, gain = 0, 1.0 / cost(fed), 1.0
        for n, (_, _, _, value) in enumerate(kept, 1):
            gain += value
            rate = gain / cost(fed + n)
            if rate > best_rate:
                best, best_rate = n, rate
        kept = kept[:best]
    lengths = [0] * len(rows)
    for _, d, r, _ in kept:
        lengths[r] = max(lengths[r], d)
    for r, n in enumerate(lengths):  # a row cut to a prefix of another kept row (or a copy of an earlier one) goes
        covered = (
            s != r and (lengths[s] > n or (lengths[s] == n and s < r)) and list(rows[s][:n]) == list(rows[r][:n])
            for s in range(len(rows))
        )
        if n and any(covered):
            lengths[r] = 0
    return lengths
