"""The one engine that runs decoding methods over prompts: every stop policy, HF's assisted generation, the
learning-free tree decoders (N-Grammys, Lookahead, Ouroboros), the target alone, and the hindsight oracle.

A :class:`MethodSpec` names one method and its parameters (``{kind: fixed_k, params: {k: 4}}``) and, as data, the
role it plays in a comparison; a :class:`PolicyGrid` expands a parameter grid into specs; :class:`Runner` turns specs
into decoders for one pair and one sampling setting, and :func:`run_interleaved` decodes prompts with several methods
in the order A B C … A B C …, so slow drifts of the machine hit every method alike, every method with the same
per-prompt seeds; :func:`summarize` pools each method's :class:`~accept_head.chain.decoding.DecodeStats` and prices them
with the cost model. The end-of-fit threshold sweep (:mod:`accept_head.engine.sweep`) and every ``python -m eval``
command
decode through it.
"""

from __future__ import annotations

import inspect
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ..acceptance.calibration import Calibration
from ..acceptance.head import AcceptanceHead
from ..chain.baselines import ConfidenceThreshold, EntropyStop, Heuristic, Oracle, PathConfidenceStop
from ..chain.decoding import DecodeStats, GenerationResult, autoregressive_generate, speculative_generate
from ..chain.hf_assisted import AssistedSettings, HFAssisted
from ..chain.policies import FixedK, HeadThreshold, StopPolicy
from ..core.costs import CostModel, TreeCost
from ..core.prompts import EncodedPrompt
from ..core.seeds import seeded_generator
from ..learning_free.lookahead import check_lookahead_params, lookahead_generate
from ..learning_free.ngrammys import ModelBigram, check_ngrammys_params, ngrammys_generate
from ..learning_free.ouroboros import check_ouroboros_params, ouroboros_generate
from ..models.pairs import cache_root
from ..models.static_target import check_runtime
from ..trees.attention import check_masked_attention
from ..trees.chain_copies import chain_copy_generate
from ..trees.decoding import tree_generate
from ..trees.growth import ConfidenceTree, CostTree, HeadTree, StaticTree, TreeRule
from ..trees.labels import C2TTree, TreeModels
from ..trees.verify import TreeDecodeStats
from .pair_loading import Pair

FAMILIES = {
    "autoregressive": "Autoregressive",
    "fixed_k": "FixedK",
    "specdecpp": "SpecDec++",
    "heuristic": "Heuristic",
    "confidence": "ConfidenceThreshold",
    "entropy": "EntropyStop",
    "path_confidence": "path confidence",
    "hf_assisted": "HF assisted",
    "ngrammys": "N-Grammys",
    "lookahead": "Lookahead",
    "ouroboros": "Ouroboros",
    "oracle": "Oracle",
    "head_tree": "SpecDec++ tree",
    "confidence_tree": "EAGLE-2 tree",
    "static_tree": "static tree",
    "c2t_tree": "C2T tree",
    "cost_tree": "cost tree",
}
"""Method kinds and their display names."""

DRAFT_TREES = ("head_tree", "confidence_tree", "static_tree", "c2t_tree", "cost_tree")
"""Methods that draft a token tree with the pair's draft each round (:func:`~accept_head.trees.decoding.tree_generate`):
the head's tree (:class:`~accept_head.trees.growth.HeadTree`, the bundle's stored tree settings overridden by the
params; ``head: tree`` scores with the head trained on tree labels, :class:`~accept_head.trees.labels.TreeModels`),
EAGLE-2's (:class:`~accept_head.trees.growth.ConfidenceTree`), a fixed shape
(:class:`~accept_head.trees.growth.StaticTree`), C2T's (:class:`~accept_head.trees.labels.C2TTree`, its classifier
from the runner's ``tree_models``) and the head tree's ablation (:class:`~accept_head.trees.growth.CostTree`: the
same growth by expected tokens per second, every node scored by its draft probability); params are those classes'
keyword arguments."""

CHAIN_RUNTIME_KINDS = (
    "autoregressive",
    "fixed_k",
    "specdecpp",
    "heuristic",
    "confidence",
    "entropy",
    "path_confidence",
)
"""Methods whose target can run over a preallocated, optionally compiled cache (``target_runtime``, :data:`RUNTIMES
<accept_head.models.static_target.RUNTIMES>`): the target alone and the chain rules."""

HEAD_KINDS = ("specdecpp", "head_tree", "c2t_tree")
"""Methods that call a trained acceptance model while drafting (the head, or C2T's classifier): the cost model prices
their draft steps whole; every other method's without the head's measured share (:meth:`~accept_head.core.costs.
CostModel.without_head`)."""

TREE_DECODERS = {"ngrammys": ngrammys_generate, "lookahead": lookahead_generate, "ouroboros": ouroboros_generate}
"""The learning-free decoders that verify many guesses in one target call (:mod:`accept_head.trees.verify`): kind →
decoding function. Their statistics are :class:`~accept_head.trees.verify.TreeDecodeStats`."""

TREE_PARAMS = {
    "ngrammys": ("k", "w", "q", "strategy"),
    "lookahead": ("window", "ngram", "guess_set"),
    "ouroboros": ("gamma", "phrase_length", "phrases_per_token", "candidates"),
}
"""The parameters that define a tree decoder's setting (filled with the library's defaults by :func:`tree_params`,
so a row's name states all of them)."""

_TREE_STATE = ("bigram", "pool")
"""Keyword arguments of the tree decoders that carry state, set by :class:`Runner`, never by a spec."""

ROLES = ("h_star", "h_star_copies")
"""Roles a method can play in a comparison (see :attr:`MethodSpec.role`)."""

_SHORT = {"tau": "τ", "initial_k": "k0", "num_assistant_tokens": "K", "confidence_threshold": "conf"}
_SHORT_BY_KIND = {
    ("specdecpp", "threshold"): "h",
    ("head_tree", "threshold"): "h",
    ("c2t_tree", "threshold"): "h",
    ("cost_tree", "threshold"): "h",
    ("entropy", "threshold"): "λ",
    ("path_confidence", "threshold"): "h",
    ("lookahead", "window"): "W",
    ("lookahead", "ngram"): "N",
    ("lookahead", "guess_set"): "G",
    ("ouroboros", "gamma"): "γ",
    ("ouroboros", "phrase_length"): "β",
    ("ouroboros", "phrases_per_token"): "W",
    ("ouroboros", "candidates"): "K",
}
_BARE = {"strategy"}
"""Parameters whose value reads well alone in a name (``N-Grammys k=10 w=4 q=2 mixed``)."""


@dataclass
class MethodSpec:
    """One decoding method: a kind from :data:`FAMILIES` and the keyword arguments of its policy."""

    kind: str
    """autoregressive, fixed_k, specdecpp, heuristic, confidence, entropy, path_confidence, hf_assisted, ngrammys,
    lookahead, ouroboros, oracle, head_tree, confidence_tree, static_tree, c2t_tree or cost_tree."""
    params: dict[str, Any] = field(default_factory=dict)
    """fixed_k: k. specdecpp: threshold (default: the bundle's h*), min_candidates, max_candidates, calibrated,
    unscored (``confidence``: see :class:`~accept_head.chain.policies.HeadThreshold`).
    heuristic: initial_k, persistent, max_candidates. confidence: tau, auto_tune, min/max_candidates.
    entropy: threshold (λ), gamma, min/max_candidates. path_confidence: threshold (h), min/max_candidates.
    hf_assisted: num_assistant_tokens, schedule,
    confidence_threshold. ngrammys: k rows of w tokens, q (context n-gram query length), strategy (model, context,
    mixed). lookahead: window (W), ngram (N), guess_set (G), context_ngrams, seed. ouroboros: gamma (sentence-draft
    length), phrase_length (β), phrases_per_token (W), candidates (K), prompt_phrases. Keyword arguments of
    :func:`~accept_head.learning_free.ngrammys.ngrammys_generate`,
    :func:`~accept_head.learning_free.lookahead.lookahead_generate` and
    :func:`~accept_head.learning_free.ouroboros.ouroboros_generate`, whose defaults fill what is left out; from code,
    N-Grammys and
    Lookahead also take ``stop``, a :class:`~accept_head.trees.verify.RowStop` object (then give a ``label``).
    fixed_k and the stop rules also take ``context_row``: tokens copied from the text verified beside each chain
    (:func:`~accept_head.trees.chain_copies.chain_copy_generate`).
    Methods with a draft (fixed_k, the stop rules, hf_assisted, ouroboros) also take ``draft``, the name of a
    comparison draft of the pair. autoregressive and oracle take none."""
    label: str | None = None
    """Display name (default: built from kind and params)."""
    role: str | None = None
    """What the method stands for in a comparison, for reports to find it by: ``h_star`` is the bundle's own policy
    (SpecDec++ at h*) on the plain chain, ``h_star_copies`` the same policy with the bundle's copied rows
    (``context_row``, as ``SpecDecPP.generate`` decodes by default). None for every other method."""

    def __post_init__(self) -> None:
        if self.kind not in FAMILIES:
            raise ValueError(f"method kind={self.kind!r} is not one of {sorted(FAMILIES)}.")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"method role={self.role!r} is not one of {ROLES} (or None).")
        self.params = dict(self.params or {})

    @property
    def family(self) -> str:
        return FAMILIES[self.kind]

    @property
    def copies(self) -> bool:
        """A draft-tree or chain setting whose rounds also verify rows copied from the text (``context_row`` > 0;
        a chain method then decodes with :func:`~accept_head.trees.chain_copies.chain_copy_generate`)."""
        return bool(self.params.get("context_row"))

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.kind == "hf_assisted":
            draft = self.params.get("draft")  # a comparison draft's name (Runner resolves it), not an HF setting
            settings = AssistedSettings(**{k: v for k, v in self.params.items() if k != "draft"})
            text = f"HF {settings.schedule} K={settings.num_assistant_tokens}"
            text += f" conf={settings.confidence_threshold:g}" if settings.confidence_threshold else ""
            return text + (f" draft={draft}" if draft is not None else "")
        parts = []
        for key, value in self.params.items():
            if value is None:  # an explicit default (e.g. unscored: null, Alg. 2) needs no mention
                continue
            if key in _BARE:
                parts.append(str(value))
                continue
            short = _SHORT_BY_KIND.get((self.kind, key), _SHORT.get(key, key))
            parts.append(f"{short}={value:.3g}" if isinstance(value, float) else f"{short}={value}")
        return " ".join([self.family, *parts])

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "params": dict(self.params), "name": self.name, "family": self.family}
        return out | ({"role": self.role} if self.role is not None else {})


@dataclass
class PolicyGrid:
    """A method kind and a grid of its parameters; every combination becomes one :class:`MethodSpec`."""

    kind: str
    """Method kind (see :class:`MethodSpec`)."""
    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Parameter name → list of values, e.g. ``{k: [1, 2, 4, 8]}``; fixed parameters are one-element lists."""

    def expand(self) -> list[MethodSpec]:
        if self.kind not in FAMILIES:
            raise ValueError(f"policy grid kind={self.kind!r} is not one of {sorted(FAMILIES)}.")
        for key, values in self.grid.items():
            if not isinstance(values, list | tuple) or not values:
                raise ValueError(f"grid[{key!r}] of {self.kind} must be a non-empty list, got {values!r}.")
        keys = list(self.grid)
        combos = [dict(zip(keys, combo)) for combo in itertools.product(*self.grid.values())]
        if self.kind in TREE_DECODERS:  # checked now, and every setting parameter named in the row
            combos = [tree_params(self.kind, combo) for combo in combos]
        return [MethodSpec(self.kind, combo) for combo in combos]


def expand_grids(grids: Sequence[PolicyGrid | dict]) -> list[MethodSpec]:
    """All specs of several grids, duplicates (same name) dropped."""
    specs, seen = [], set()
    for grid in grids:
        grid = PolicyGrid(**grid) if isinstance(grid, dict) else grid
        for spec in grid.expand():
            if spec.name not in seen:
                seen.add(spec.name)
                specs.append(spec)
    return specs


@dataclass
class PolicyResult:
    """Aggregate of one policy over a prompt set (sums over prompts, then ratios)."""

    name: str
    generated: int
    target_calls: int
    draft_calls: int
    discarded: int
    rounds: int
    seconds: float
    verification_rate: float
    discard_rate: float
    mean_accepted: float
    mean_proposed: float
    tokens_per_second: float
    modeled_tokens_per_second: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def aggregate(name: str, stats: Sequence[DecodeStats], cost_model: CostModel | TreeCost | None = None) -> PolicyResult:
    """Pool the runs of one method (:meth:`DecodeStats.__add__`) and price the pooled counts with ``cost_model``.

    Tree decoders are priced by what they feed the target: a tree decoder's ``proposed`` holds only the winning row,
    but its target call reads every row (and Lookahead's window): a call that fed n tokens is priced like a
    speculative call of n − 1 candidates, t_target(n − 1) (the last committed token plus the candidates), and each of
    Ouroboros' draft forwards at t_draft. N-Grammys and Lookahead make no draft calls; building their guesses is
    counted in the measured time only. Linear t_target(K) is extrapolated past the measured K for wide trees, and the
    cost of the 4D mask is not in it.

    A :class:`~accept_head.core.costs.TreeCost` instead prices every target call at the tokens it fed (tree
    decoders: ``fed``; otherwise the candidates and the last token, 1 for the target alone), plus the measured
    ``draft_time`` (building guesses, drafting).
    """
    total = sum(stats, DecodeStats())
    if cost_model is None:
        modeled = None
    elif isinstance(cost_model, TreeCost):  # run by run
        fed = [getattr(s, "fed", None) or [k + 1 for k in s.proposed] or [1] * s.target_calls for s in stats]
        seconds = sum(sum(map(cost_model, f)) + s.draft_time for f, s in zip(fed, stats))
        modeled = total.generated / max(seconds, 1e-12)
    elif stats and all(isinstance(s, TreeDecodeStats) for s in stats):
        fed = [n - 1 for n in total.fed]
        modeled = cost_model.modeled_tokens_per_second(total.generated, total.draft_calls, fed)
    elif total.proposed:
        modeled = cost_model.modeled_tokens_per_second(total.generated, total.draft_calls, total.proposed)
    else:  # autoregressive: one target call per token, no draft
        modeled = total.generated / (total.target_calls * cost_model.t_target(0)) if total.target_calls else 0.0
    return PolicyResult(
        name=name,
        generated=total.generated,
        target_calls=total.target_calls,
        draft_calls=total.draft_calls,
        discarded=total.discarded,
        rounds=len(total.proposed),
        seconds=total.total_time,
        verification_rate=total.verification_rate,
        discard_rate=total.discard_rate,
        mean_accepted=total.mean_accepted,
        mean_proposed=sum(total.proposed) / max(len(total.proposed), 1),
        tokens_per_second=total.tokens_per_second,
        modeled_tokens_per_second=modeled,
    )


@dataclass
class TrainedHead:
    """What SpecDec++ decodes with before there is a bundle (the end-of-fit sweep, which is choosing h*): the head,
    its calibration and the candidate bounds. :class:`Runner` reads these attributes, and :meth:`h_star` when a
    ``specdecpp`` method leaves out its threshold or ``unscored``; a :class:`~accept_head.specdecpp.bundle.SpecDecPP`
    offers
    the same, with the h* it was exported with."""

    head: AcceptanceHead
    calibration: Calibration | None = None
    min_candidates: int = 2
    max_candidates: int = 20
    greedy_calibration: Calibration | None = None

    def h_star(self, greedy: bool = False) -> tuple[float, str | None]:
        raise ValueError("This head has no h* yet (no bundle): give every specdecpp method a threshold and unscored.")

    def calibration_for(self, greedy: bool = False, tree: bool = False) -> Calibration | None:
        """The map for a decoding mode (the greedy one when there is one), as the bundle's; a head without a bundle
        has no tree calibration, so ``tree`` gets the chain's."""
        return self.greedy_calibration if greedy and self.greedy_calibration is not None else self.calibration


Decoder = Callable[[list[int], torch.Generator], GenerationResult]


def tree_params(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """The parameters of tree decoder ``kind`` (:data:`TREE_DECODERS`), checked and completed: its setting
    (:data:`TREE_PARAMS`) first, left-out values taken from the decoding function's defaults, then any other keyword
    arguments given. Needs no model. Raises ValueError naming an unknown parameter or a bad value."""
    if kind not in TREE_DECODERS:
        raise ValueError(f"method {kind!r} is not a tree decoder ({sorted(TREE_DECODERS)}).")
    signature = inspect.signature(TREE_DECODERS[kind]).parameters
    allowed = {n for n, p in signature.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} - set(_TREE_STATE)
    if kind == "ouroboros":
        allowed.add("draft")  # a comparison draft of the pair (Runner resolves it)
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(f"method {kind!r} does not take parameters {unknown}; it takes {sorted(allowed)}.")
    full = {name: params.get(name, signature[name].default) for name in TREE_PARAMS[kind]}
    full |= {name: value for name, value in params.items() if name not in full}
    stop = full.get("stop")
    if stop is not None and not all(callable(getattr(stop, m, None)) for m in ("start", "select", "observe")):
        raise ValueError(
            f"{kind} parameter stop={stop!r} must be a RowStop object (e.g. AdaptiveRowStop), given from code; a "
            "config cannot build one: leave stop out, or compare the adaptive stop with `python -m eval free_stop`."
        )
    for name, value in full.items():  # flags must be flags: a YAML typo like `context_ngrams: yes please` fails here
        default = signature[name].default if name in signature else None
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ValueError(f"{kind} parameter {name}={value!r} must be true or false.")
    if kind == "ngrammys":
        check_ngrammys_params(full["k"], full["w"], full["q"], full["strategy"])
    elif kind == "lookahead":
        check_lookahead_params(full["window"], full["ngram"], full["guess_set"])
    else:
        check_ouroboros_params(full["gamma"], full["phrase_length"], full["phrases_per_token"], full["candidates"])
    return full


BIGRAM_TOP = 32
"""Successors per token kept in N-Grammys' model-bigram table (more when a setting asks for more rows k)."""


class Runner:
    """Builds decoders for one pair, token budget and sampling setting.

    A decoder keeps its policy object across prompts (adaptive schedules such as ``heuristic`` carry their state over,
    as they would in a server); build a new :class:`Runner` for a fresh start. Oracles are built per prompt, outside
    the timed decoding.

    Tree decoders start every prompt cold: N-Grammys' context n-grams, Lookahead's n-gram pool and Ouroboros' phrase
    pool are built afresh for each prompt, as in the papers' measurements. Unlike Heuristic's K, a pool carried
    across prompts (as a server could carry one) holds text: over the bench's repeats of the same test prompts it
    would hand every later repeat the phrases of its own earlier output. N-Grammys' model bigram belongs to the
    target alone: it is read from ``bigram_cache`` (keyed by the target's fingerprint) or computed and written there
    when the decoder is built, before anything is timed, and shared by every N-Grammys setting of this runner; it
    keeps ``bigram_top`` successors per token (more when a setting asks for more rows k).

    SpecDec++ decodes with ``head``: the pair's bundle unless a :class:`TrainedHead` is given (the end-of-fit sweep,
    before a bundle exists).
    """

    def __init__(
        self,
        pair: Pair,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None = None,
        top_p: float | None = None,
        bigram_cache: str | Path | None = None,
        head: TrainedHead | None = None,
        bigram_top: int = BIGRAM_TOP,
        ignore_eos: bool = False,
        tree_cost: CostModel | None = None,
        tree_models: TreeModels | None = None,
        target_runtime: str = "eager",
    ) -> None:
        check_runtime(target_runtime)
        self.target_runtime = target_runtime
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1.")
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy).")
        self.pair = pair
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.sampling = {"top_k": top_k, "top_p": top_p}
        self.bigram_cache = Path(bigram_cache) if bigram_cache is not None else cache_root() / "bigram"
        self.bigram_top = bigram_top
        self.eos_token_id = None if ignore_eos else pair.eos_token_id
        """What decoding stops on: the pair's EOS ids, or None with ``ignore_eos`` — every method then writes exactly
        ``max_new_tokens`` (as serving benchmarks time it), so tokens/s compares outputs of one length."""
        self.head = head if head is not None else pair.bundle
        """What ``specdecpp`` methods decode with (a :class:`TrainedHead` or a bundle), None if nothing."""
        self.tree_cost = tree_cost
        """The cost model the cost-priced trees (head_tree, c2t_tree) plan with; None: the bundle's."""
        self.tree_models = tree_models
        """What was trained on tree labels (C2T classifiers, tree heads), for c2t_tree and ``head_tree head=tree``."""
        self._oracles: dict[tuple[int, ...], Oracle] = {}
        self._bigrams: dict[int, ModelBigram] = {}

    def supports(self, spec: MethodSpec) -> str | None:
        """Why ``spec`` cannot run here (None if it can). The tree decoders verify losslessly at every temperature
        (greedy matching, or multi-candidate sample verification), so none is refused for its temperature."""
        if spec.kind == "oracle" and self.temperature != 0:
            return "the oracle is defined for greedy decoding only"
        if spec.kind == "specdecpp" and self.head is None:
            return "SpecDec++ needs a bundle with a trained head (--bundle)"
        if spec.kind == "hf_assisted" and not isinstance(
            self.pair.draft_for(spec.params.get("draft")), PreTrainedModel
        ):
            return "HF assisted generation needs a Hugging Face draft model (name a comparison draft)"
        if spec.kind == "head_tree" and self.head is None:
            return "the head's tree needs a bundle with a trained head (--bundle)"
        if spec.kind in ("head_tree", "c2t_tree", "cost_tree") and not self._tree_cost():
            return f"{spec.family} prices nodes with a cost model: give the runner one or use a bundle that has one"
        wants_models = spec.kind == "c2t_tree" or spec.params.get("head") == "tree"
        if spec.kind in DRAFT_TREES and wants_models:
            if self.tree_models is None:
                return f"{spec.name} needs models trained on tree labels (`python -m train.trees`; --tree_models)"
            try:
                (self.tree_models.classifier if spec.kind == "c2t_tree" else self.tree_models.head)(
                    self.temperature == 0
                )
            except ValueError as err:
                return str(err)
        if spec.kind in DRAFT_TREES or spec.kind in TREE_DECODERS:
            models = {"target": self.pair.target}
            if spec.kind == "ouroboros":
                draft = self.pair.draft_for(spec.params.get("draft"))
                if not isinstance(draft, PreTrainedModel):
                    return (
                        f"Ouroboros drafts with a Hugging Face draft model, not a {type(draft).__name__} "
                        "(name a comparison draft)"
                    )
                models["draft"] = draft
            for which, model in models.items():
                try:
                    check_masked_attention(model, which)  # the check the decoder itself makes first
                except ValueError as err:
                    return f"tree verification needs the {which} to take a tree attention mask: {err}"
        return None

    def bigram(self, top: int = BIGRAM_TOP) -> ModelBigram:
        """The target's model-bigram table with ``top`` successors per token: from this runner, else from
        ``bigram_cache``, else computed (V / 512 batched forward passes) and written there."""
        if top not in self._bigrams:
            self._bigrams[top] = ModelBigram.load_or_build(self.pair.target, self.bigram_cache, top)
        return self._bigrams[top]

    def policy(self, spec: MethodSpec) -> StopPolicy:
        """The stop policy of a speculative method (not for autoregressive, oracle or hf_assisted)."""
        params = dict(spec.params)
        try:
            if spec.kind == "fixed_k":
                copy_k = params.pop("copy_k", None)
                return FixedK(int(params.pop("k")), None if copy_k is None else int(copy_k))
            if spec.kind == "specdecpp":
                source = self.head
                if source is None:
                    raise ValueError(self.supports(spec))
                calibrated = bool(params.pop("calibrated", True))
                if "threshold" not in params or "unscored" not in params:  # the mode's h* fills what is left out
                    h, unscored = source.h_star(greedy=self.temperature == 0)
                    params = {"threshold": h, "unscored": unscored} | params
                policy = HeadThreshold(
                    source.head,
                    float(params.pop("threshold")),
                    int(params.pop("min_candidates", source.min_candidates)),
                    int(params.pop("max_candidates", source.max_candidates)),
                    calibration=source.calibration_for(greedy=self.temperature == 0) if calibrated else None,
                    unscored=params.pop("unscored"),
                    copy_threshold=params.pop("copy_threshold", None),
                )
                if params:
                    raise ValueError(f"method 'specdecpp' does not take parameters {sorted(params)}.")
                return policy
            if spec.kind == "heuristic":
                return Heuristic(**params)
            if spec.kind == "confidence":
                return ConfidenceThreshold(**params)
            if spec.kind == "entropy":
                return EntropyStop(**params)
            if spec.kind == "path_confidence":
                return PathConfidenceStop(**params)
        except (KeyError, TypeError) as err:
            raise ValueError(f"bad parameters {spec.params} for method {spec.kind!r}: {err}") from err
        if params:
            raise ValueError(f"method {spec.kind!r} does not take parameters {sorted(params)}.")
        raise ValueError(f"method {spec.kind!r} has no stop policy.")

    def tree_rule(self, spec: MethodSpec) -> TreeRule:
        """The growth rule of a draft-tree method (:data:`DRAFT_TREES`)."""
        params = dict(spec.params)
        try:
            greedy = self.temperature == 0
            if spec.kind == "head_tree":
                settings = {**getattr(self.head, "tree", {}), **params}
                which = settings.pop("head", "chain")
                if which not in ("chain", "tree"):
                    raise ValueError(
                        f"head={which!r} must be 'chain' (the bundle's head) or 'tree' (trained on trees)."
                    )
                if which == "tree":
                    return HeadTree(self.tree_models.head(greedy), self._tree_cost(), **settings)
                drawn = not greedy and settings.get("siblings", "top") == "sampled"  # a chain candidate's label
                calibration = self.head.calibration_for(greedy=greedy, tree=not drawn)
                return HeadTree(self.head.head, self._tree_cost(), calibration=calibration, **settings)
            if spec.kind == "c2t_tree":
                return C2TTree(self.tree_models.classifier(greedy), self._tree_cost(), **params)
            if spec.kind == "cost_tree":  # it calls no head: it plans with the steps it pays for
                cost = self._tree_cost()
                return CostTree(cost.without_head() if cost is not None else None, **params)
            if spec.kind == "confidence_tree":
                return ConfidenceTree(**params)
            if spec.kind == "static_tree":
                return StaticTree(**params)
        except TypeError as err:
            raise ValueError(f"bad parameters {spec.params} for method {spec.kind!r}: {err}") from err
        raise ValueError(f"method {spec.kind!r} does not draft trees.")

    def _tree_cost(self) -> CostModel | None:
        if self.tree_cost is not None:
            return self.tree_cost
        stored = getattr(self.head, "cost_model", None)
        return CostModel.from_dict(stored) if stored else None

    def oracle(self, ids: Sequence[int]) -> Oracle:
        key = tuple(ids)
        if key not in self._oracles:
            self._oracles[key] = Oracle.from_models(  # the oracle of the pair's own draft
                self.pair.target, self.pair.draft, list(ids), self.max_new_tokens, self.eos_token_id
            )
        return self._oracles[key]

    def _decode_oracle(self, ids: Sequence[int], generator: torch.Generator, common: dict) -> GenerationResult:
        """Decode with the prompt's oracle for the wall time; count as Lemma 2.1 does (see :meth:`Oracle.limit_stats`:
        bf16 verification can drift from the greedy continuation the oracle was built on, and the limit is defined
        on that continuation)."""
        oracle = self.oracle(ids)
        result = speculative_generate(
            self.pair.target, self.pair.draft, ids, oracle, self.max_new_tokens, generator=generator, **common
        )
        timed = result.stats
        counts = oracle.limit_stats()
        counts.draft_time, counts.head_time = timed.draft_time, timed.head_time
        counts.target_time, counts.total_time = timed.target_time, timed.total_time
        return GenerationResult(result.sequences, counts)

    def decoder(self, spec: MethodSpec) -> Decoder:
        """A function (prompt ids, generator) → :class:`GenerationResult` running ``spec``."""
        reason = self.supports(spec)
        if reason:
            raise ValueError(f"{spec.name} cannot run at temperature={self.temperature}: {reason}.")
        if spec.kind in TREE_DECODERS:
            return self._tree_decoder(spec)
        target, eos = self.pair.target, self.eos_token_id
        params = dict(spec.params)
        draft = self.pair.draft_for(params.pop("draft", None))
        spec = MethodSpec(spec.kind, params, label=spec.name)
        common = dict(temperature=self.temperature, eos_token_id=eos, **self.sampling)
        if spec.kind in ("autoregressive", "oracle") and spec.params:
            raise ValueError(f"{spec.kind} takes no parameters, got {spec.params}.")
        if self.target_runtime != "eager" and spec.kind not in CHAIN_RUNTIME_KINDS:
            raise ValueError(
                f"{spec.name} runs its target eagerly only; target_runtime={self.target_runtime!r} serves the "
                f"autoregressive and chain methods: leave {spec.kind} out of this run or use target_runtime='eager'."
            )
        if spec.kind in CHAIN_RUNTIME_KINDS:
            common["target_runtime"] = self.target_runtime
        if spec.kind == "autoregressive":
            return lambda ids, gen: autoregressive_generate(target, ids, self.max_new_tokens, generator=gen, **common)
        if spec.kind == "hf_assisted":
            try:
                runner = HFAssisted(target, draft, AssistedSettings(**spec.params))
            except TypeError as err:
                raise ValueError(f"bad parameters {spec.params} for hf_assisted: {err}") from err
            return lambda ids, gen: runner.generate(ids, self.max_new_tokens, generator=gen, **common)
        if spec.kind == "oracle":
            return lambda ids, gen: self._decode_oracle(ids, gen, common)
        if spec.kind in DRAFT_TREES:
            rule, budget = self.tree_rule(spec), self.max_new_tokens
            return lambda ids, gen: tree_generate(target, draft, ids, rule, budget, generator=gen, **common)
        copied = int(spec.params.get("context_row") or 0)
        aware = sorted(COPY_AWARE_PARAMS & set(spec.params))
        if aware and not copied:
            raise ValueError(
                f"{spec.name}: {aware} decide by the row copied below the chain, and this chain copies none: give "
                f"it context_row (e.g. 4) or leave {aware} out."
            )
        policy = self.policy(MethodSpec(spec.kind, {k: v for k, v in spec.params.items() if k != "context_row"}))
        if copied:  # the chain plus rows copied from the text: verified as a two-branch tree
            return lambda ids, gen: chain_copy_generate(
                target, draft, ids, policy, self.max_new_tokens, copied, generator=gen, **common
            )
        return lambda ids, gen: speculative_generate(
            target, draft, ids, policy, self.max_new_tokens, generator=gen, **common
        )

    def _tree_decoder(self, spec: MethodSpec) -> Decoder:
        """N-Grammys, Lookahead or Ouroboros with a fresh pool per prompt; N-Grammys' bigram is built here."""
        params = tree_params(spec.kind, spec.params)
        generate, target, budget = TREE_DECODERS[spec.kind], self.pair.target, self.max_new_tokens
        common = dict(temperature=self.temperature, eos_token_id=self.eos_token_id, **self.sampling)
        if spec.kind == "ouroboros":
            draft = self.pair.draft_for(params.pop("draft", None))
            return lambda ids, gen: generate(target, draft, ids, budget, generator=gen, **common, **params)
        if spec.kind == "ngrammys" and params["strategy"] != "context":
            params["bigram"] = self.bigram(max(self.bigram_top, params["k"]))
        return lambda ids, gen: generate(target, ids, budget, generator=gen, **common, **params)


COPY_AWARE_PARAMS = frozenset({"copy_k", "copy_threshold"})
"""Stop-rule parameters that read ``RoundState.copy_below``: only a copying chain (``context_row``) sets it."""


def run_interleaved(
    runner: Runner,
    specs: Sequence[MethodSpec],
    prompts: Sequence[EncodedPrompt],
    seed: int = 0,
    repeats: int = 1,
    warmup: int = 0,
    progress: bool = True,
    desc: str = "decoding",
    outputs: dict[str, list[list[tuple[int, ...]]]] | None = None,
) -> dict[str, list[list[DecodeStats]]]:
    """Decode every prompt with every method of ``runner``, interleaved (A B C … per prompt), ``repeats`` times
    (:func:`run_decoders`); oracles are built before anything is timed. Returns ``{method name: [repeat][prompt]
    DecodeStats]}``."""
    decoders = {spec.name: runner.decoder(spec) for spec in specs}
    for spec in specs:
        if spec.kind == "oracle":
            for prompt in prompts:
                runner.oracle(prompt.ids)
    return run_decoders(decoders, prompts, seed, repeats, warmup, progress, desc, outputs)


def run_decoders(
    decoders: dict[str, Decoder],
    prompts: Sequence[EncodedPrompt],
    seed: int = 0,
    repeats: int = 1,
    warmup: int = 0,
    progress: bool = True,
    desc: str = "decoding",
    outputs: dict[str, list[list[tuple[int, ...]]]] | None = None,
) -> dict[str, list[list[DecodeStats]]]:
    """Decode every prompt with every decoder (name → :data:`Decoder`, e.g. from several runners), interleaved
    (A B C … per prompt), ``repeats`` times.

    Prompt ``index`` of repeat ``r`` decodes with ``seeded_generator(seed, r, index)`` in every method; the first
    ``warmup`` prompts are decoded once by every method beforehand (repeat −1) and not recorded. Returns ``{method
    name: [repeat][prompt] DecodeStats]}``; when ``outputs`` is a dict it is filled the same way with each decode's
    new tokens (for :func:`greedy_identity`).
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1.")
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0.")
    from tqdm.auto import tqdm

    total = len(decoders) * (len(prompts) * repeats + min(warmup, len(prompts)))
    with tqdm(total=total, desc=desc, unit="run", leave=False, disable=not progress) as bar:
        for index, prompt in enumerate(prompts[:warmup]):
            for decode in decoders.values():
                decode(prompt.ids, seeded_generator(seed, -1, index))
                bar.update()
        out: dict[str, list[list[DecodeStats]]] = {name: [] for name in decoders}
        for repeat in range(repeats):
            for name in decoders:
                out[name].append([])
                if outputs is not None:
                    outputs.setdefault(name, []).append([])
            for index, prompt in enumerate(prompts):
                for name, decode in decoders.items():
                    result = decode(prompt.ids, seeded_generator(seed, repeat, index))
                    out[name][repeat].append(result.stats)
                    if outputs is not None:
                        outputs[name][repeat].append(tuple(result.sequences[0, len(prompt.ids) :].tolist()))
                    bar.update()
    return out


def greedy_identity(outputs: dict[str, list[list[tuple[int, ...]]]], reference: str) -> dict[str, dict]:
    """How often each greedy method's output equals the ``reference`` method's (autoregressive) on the same prompt.

    Exact arithmetic would make every lossless method identical; in bf16 a verification pass over several tokens and
    a one-token step can round a near-tie differently, and the texts part from there. Returns ``{method: {"identical":
    decodes with the same tokens, "decodes": n, "first_divergence": [token index of the first difference, per
    differing decode]}}`` for every method but the reference.
    """
    report = {}
    for name, runs in outputs.items():
        if name == reference:
            continue
        pairs = [(a, b) for ref_repeat, repeat in zip(outputs[reference], runs) for a, b in zip(ref_repeat, repeat)]
        divergence = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs if a != b
        ]
        report[name] = {
            "identical": len(pairs) - len(divergence),
            "decodes": len(pairs),
            "first_divergence": divergence,
        }
    return report


@dataclass
class MethodSummary:
    """A method's results over prompts and repeats: tokens/s per repeat plus pooled rates."""

    spec: MethodSpec
    pooled: PolicyResult
    """Sums over all prompts and repeats."""
    per_repeat: list[PolicyResult]
    tree: dict[str, float] | None = None
    """Tree decoders only: ``mean_fed`` (tokens fed to the target per call: the root, every guessed row and, for
    Lookahead, the Jacobi window) and ``mean_rows`` (rows verified per call); Ouroboros adds ``mean_drafted``
    (sentence-draft tokens per round, before lengthening)."""
    per_prompt: list[PolicyResult] = field(default_factory=list)
    """Each test prompt's runs pooled over the repeats, in prompt order (what a prompt bootstrap resamples)."""

    @property
    def tokens_per_target_call(self) -> float:
        """Generated tokens per target call (1 for the target alone; the inverse of the verification rate)."""
        return self.pooled.generated / self.pooled.target_calls if self.pooled.target_calls else 0.0

    @property
    def tokens_per_second(self) -> list[float]:
        return [r.tokens_per_second for r in self.per_repeat]

    @property
    def median_tokens_per_second(self) -> float:
        return statistics.median(self.tokens_per_second)

    def to_dict(self) -> dict:
        tps = self.tokens_per_second
        return {
            **self.spec.to_dict(),
            "tokens_per_second": {
                "min": min(tps),
                "median": statistics.median(tps),
                "max": max(tps),
                "per_repeat": tps,
            },
            "modeled_tokens_per_second": self.pooled.modeled_tokens_per_second,
            "verification_rate": self.pooled.verification_rate,
            "discard_rate": self.pooled.discard_rate,
            "mean_accepted": self.pooled.mean_accepted,
            "mean_proposed": self.pooled.mean_proposed,
            "generated": self.pooled.generated,
            "generated_per_repeat": self.pooled.generated / max(len(self.per_repeat), 1),
            "target_calls": self.pooled.target_calls,
            "tokens_per_target_call": self.tokens_per_target_call,
            "draft_calls": self.pooled.draft_calls,
            "discarded": self.pooled.discarded,
            "rounds": self.pooled.rounds,
            "seconds": self.pooled.seconds,
            "per_prompt_tokens_per_second": [r.tokens_per_second for r in self.per_prompt],
            **(self.tree or {}),
        }


def _tree_means(stats: Sequence[DecodeStats]) -> dict[str, float] | None:
    if not stats or not all(isinstance(s, TreeDecodeStats) for s in stats):
        return None
    total = sum(stats, DecodeStats())
    out = {"mean_fed": statistics.fmean(total.fed or [0]), "mean_rows": statistics.fmean(total.rows or [0])}
    if getattr(total, "drafted", None):
        out["mean_drafted"] = statistics.fmean(total.drafted)
    return out


def summarize(
    specs: Sequence[MethodSpec], runs: dict[str, list[list[DecodeStats]]], cost_model: CostModel | TreeCost | None
) -> list[MethodSummary]:
    """Aggregate each method's runs (per repeat and pooled) under ``cost_model`` (see :func:`aggregate`), a method
    that calls no acceptance head (not in :data:`HEAD_KINDS`) priced without the head's measured share."""
    out = []
    for spec in specs:
        priced = cost_model
        if isinstance(cost_model, CostModel) and spec.kind not in HEAD_KINDS:
            priced = cost_model.without_head()
        repeats = runs[spec.name]
        per_repeat = [aggregate(spec.name, stats, priced) for stats in repeats]
        every = [s for stats in repeats for s in stats]
        per_prompt = [aggregate(spec.name, list(runs_of_prompt), priced) for runs_of_prompt in zip(*repeats)]
        out.append(MethodSummary(spec, aggregate(spec.name, every, priced), per_repeat, _tree_means(every), per_prompt))
    return out


def throughput(summary: MethodSummary, by: str) -> float:
    """Tokens/s of a method: ``modeled`` (cost model, pooled) or ``measured`` (median over repeats)."""
    if by == "modeled":
        value = summary.pooled.modeled_tokens_per_second
        if value is None:
            raise ValueError("No cost model: select by 'measured' or pass --cost_model.")
        return value
    if by == "measured":
        return summary.median_tokens_per_second
    raise ValueError(f"select_by={by!r} must be 'modeled' or 'measured'.")


def best_of(summaries: Sequence[MethodSummary], by: str, kind: str | None = None) -> MethodSummary | None:
    """The highest-throughput summary (of ``kind`` when given), or None if there is none."""
    pool = [s for s in summaries if kind is None or s.spec.kind == kind]
    return max(pool, key=lambda s: throughput(s, by)) if pool else None


def selection_basis(spec: MethodSpec, select_by: str) -> str:
    """The throughput a method competes on when a setting is chosen: ``select_by``, or measured tokens/s for a method
    that decodes with a comparison draft (the cost model prices the pair's own draft only)."""
    return "measured" if "draft" in spec.params else select_by


def choose_settings(summaries: Sequence[MethodSummary], select_by: str) -> list[MethodSpec]:
    """The methods a comparison reports, chosen on validation runs: the best setting of each kind (and, within a kind,
    of each draft it decodes with, and apart for tree settings with and without a ``context_row``, so a bench shows
    what copying adds) by :func:`selection_basis`, plus every method with a role (SpecDec++ at h*), which is kept
    whatever its rank. Order follows ``summaries``."""
    groups: dict[tuple[str, Any, bool], list[MethodSummary]] = {}
    for s in summaries:
        if s.spec.role is None:
            key = (s.spec.kind, s.spec.params.get("draft"), s.spec.copies)
            groups.setdefault(key, []).append(s)
    winners = {id(max(g, key=lambda s: throughput(s, selection_basis(s.spec, select_by)))) for g in groups.values()}
    return [s.spec for s in summaries if s.spec.role is not None or id(s) in winners]


def headroom_share(policy: float, best_fixed_k: float, oracle: float) -> float | None:
    """Share of the oracle's headroom over the best fixed K that a policy captures:
    (policy − best FixedK) / (Oracle − best FixedK) (None when the oracle is no better than fixed K)."""
    gap = oracle - best_fixed_k
    return (policy - best_fixed_k) / gap if gap > 0 else None


def h_star_label(bundle, greedy: bool = False, context_row: int = 0) -> str:
    """Display name of a bundle's own policy in a decoding mode: ``SpecDec++ h*=0.7`` (+ its unscored variant, + the
    rows it copies from the text)."""
    h, unscored = bundle.h_star(greedy)
    label = f"SpecDec++ h*={h:g}" + (f" unscored={unscored}" if unscored else "")
    return label + (f" context_row={context_row}" if context_row else "")


def h_star_spec(bundle, greedy: bool = False, copies: bool = False) -> MethodSpec:
    """The bundle's own policy, SpecDec++ at its h* for the mode (:meth:`SpecDecPP.h_star`), labelled
    (:func:`h_star_label`) and with role ``h_star``; with ``copies``, as ``generate`` decodes it by default: verifying
    the bundle's ``context_row`` tokens copied from the text beside each chain (role ``h_star_copies``)."""
    h, unscored = bundle.h_star(greedy)
    context_row = int(getattr(bundle, "context_row", 0) or 0) if copies else 0
    if copies and not context_row:
        raise ValueError("This bundle copies no rows (context_row 0): there is no h* with copies to decode.")
    params = {"threshold": h, "unscored": unscored} | ({"context_row": context_row} if context_row else {})
    role = "h_star_copies" if copies else "h_star"
    return MethodSpec("specdecpp", params, label=h_star_label(bundle, greedy, context_row), role=role)
