"""``python -m eval bench``: every way a user could pick the candidate length, side by side on one pair.

For each temperature: tune what the baselines need on a separate validation set (the best fixed K, EntropyStop's λ,
ConfidenceThreshold's τ by HF's ROC rule, the setting of each learning-free tree decoder — N-Grammys, Lookahead,
Ouroboros — from its grid), then decode the test prompts with every method interleaved (A B C … A B C …, after a
warm-up) for several repeats and report tokens/s (min / median / max over repeats), ratios to the autoregressive
target and to the best fixed K, modeled tokens/s, tokens per target call, verification and discard rates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedModel

from ..chain.baselines import ConfidenceThreshold, confidence_pairs_from_dataset, roc_threshold
from ..chain.decoding import speculative_generate
from ..core.costs import CostModel
from ..core.prompts import PromptOptions, PromptSet, PromptSource, check_disjoint
from ..core.records import machine_info, write_json
from ..core.seeds import seeded_generator
from ..core.tables import text_table
from ..engine.pair_loading import Pair, PairOptions
from ..engine.runner import (
    DRAFT_TREES,
    TREE_DECODERS,
    MethodSpec,
    MethodSummary,
    Runner,
    best_of,
    greedy_identity,
    h_star_spec,
    run_interleaved,
    selection_basis,
    summarize,
    throughput,
    tree_params,
)
from ..models.pairs import ModelSpec
from ..trees.labels import TreeModels
from .common import (
    compare,
    draft_held_out,
    fmt,
    interval_cell,
    output_folder,
    ratios,
    ratios_to,
    resolve_cost_model,
    tokens_per_second_cells,
    with_args_doc,
)
from .plots import bench_plot
from .sweep import run_sweep, temperature_key


@dataclass
class HFSetting:
    """One configuration of HF transformers' assisted generation."""

    num_assistant_tokens: int | None = None
    """Candidates per round (start value for heuristic schedules); None = the best fixed K found on validation."""
    schedule: str = "constant"
    """constant, heuristic or heuristic_transient."""
    confidence_threshold: float = 0.0
    """HF's assistant_confidence_threshold (0 disables it; HF's default is 0.4, auto-tuned during each call)."""


DEFAULT_HF_SETTINGS: list[dict] = [
    {"num_assistant_tokens": None, "schedule": "constant"},
    {"num_assistant_tokens": 5, "schedule": "heuristic"},
    {"num_assistant_tokens": 20, "schedule": "constant", "confidence_threshold": 0.4},
]
"""Constant K at the best fixed K; the heuristic schedule from 5; HF's out-of-the-box default (20 + confidence)."""


def tune_confidence(
    pair: Pair, prompt_set: PromptSet, temperature: float, max_new_tokens: int, seed: int, fn_cost: float = 3.0
) -> tuple[float, int]:
    """τ for ConfidenceThreshold by HF's rule (min fpr + 3·fnr on the ROC) over the (q(y), accepted) pairs that HF's
    online auto-tuning collects while decoding the validation prompts (starting from HF's τ = 0.4)."""
    policy = ConfidenceThreshold(tau=0.4, auto_tune=True, fn_cost=fn_cost)
    probs: list[float] = []
    matches: list[int] = []
    for index, prompt in enumerate(prompt_set.prompts):
        generator = seeded_generator(seed, 0, index)
        speculative_generate(
            pair.target,
            pair.draft,
            prompt.ids,
            policy,
            max_new_tokens,
            temperature,
            eos_token_id=pair.eos_token_id,
            generator=generator,
        )
        probs += policy.probs
        matches += policy.matches
    if 0 not in matches or 1 not in matches:
        return 0.4, len(probs)  # no rejection (or no acceptance) seen: keep HF's start value
    return roc_threshold(probs, matches, fn_cost), len(probs)


def tree_settings(grids: dict[str, Sequence[dict] | None]) -> dict[str, list[dict]]:
    """The tree decoders' grids (kind → list of parameter dicts; None or [] leaves a kind out), each setting checked
    and completed by :func:`~accept_head.engine.runner.tree_params`. Needs no model. Raises ValueError naming the grid
    entry
    and the bad value."""
    out: dict[str, list[dict]] = {}
    for kind, grid in grids.items():
        if kind not in TREE_DECODERS:
            raise ValueError(f"{kind!r} is not a tree decoder ({sorted(TREE_DECODERS)}).")
        settings = []
        for index, params in enumerate(grid or []):
            if not isinstance(params, dict):
                raise ValueError(f"{kind}[{index}]={params!r} must be a mapping of parameters, e.g. {{k: 10, w: 4}}.")
            try:
                settings.append(tree_params(kind, params))
            except ValueError as err:
                raise ValueError(f"{kind}[{index}]: {err}") from err
        if settings:
            out[kind] = settings
    return out


def draft_tree_specs(grids: dict[str, Sequence[dict] | None]) -> list[MethodSpec]:
    """The specs of the draft-tree grids (kind → list of parameter dicts, see :func:`bench`). Needs no model; raises
    ValueError naming a kind that does not draft trees or an entry that is not a mapping."""
    specs = []
    for kind, grid in grids.items():
        if kind not in DRAFT_TREES:
            raise ValueError(f"draft_trees: {kind!r} is not a draft-tree method ({', '.join(DRAFT_TREES)}).")
        for index, params in enumerate(grid or []):
            if not isinstance(params, dict):
                raise ValueError(f"draft_trees.{kind}[{index}]={params!r} must be a mapping, e.g. {{threshold: 0.5}}.")
            specs.append(MethodSpec(kind, dict(params)))
    return specs


def tree_specs(pair: Pair, settings: dict[str, list[dict]]) -> tuple[list[MethodSpec], list[dict[str, str]]]:
    """The specs of :func:`tree_settings`' output for ``pair``, and the kinds that cannot run on it with the reason.
    Ouroboros drafts with the pair's draft when it is a Hugging Face model, else with the comparison draft
    ``standalone``."""
    specs: list[MethodSpec] = []
    skipped: list[dict[str, str]] = []
    for kind, grid in settings.items():
        draft: dict[str, str] = {}
        if kind == "ouroboros" and not isinstance(pair.draft, PreTrainedModel):
            if "standalone" not in pair.comparison_drafts:
                reason = (
                    f"Ouroboros needs a Hugging Face draft and the pair's is a {type(pair.draft).__name__}; "
                    "give a comparison_draft"
                )
                skipped.append({"kind": kind, "reason": reason})
                continue
            draft = {"draft": "standalone"}
        specs += [MethodSpec(kind, {**params, **draft}) for params in grid]
    return specs, skipped


def _method_rows(methods: Sequence[dict]) -> list[list[str]]:
    return [
        [
            m["name"],
            *tokens_per_second_cells(m),
            fmt(m["ratio_to_autoregressive"], 2, "x"),
            fmt(m["ratio_to_best_fixed_k"], 2, "x"),
            interval_cell(m.get("ratio_to_best_fixed_k_ci95")),
            fmt(m["modeled_tokens_per_second"]),
            fmt(m.get("generated_per_repeat")),
            fmt(m["tokens_per_target_call"], 2),
            fmt(m["verification_rate"], 3),
            fmt(m["discard_rate"], 3),
            "–" if m["kind"] == "autoregressive" else f"{m['mean_accepted']:.2f}/{m['mean_proposed']:.2f}",
        ]
        for m in methods
    ]


BENCH_HEADER = [
    "method",
    "tok/s",
    "min–max",
    "vs AR",
    "vs best K",
    "95% (prompts)",
    "modeled",
    "tokens",
    "tok/call",
    "verif.",
    "discard",
    "acc/prop",
]


@dataclass
class BenchPlan:
    """:func:`bench`'s parameters (documented in :data:`BENCH_ARGS`), a None default filled in and every value checked
    before any model loads."""

    prompts: list[PromptSource]
    validation_prompts: list[PromptSource]
    pair: PairOptions
    prompt_options: PromptOptions
    max_new_tokens: int
    temperatures: list[float]
    repeats: int
    warmup: int
    fixed_k: list[int]
    entropy_thresholds: list[float]
    entropy_gamma: float
    path_confidence_thresholds: list[float]
    confidence_tau: float | None
    confidence_dataset: str | None
    heuristic_initial_k: int
    hf_settings: list[HFSetting]
    comparison_draft: ModelSpec | None
    ngrammys: list[dict] | None
    lookahead: list[dict] | None
    ouroboros: list[dict] | None
    bigram_cache: str | None
    draft_trees: dict[str, list[dict]] | None
    tree_models: str | None
    stop_rules: bool
    oracle: bool
    select_by: str
    cost_model: str
    seed: int
    output_dir: str
    progress: bool
    ignore_eos: bool
    target_runtime: str
    specdec_thresholds: list[float] | None
    hindsight_k: bool
    chain_context_row: int | None
    chain_copy_ks: list[int] | None
    chain_copy_thresholds: list[float] | None
    tree_grids: dict[str, list[dict]] = field(init=False)
    """The learning-free tree decoders' grids, each setting completed (:func:`tree_settings`)."""
    draft_tree_grid: list[MethodSpec] = field(init=False)
    """The draft-tree settings as specs (:func:`draft_tree_specs`)."""

    def __post_init__(self) -> None:
        """Fill in the defaults; a ValueError names a bad value."""
        self.pair, self.prompt_options = self.pair or PairOptions(), self.prompt_options or PromptOptions()
        self.pair.require_bundle("bench")
        self.temperatures = [0.0, 1.0] if self.temperatures is None else [float(t) for t in self.temperatures]
        self.fixed_k = [1, 2, 3, 4, 6, 8, 10, 12] if self.fixed_k is None else [int(k) for k in self.fixed_k]
        self.entropy_thresholds = (
            [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
            if self.entropy_thresholds is None
            else [float(x) for x in self.entropy_thresholds]
        )
        self.path_confidence_thresholds = (
            [0.5, 0.7, 0.8, 0.9, 0.95, 0.98]
            if self.path_confidence_thresholds is None
            else [float(h) for h in self.path_confidence_thresholds]
        )
        if not all(0 < h < 1 for h in self.path_confidence_thresholds):
            raise ValueError(
                f"path_confidence_thresholds={self.path_confidence_thresholds} must hold values in (0, 1): each "
                "bounds P(some candidate is rejected)."
            )
        given = DEFAULT_HF_SETTINGS if self.hf_settings is None else self.hf_settings
        self.hf_settings = [HFSetting(**s) if isinstance(s, dict) else s for s in given]
        if self.select_by not in ("modeled", "measured"):
            raise ValueError(f"select_by={self.select_by!r} must be 'modeled' or 'measured'.")
        if not self.fixed_k or not self.entropy_thresholds:
            raise ValueError("fixed_k and entropy_thresholds must each hold at least one value.")
        if self.specdec_thresholds is not None:
            self.specdec_thresholds = [float(h) for h in self.specdec_thresholds]
            if not self.specdec_thresholds or not all(0 < h < 1 for h in self.specdec_thresholds):
                raise ValueError(
                    f"specdec_thresholds={self.specdec_thresholds} must hold values in (0, 1), or be null (the "
                    "bundle's own h*)."
                )
        bad = isinstance(self.chain_context_row, bool) or not isinstance(self.chain_context_row, int | None)
        if bad:
            raise ValueError(
                f"chain_context_row={self.chain_context_row!r} must be an integer >= 0 (0: no copies) or null (the "
                "bundle's context_row)."
            )
        if self.chain_context_row is not None and self.chain_context_row < 0:
            raise ValueError(f"chain_context_row={self.chain_context_row} must be >= 0 (0: no copies).")
        self.chain_copy_ks = [int(k) for k in self.chain_copy_ks or []]
        self.chain_copy_thresholds = [float(h) for h in self.chain_copy_thresholds or []]
        if not all(k >= 1 for k in self.chain_copy_ks) or not all(0 < h < 1 for h in self.chain_copy_thresholds):
            raise ValueError(
                f"chain_copy_ks={self.chain_copy_ks} must hold integers >= 1 and chain_copy_thresholds="
                f"{self.chain_copy_thresholds} values in (0, 1)."
            )
        if (self.chain_copy_ks or self.chain_copy_thresholds) and self.chain_context_row == 0:
            raise ValueError(
                "chain_copy_ks and chain_copy_thresholds decide by the row copied below the chain, and "
                "chain_context_row=0 copies none: leave them out or set chain_context_row (e.g. 4)."
            )
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0 (got {self.repeats}, {self.warmup}).")
        self.tree_grids = tree_settings(
            {"ngrammys": self.ngrammys, "lookahead": self.lookahead, "ouroboros": self.ouroboros}
        )
        self.draft_tree_grid = draft_tree_specs(self.draft_trees or {})


@dataclass
class BenchSetup:
    """What :func:`bench` loads once and decodes with at every temperature."""

    pair: Pair
    test_set: PromptSet
    val_set: PromptSet
    cost: CostModel
    cost_source: str
    """Where ``cost`` came from (``bundle``, ``measured`` or a costs.json path)."""
    trees: list[MethodSpec]
    """The tree methods searched on validation: the learning-free decoders the pair can run, then the draft trees."""
    trees_skipped: list[dict[str, str]]
    """The learning-free decoders the pair cannot run, with the reason."""
    runner_options: dict
    """:class:`~accept_head.engine.runner.Runner` options of every decode (the trees' cost model, the tree models)."""
    dataset_tau: float | None
    """τ tuned on ``confidence_dataset`` (None without one, or when ``confidence_tau`` is given)."""
    folder: Path
    """Where bench.json and bench.png go."""
    in_draft_held_out: list[str] = field(default_factory=list)
    """Ids of the test prompts the draft's own recipe held out and chose its checkpoint on
    (:func:`~.common.draft_held_out`): recorded in bench.json, warned about."""


BENCH_ARGS = """
    Args:
        prompts: Test prompt sources (e.g. the ``eval`` hash split of the head's sources, or humaneval).
        validation_prompts: Prompt sources for choosing K, λ and τ; must not overlap the test prompts.
        pair: The pair (its bundle is required).
        prompt_options: How prompts are encoded.
        max_new_tokens: Tokens generated per prompt (at most), the same for every method.
        temperatures: Sampling temperatures; 0 is greedy (the oracle runs only there). Default [0, 1].
        repeats: Timed passes over the test prompts (tokens/s is reported as min / median / max over them).
        warmup: Prompts decoded once by every method before timing (not recorded), on the validation prompts and again
            on the test prompts. A compiled target (``target_runtime: compiled``) compiles each pass width and
            cache-length bucket on first use: give it the number of prompts, or its first decodes time compilation.
        fixed_k: K grid searched on validation (default 1, 2, 3, 4, 6, 8, 10, 12).
        hindsight_k: Also decode every K of ``fixed_k`` on the test prompts and add each method's ratio to the K
            best there (``ratio_to_hindsight_fixed_k``) — a bound no rule can use, since it is chosen on the
            prompts reported; ``ratio_to_best_fixed_k`` stays against the K validation chose.
        chain_context_row: When > 0, FixedK and SpecDec++ also decode with that many tokens copied from the text
            verified beside each chain (:func:`~accept_head.trees.chain_copies.chain_copy_generate`), their K and h
            chosen on validation apart from the plain ones; ``context_row_ratios`` pairs each with its plain twin and
            ``copied_chain_ratio`` is SpecDec++ over FixedK, both with copies. Default (null): the bundle's own
            ``context_row``, so the bench shows what ``generate`` decodes; 0 runs the plain chains only.
        chain_copy_ks: With copies, also search FixedK's copy-aware twin: each K of ``fixed_k`` with each
            ``copy_k`` here (stop at ``copy_k`` candidates when a copied row would follow them; ``FixedK(k,
            copy_k)``). Validation picks among all copying FixedK settings. Default: none.
        chain_copy_thresholds: With copies, also search SpecDec++'s copy-aware rule: each h (the grid's, else h*)
            with each ``copy_threshold`` here (the threshold that applies when a copied row would follow the chain;
            ``HeadThreshold(copy_threshold=)``). Default: none.
        entropy_thresholds: λ grid for EntropyStop searched on validation (default 0.1 … 0.8).
        entropy_gamma: AdaEDL's entropy scale γ.
        path_confidence_thresholds: h grid for PathConfidenceStop, SpecDec++'s rule on the draft's own path
            probability (the head ablated), searched on validation (default 0.5 … 0.98); [] leaves it out.
        confidence_tau: Fixed τ for ConfidenceThreshold; None tunes it by HF's ROC rule (fpr + 3·fnr).
        confidence_dataset: A data_gen dataset to tune τ on (its draft_logp / accept_prob) instead of validation.
        heuristic_initial_k: Start K of the Heuristic schedule (HF used 5 before transformers 4.45).
        hf_settings: HF assisted-generation settings; default: constant at the best K, heuristic from 5, and HF's
            out-of-the-box default (K=20 with confidence threshold 0.4). They run with the pair's draft when it is
            a Hugging Face model, else with ``comparison_draft``.
        comparison_draft: A standalone Hugging Face draft to compare against (e.g. the one a feature draft
            replaced): FixedK rows with it (``draft=standalone``, K chosen on validation) and, when the pair's draft
            is a feature draft, with its pruned vocabulary too (``draft=standalone-pruned``).
        ngrammys: N-Grammys settings searched on validation, e.g. ``[{k: 5, w: 4}, {k: 10, w: 6}]`` (keys: k rows of
            w tokens, q the context n-gram length, strategy model|context|mixed; left-out keys take
            ``ngrammys_generate``'s defaults). None or [] leaves N-Grammys out.
        lookahead: Lookahead settings searched on validation, e.g. ``[{window: 4, ngram: 3, guess_set: 4}]``
            (W, N, G). None or [] leaves Lookahead out.
        ouroboros: Ouroboros settings searched on validation, e.g. ``[{gamma: 4, phrase_length: 4,
            phrases_per_token: 8, candidates: 4}]`` (γ, β, W, K). It drafts with the pair's draft when that is a
            Hugging Face model, else with ``comparison_draft``. None or [] leaves Ouroboros out.
        draft_trees: Draft-tree settings searched on validation, kind → grid, e.g. ``{head_tree: [{threshold:
            null}, {threshold: 0.5}], confidence_tree: [{width: 4, top_k: 4, max_depth: 4, max_nodes: 16}]}`` (kinds:
            head_tree, confidence_tree, static_tree, c2t_tree, cost_tree; params: the keyword arguments of
            :class:`~accept_head.trees.growth.HeadTree` (``head: tree`` for the tree-trained head),
            :class:`~accept_head.trees.growth.ConfidenceTree`, :class:`~accept_head.trees.growth.StaticTree`,
            :class:`~accept_head.trees.labels.C2TTree`, :class:`~accept_head.trees.growth.CostTree`), and for every
            kind ``context_row``, tokens copied from the text into each round's tree
            (:func:`~accept_head.trees.decoding.tree_generate`); settings with and without it are chosen apart and
            compared (``context_row_ratios``). The head's grid over ``threshold`` is its h* sweep for trees, per
            temperature. The cost-priced trees (head, C2T, cost) plan with the bench's ``cost_model``.
        tree_models: Folder written by ``python -m train.trees`` (C2T classifiers and tree-trained heads per mode),
            needed by c2t_tree and ``head: tree``.
        bigram_cache: Folder of N-Grammys' model-bigram tables, keyed by the target's fingerprint; a table missing
            there is computed once (before any timing) and written. Default ``$ACCEPT_HEAD_CACHE/bigram``.
        stop_rules: Include the other stop rules (Heuristic, ConfidenceThreshold, EntropyStop, PathConfidenceStop)
            and their tuning; False keeps the bench to the target, FixedK, SpecDec++, HF and the tree decoders (e.g.
            a tree bench).
        oracle: Include the greedy hindsight oracle (greedy only).
        select_by: Choose the validation winners by ``modeled`` (cost model; robust to machine noise) or
            ``measured`` tokens/s. Tree decoders are priced by the tokens their target calls read (see
            :func:`~accept_head.engine.runner.aggregate`); Ouroboros with a comparison draft, which the cost model does
            not price, is chosen by measured tokens/s, like FixedK with a comparison draft.
        cost_model: ``bundle``, ``measure`` (timed with ``target_runtime``) or a costs.json from ``python -m eval
            costs``; the bundle's, measured with the eager target, warns when another runtime decodes.
        seed: Seed of the prompt shuffle and of every decoding generator.
        output_dir: Folder for bench.json and bench.png.
        progress: Show progress bars.
        ignore_eos: Decode past EOS, so every method writes exactly ``max_new_tokens`` per prompt and tokens/s
            compares outputs of one length (at T > 0 methods otherwise stop at different lengths), as serving
            benchmarks time it. False stops at EOS; the table shows the tokens each method wrote either way.
        target_runtime: ``eager`` (the model's own forward over a growing cache), ``static`` (a preallocated cache)
            or ``compiled`` (that cache under ``torch.compile``; each pass width compiles on first use, in the
            warm-up): :mod:`~accept_head.models.static_target`. Applies to the autoregressive and chain methods;
            leave the others out (``--ngrammys '[]'`` ...) with a non-eager runtime.
        specdec_thresholds: An h grid for SpecDec++ searched on validation (with the bundle's ``unscored`` rule for
            the mode) instead of the bundle's own h*, e.g. when ``target_runtime`` or the machine makes the bundle's
            cost model the wrong price; pair it with ``select_by: measured``. None: the bundle's h*.
    """
"""The ``Args:`` section of :func:`bench`'s docstring, its ``--help`` (attached by
:func:`~accept_head.evaluation.common.with_args_doc`)."""


@with_args_doc(BENCH_ARGS)
def bench(
    prompts: list[PromptSource],
    validation_prompts: list[PromptSource],
    pair: PairOptions | None = None,
    prompt_options: PromptOptions | None = None,
    max_new_tokens: int = 128,
    temperatures: list[float] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    fixed_k: list[int] | None = None,
    entropy_thresholds: list[float] | None = None,
    entropy_gamma: float = 0.2,
    path_confidence_thresholds: list[float] | None = None,
    confidence_tau: float | None = None,
    confidence_dataset: str | None = None,
    heuristic_initial_k: int = 5,
    hf_settings: list[HFSetting] | None = None,
    comparison_draft: ModelSpec | None = None,
    ngrammys: list[dict] | None = None,
    lookahead: list[dict] | None = None,
    ouroboros: list[dict] | None = None,
    bigram_cache: str | None = None,
    draft_trees: dict[str, list[dict]] | None = None,
    tree_models: str | None = None,
    stop_rules: bool = True,
    oracle: bool = True,
    select_by: str = "modeled",
    cost_model: str = "bundle",
    seed: int = 0,
    output_dir: str = "eval_out/bench",
    progress: bool = True,
    ignore_eos: bool = True,
    target_runtime: str = "eager",
    specdec_thresholds: list[float] | None = None,
    hindsight_k: bool = False,
    chain_context_row: int | None = None,
    chain_copy_ks: list[int] | None = None,
    chain_copy_thresholds: list[float] | None = None,
) -> dict:
    """Benchmark SpecDec++ against every simpler way of choosing the candidate length, on the same prompts.

    Methods: the autoregressive target; FixedK at the K best on the validation set; SpecDec++ at the bundle's h*;
    Heuristic (HF's schedule); ConfidenceThreshold at HF's ROC-tuned τ and with HF's online auto-tuning from
    τ = 0.4; EntropyStop (AdaEDL) at the λ best on validation; SpecDec++'s rule with the head ablated
    (PathConfidenceStop) at the h best on validation; HF transformers' own assisted generation
    (``hf_settings``); the learning-free tree decoders N-Grammys, Lookahead and Ouroboros, each at the setting of its
    grid best on validation; and the greedy hindsight Oracle. Writes bench.json and bench.png and prints one table
    per temperature. Needs a bundle (``--bundle``: the pair, the head and h*).
    """
    plan = BenchPlan(**locals())  # every parameter above, checked before any model loads
    setup = load_bench(plan)
    results = {}
    for temperature in plan.temperatures:
        validation = choose_on_validation(plan, setup, temperature)
        specs = bench_methods(plan, setup, temperature, validation)
        results[temperature_key(temperature)] = decode_test_prompts(plan, setup, temperature, specs, validation)
    return write_bench(plan, setup, results)


def load_bench(plan: BenchPlan) -> BenchSetup:
    """Load the tree models, the pair with its comparison drafts and the prompt sets; resolve the cost model and a τ
    tuned on ``confidence_dataset``."""
    tree_models = TreeModels.load(plan.tree_models) if plan.tree_models else None
    folder = output_folder(plan.output_dir)
    pair = plan.pair.load()
    if plan.comparison_draft is not None:
        add_comparison_drafts(pair, ModelSpec.coerce(plan.comparison_draft))
    trees, trees_skipped = tree_specs(pair, plan.tree_grids)
    for skipped in trees_skipped:
        print(f"skipping {skipped['kind']}: {skipped['reason']}")
    test_set = plan.prompt_options.encode("test", plan.prompts, pair.tokenizer, plan.seed)
    val_set = plan.prompt_options.encode("validation", plan.validation_prompts, pair.tokenizer, plan.seed)
    check_disjoint(test_set, val_set)
    in_draft_held_out = draft_held_out(pair, test_set, plan.prompt_options)
    cost, cost_source = resolve_cost_model(plan.cost_model, pair, plan.seed, plan.target_runtime)
    dataset_tau = None
    if plan.confidence_tau is None and plan.confidence_dataset is not None:
        dataset_tau = roc_threshold(*confidence_pairs_from_dataset(plan.confidence_dataset))
    runner_options = {"tree_cost": cost, "tree_models": tree_models, "target_runtime": plan.target_runtime}
    if plan.chain_context_row is None:  # what the bundle's generate decodes
        plan.chain_context_row = int(getattr(pair.bundle, "context_row", 0) or 0)
    trees += with_bundle_tree_settings(plan.draft_tree_grid, pair.bundle)
    return BenchSetup(
        pair,
        test_set,
        val_set,
        cost,
        cost_source,
        trees,
        trees_skipped,
        runner_options,
        dataset_tau,
        folder,
        in_draft_held_out,
    )


def with_bundle_tree_settings(specs: Sequence[MethodSpec], bundle) -> list[MethodSpec]:
    """The draft-tree specs with each ``head_tree`` setting completed by the bundle's own tree settings (what
    ``generate(tree=True)`` grows; the setting's own keys win), so names, selection and comparisons see the
    effective settings — e.g. the bundle's ``context_row``, which ``context_row: 0`` turns off."""
    stored = dict(getattr(bundle, "tree", None) or {})
    return [
        MethodSpec(s.kind, {**stored, **s.params}, s.label, s.role) if s.kind == "head_tree" and stored else s
        for s in specs
    ]


def choose_on_validation(plan: BenchPlan, setup: BenchSetup, temperature: float) -> dict:
    """Run the FixedK, EntropyStop, PathConfidenceStop and tree-decoder grids on the validation prompts and pick the
    best of each, then τ; the ``validation`` record of bench.json.

    Every winner is chosen by ``select_by``, except those that decode with a comparison draft (FixedK, Ouroboros):
    the cost model prices the pair's own draft only, so they are chosen by measured tokens/s.
    """
    pair, select_by = setup.pair, plan.select_by
    entropy_thresholds = plan.entropy_thresholds if plan.stop_rules else []
    path_thresholds = plan.path_confidence_thresholds if plan.stop_rules else []
    specs = [MethodSpec("fixed_k", {"k": k}) for k in plan.fixed_k]
    specs += [MethodSpec("fixed_k", {"k": k, "draft": name}) for name in pair.comparison_drafts for k in plan.fixed_k]
    specs += [MethodSpec("entropy", {"threshold": lam, "gamma": plan.entropy_gamma}) for lam in entropy_thresholds]
    specs += [MethodSpec("path_confidence", {"threshold": h}) for h in path_thresholds]
    specs += specdec_grid(plan, setup, temperature)
    specs += copied_chains(
        specs,
        plan.chain_context_row,
        plan.chain_copy_ks,
        plan.chain_copy_thresholds,
        h_star_spec(pair.bundle, greedy=temperature == 0),
    )
    # run_sweep leaves out, with the reason, what this pair cannot run (only tree decoders can be refused).
    summaries, skipped = run_sweep(
        pair,
        setup.val_set,
        [*specs, *setup.trees],
        temperature,
        plan.max_new_tokens,
        setup.cost,
        plan.seed,
        plan.progress,
        plan.bigram_cache,
        ignore_eos=plan.ignore_eos,
        warmup=plan.warmup,
        **setup.runner_options,
    )
    own = [s for s in summaries if "draft" not in s.spec.params and not s.spec.copies]
    best_k = best_of(own, select_by, "fixed_k")
    best_entropy = best_of(own, select_by, "entropy") if entropy_thresholds else None
    best_path = best_of(own, select_by, "path_confidence") if path_thresholds else None
    by_draft = {}
    for name in pair.comparison_drafts:  # by measured tok/s: the cost model prices the pair's own draft only
        theirs = [s for s in summaries if s.spec.params.get("draft") == name]
        by_draft[name] = int(best_of(theirs, "measured", "fixed_k").spec.params["k"])
    validation = {
        "select_by": select_by,
        "best_k": int(best_k.spec.params["k"]),
        "best_k_by_draft": by_draft,
        "best_entropy_threshold": None if best_entropy is None else float(best_entropy.spec.params["threshold"]),
        "best_path_confidence_threshold": None if best_path is None else float(best_path.spec.params["threshold"]),
        "best_specdec_threshold": (
            float(best_of(own, select_by, "specdecpp").spec.params["threshold"]) if plan.specdec_thresholds else None
        ),
        "tree_decoders": best_tree_settings(summaries, setup.trees, select_by),
        "skipped": setup.trees_skipped + skipped,
        "methods": [
            s.to_dict()
            | {
                "selection_tokens_per_second": throughput(s, selection_basis(s.spec, select_by)),
                "selected_by": selection_basis(s.spec, select_by),
            }
            for s in summaries
        ],
    }
    if plan.chain_context_row:
        validation["chain_context_row"] = best_copied_chains(summaries, select_by, bool(plan.specdec_thresholds))
    if plan.stop_rules:
        validation["confidence"] = choose_tau(plan, setup, temperature)
    return validation


CHAIN_KINDS = ("specdecpp", "fixed_k")
"""The chain methods a bench also runs with copied rows (``chain_context_row``)."""


def copied_chains(
    specs: Sequence[MethodSpec],
    context_row: int,
    copy_ks: Sequence[int] = (),
    copy_thresholds: Sequence[float] = (),
    h_star: MethodSpec | None = None,
) -> list[MethodSpec]:
    """The pair's own FixedK and SpecDec++ settings of ``specs`` again with ``context_row`` copied tokens ([] for 0),
    each also with every ``copy_k`` (FixedK) or ``copy_threshold`` (SpecDec++) of the copy-aware grids. With
    ``copy_thresholds`` and no SpecDec++ among ``specs`` (no h grid), ``h_star`` is the SpecDec++ setting copied."""
    if not context_row:
        return []
    chains = [s for s in specs if s.kind in CHAIN_KINDS and "draft" not in s.params]
    if copy_thresholds and h_star is not None and not any(s.kind == "specdecpp" for s in chains):
        chains.append(h_star)
    out = []
    for s in chains:
        params = {**s.params, "context_row": context_row}
        key, grid = ("copy_k", copy_ks) if s.kind == "fixed_k" else ("copy_threshold", copy_thresholds)
        out += [MethodSpec(s.kind, params)] + [MethodSpec(s.kind, {**params, key: value}) for value in grid]
    return out


def best_copied_chains(summaries: Sequence[MethodSummary], select_by: str, searched_h: bool) -> dict:
    """The K (and, when an h grid was searched, the h) best on validation among the chains with copied rows."""
    copied = [s for s in summaries if s.spec.copies and s.spec.kind in CHAIN_KINDS]
    out = {"context_row": int(copied[0].spec.params["context_row"])}
    fixed_k = best_of(copied, select_by, "fixed_k").spec.params
    out["best_k"] = int(fixed_k["k"])
    if any("copy_k" in s.spec.params for s in copied):  # the copy-aware grid ran: its choice, None for none
        out["best_copy_k"] = fixed_k.get("copy_k")
    specdec = [s for s in copied if s.spec.kind == "specdecpp"]
    if specdec:
        chosen = best_of(specdec, select_by, "specdecpp").spec.params
        if searched_h:
            out["best_specdec_threshold"] = float(chosen["threshold"])
        if any("copy_threshold" in s.spec.params for s in specdec):
            out["best_copy_threshold"] = chosen.get("copy_threshold")
    return out


def specdec_grid(plan: BenchPlan, setup: BenchSetup, temperature: float) -> list[MethodSpec]:
    """SpecDec++ at every h of ``specdec_thresholds`` with the bundle's ``unscored`` rule for the mode ([] when the
    grid is not set: the bundle's own h* decodes)."""
    _, unscored = setup.pair.bundle.h_star(greedy=temperature == 0)
    return [MethodSpec("specdecpp", {"threshold": h, "unscored": unscored}) for h in plan.specdec_thresholds or []]


def copied_chain_methods(setup: BenchSetup, temperature: float, validation: dict) -> list[MethodSpec]:
    """FixedK and SpecDec++ with copied rows at the K and h validation chose for them ([] when none ran)."""
    chosen = validation.get("chain_context_row")
    if not chosen:
        return []
    copies = {"context_row": chosen["context_row"]}
    h_star, unscored = setup.pair.bundle.h_star(greedy=temperature == 0)
    h = chosen.get("best_specdec_threshold", h_star)
    copy_k, copy_h = chosen.get("best_copy_k"), chosen.get("best_copy_threshold")
    return [
        MethodSpec("fixed_k", {"k": chosen["best_k"], **copies} | ({"copy_k": copy_k} if copy_k else {})),
        MethodSpec(
            "specdecpp",
            {"threshold": h, "unscored": unscored, **copies} | ({"copy_threshold": copy_h} if copy_h else {}),
        ),
    ]


def specdec_method(setup: BenchSetup, temperature: float, validation: dict) -> MethodSpec:
    """SpecDec++ as the test prompts decode it: at the h chosen on validation when a grid was searched, else at
    the bundle's own h*."""
    chosen = validation.get("best_specdec_threshold")
    if chosen is None:
        return h_star_spec(setup.pair.bundle, greedy=temperature == 0)
    _, unscored = setup.pair.bundle.h_star(greedy=temperature == 0)
    label = f"SpecDec++ h={chosen:g} (validation)" + (f" unscored={unscored}" if unscored else "")
    return MethodSpec("specdecpp", {"threshold": chosen, "unscored": unscored}, label=label, role="h_star")


def best_tree_settings(summaries: Sequence[MethodSummary], trees: Sequence[MethodSpec], select_by: str) -> dict:
    """Per tree kind searched on validation, its best setting (kind, name, params) and the criterion it was chosen by;
    settings with a copied row (``context_row``) are chosen apart, under ``"<kind> context_row"``."""
    chosen = {}
    for kind in dict.fromkeys(spec.kind for spec in trees):
        for copied in (False, True):
            grid = [s for s in summaries if s.spec.kind == kind and s.spec.copies == copied]
            if grid:  # one draft per kind, so one criterion
                by = selection_basis(grid[0].spec, select_by)
                best = best_of(grid, by)
                key = f"{kind} context_row" if copied else kind
                chosen[key] = {"kind": kind, "name": best.spec.name, "params": dict(best.spec.params), "select_by": by}
    return chosen


def choose_tau(plan: BenchPlan, setup: BenchSetup, temperature: float) -> dict:
    """ConfidenceThreshold's τ — given, tuned on ``confidence_dataset`` or by HF's ROC rule on the validation
    prompts — with where it came from and the (q(y), accepted) pairs it was tuned on."""
    if plan.confidence_tau is not None:
        return {"tau": float(plan.confidence_tau), "source": "given", "pairs": 0}
    if setup.dataset_tau is not None:
        return {"tau": setup.dataset_tau, "source": f"ROC on {plan.confidence_dataset}", "pairs": 0}
    tau, pairs = tune_confidence(setup.pair, setup.val_set, temperature, plan.max_new_tokens, plan.seed)
    return {"tau": tau, "source": "ROC on validation (HF's fpr + 3·fnr)", "pairs": pairs}


def bench_methods(plan: BenchPlan, setup: BenchSetup, temperature: float, validation: dict) -> list[MethodSpec]:
    """The methods decoded on the test prompts at ``temperature``, each at the setting chosen on ``validation``; a
    name given twice (e.g. two HF settings that coincide) runs once."""
    best_k = validation["best_k"]
    specs = [
        MethodSpec("autoregressive"),
        MethodSpec("fixed_k", {"k": best_k}),
        *[MethodSpec("fixed_k", {"k": k, "draft": name}) for name, k in validation["best_k_by_draft"].items()],
        specdec_method(setup, temperature, validation),
        *copied_chain_methods(setup, temperature, validation),
    ]
    if plan.hindsight_k:  # the K grid on the test prompts too, after the rules (the chosen K's row stays second)
        later = [MethodSpec("fixed_k", {"k": k}) for k in plan.fixed_k if k != best_k]
    else:
        later = []
    if plan.stop_rules:
        specs += [
            MethodSpec("heuristic", {"initial_k": plan.heuristic_initial_k}),
            MethodSpec("confidence", {"tau": validation["confidence"]["tau"]}),
            # HF's own rule: start from τ = 0.4 and re-tune it online after every round (fpr + 3·fnr).
            MethodSpec("confidence", {"tau": 0.4, "auto_tune": True}),
            MethodSpec("entropy", {"threshold": validation["best_entropy_threshold"], "gamma": plan.entropy_gamma}),
        ]
        if validation.get("best_path_confidence_threshold") is not None:
            specs.append(MethodSpec("path_confidence", {"threshold": validation["best_path_confidence_threshold"]}))
    specs += hf_assisted_specs(plan.hf_settings, setup.pair, validation)
    # Each tree decoder at the setting its grid chose on validation.
    specs += [MethodSpec(chosen["kind"], chosen["params"]) for chosen in validation["tree_decoders"].values()]
    if plan.oracle and temperature == 0:
        specs.append(MethodSpec("oracle"))
    return list({s.name: s for s in specs + later}.values())


def hf_assisted_specs(settings: Sequence[HFSetting], pair: Pair, validation: dict) -> list[MethodSpec]:
    """HF assisted generation at each setting (K None: the best fixed K of its draft on ``validation``), with the
    pair's draft when it is a Hugging Face model, else with the comparison draft ``standalone``; none without one."""
    hf_draft = None if isinstance(pair.draft, PreTrainedModel) else "standalone"
    specs = []
    for s in settings:
        if hf_draft is not None and hf_draft not in pair.comparison_drafts:
            print(f"skipping HF assisted generation: the pair's draft is a {type(pair.draft).__name__}")
            break
        k_default = validation["best_k"] if hf_draft is None else validation["best_k_by_draft"][hf_draft]
        params = {
            "num_assistant_tokens": k_default if s.num_assistant_tokens is None else s.num_assistant_tokens,
            "schedule": s.schedule,
            "confidence_threshold": s.confidence_threshold,
        }
        if hf_draft is not None:
            params["draft"] = hf_draft
        specs.append(MethodSpec("hf_assisted", params))
    return specs


def decode_test_prompts(
    plan: BenchPlan, setup: BenchSetup, temperature: float, specs: list[MethodSpec], validation: dict
) -> dict:
    """Decode the test prompts with ``specs`` interleaved, ``repeats`` times after the warm-up, and print the table;
    bench.json's result at ``temperature`` (greedy: with each method's identity to autoregressive decoding)."""
    key = temperature_key(temperature)
    runner = Runner(
        setup.pair,
        plan.max_new_tokens,
        temperature,
        bigram_cache=plan.bigram_cache,
        ignore_eos=plan.ignore_eos,
        **setup.runner_options,
    )
    outputs: dict = {}
    prompts = setup.test_set.prompts
    runs = run_interleaved(
        runner,
        specs,
        prompts,
        plan.seed,
        plan.repeats,
        plan.warmup,
        plan.progress,
        desc=f"bench {key}",
        outputs=outputs,
    )
    summaries = summarize(specs, runs, setup.cost)
    methods = _with_ratios(summaries, validation["best_k"])
    result = {"temperature": temperature, "validation": validation, "methods": methods}
    if plan.hindsight_k:
        result["hindsight_k"] = add_hindsight_ratios(summaries, methods, plan.select_by)
    head_tree, copying = head_tree_ratios(summaries), context_row_ratios(summaries)
    if head_tree:
        result["head_tree_ratios"] = head_tree
    if copying:
        result["context_row_ratios"] = copying
    copied = [next((s for s in summaries if s.spec.copies and s.spec.kind == k), None) for k in CHAIN_KINDS]
    if all(copied):
        result["copied_chain_ratio"] = {"name": copied[0].spec.name, "over": copied[1].spec.name} | compare(*copied)
    if temperature == 0:
        result["greedy_identity"] = greedy_identity(outputs, specs[0].name)
        print(_identity_line(result["greedy_identity"]))
    best_k = validation["best_k"]
    ceiling = fixed_k_ceiling(setup.pair, temperature, best_k, setup.cost)
    if ceiling is not None:
        result["ceiling"] = ceiling
        print(
            f"what the draft's measured per-step acceptance and the cost model allow FixedK(k={best_k}): "
            f"{ceiling['expected_speedup']:.2f}x autoregressive (from {ceiling['source']})"
        )
    print(text_table(BENCH_HEADER, _method_rows(methods), title=_title(key, setup.test_set, plan.repeats, validation)))
    if plan.hindsight_k:
        print(_hindsight_line(result["hindsight_k"], methods))
    if head_tree:
        print(_head_tree_line(head_tree))
    for r in copying.values():
        print(f"{r['name']} against {r['without']}: {fmt(r['ratio'], 2, 'x')} ({interval_cell(r['ratio_ci95'])})")
    return result


HEAD_TREE_RIVALS = ("specdecpp", "c2t_tree", "cost_tree", "confidence_tree", "static_tree")
"""What the head's tree is compared with, each by name in bench.json ``head_tree_ratios``: the chain the same head
stops, and the trees grown or scored without it."""


def head_tree_ratios(summaries: Sequence[MethodSummary]) -> dict[str, dict]:
    """The head tree's measured and modeled tokens/s over each rival of :data:`HEAD_TREE_RIVALS` that ran (the
    chain: SpecDec++ at h*), each with its paired prompt-bootstrap 95% interval; {} without a head tree. Trees
    without a copied row (``context_row``) are compared with each other (:func:`context_row_ratios` for the rest)."""
    plain = [s for s in summaries if not s.spec.copies]
    tree = next((s for s in plain if s.spec.kind == "head_tree"), None)
    if tree is None:
        return {}
    out = {}
    for kind in HEAD_TREE_RIVALS:
        rival = next((s for s in plain if s.spec.kind == kind), None)
        if rival is not None:
            out[kind] = {"name": rival.spec.name} | compare(tree, rival)
    return out


def context_row_ratios(summaries: Sequence[MethodSummary]) -> dict[str, dict]:
    """For each tree kind that ran with and without a copied row (``context_row``): the one with over the one without,
    measured and modeled, with paired prompt-bootstrap 95% intervals; {} when no kind ran both."""
    out = {}
    for copied in (s for s in summaries if s.spec.copies):
        kind = copied.spec.kind
        plain = next((s for s in summaries if s.spec.kind == kind and not s.spec.copies), None)
        if plain is not None and kind not in out:
            out[kind] = {"name": copied.spec.name, "without": plain.spec.name} | compare(copied, plain)
    return out


def _head_tree_line(found: dict[str, dict]) -> str:
    """The head tree against each rival (measured, 95%)."""
    parts = [f"{r['name']} {fmt(r['ratio'], 2, 'x')} ({interval_cell(r['ratio_ci95'])})" for r in found.values()]
    return "the head's tree against: " + "; ".join(parts)


def _hindsight_line(hindsight: dict, methods: Sequence[dict]) -> str:
    """The fixed K best on the test prompts in hindsight, and each stop rule's ratio to it (measured, 95%)."""
    parts = [
        f"{m['name']} {fmt(m['ratio_to_hindsight_fixed_k'], 2, 'x')}"
        f" ({interval_cell(m['ratio_to_hindsight_fixed_k_ci95'])})"
        for m in methods
        if m["kind"] not in ("autoregressive", "fixed_k")
    ]
    return f"the best fixed K on these test prompts in hindsight: K={hindsight['k']}; against it: " + "; ".join(parts)


def _identity_line(identity: dict[str, dict]) -> str:
    """How many greedy decodes wrote exactly autoregressive decoding's tokens, naming the methods that did not."""
    same = sum(v["identical"] for v in identity.values())
    total = sum(v["decodes"] for v in identity.values())
    differ = [f"{n} {v['identical']}/{v['decodes']}" for n, v in identity.items() if v["first_divergence"]]
    return f"greedy outputs identical to autoregressive: {same} of {total} decodes" + (
        f" (bf16 near-ties; not identical: {', '.join(differ)})" if differ else ""
    )


def write_bench(plan: BenchPlan, setup: BenchSetup, results: dict) -> dict:
    """Draw bench.png and write bench.json (the settings, the cost model and ``results``); the payload."""
    test_set, folder = setup.test_set, setup.folder
    plot = bench_plot(
        {key: result["methods"] for key, result in results.items()},
        folder / "bench.png",
        f"{len(test_set.prompts)} prompts × {plan.repeats} repeats, "
        + (
            f"{plan.max_new_tokens} new tokens (EOS ignored)"
            if plan.ignore_eos
            else f"≤{plan.max_new_tokens} new tokens"
        ),
    )
    payload = {
        "command": "bench",
        "machine": machine_info(),
        "pair": setup.pair.describe(),
        "prompts": test_set.describe(),
        "test_prompts_in_draft_held_out": setup.in_draft_held_out,
        "validation_prompts": setup.val_set.describe(),
        "settings": {
            "max_new_tokens": plan.max_new_tokens,
            "ignore_eos": plan.ignore_eos,
            "target_runtime": plan.target_runtime,
            "repeats": plan.repeats,
            "warmup": plan.warmup,
            "seed": plan.seed,
            "select_by": plan.select_by,
            "fixed_k": plan.fixed_k,
            "entropy_thresholds": plan.entropy_thresholds,
            "specdec_thresholds": plan.specdec_thresholds,
            "hindsight_k": plan.hindsight_k,
            "chain_context_row": plan.chain_context_row,
            "chain_copy_ks": plan.chain_copy_ks,
            "chain_copy_thresholds": plan.chain_copy_thresholds,
            "entropy_gamma": plan.entropy_gamma,
            "path_confidence_thresholds": plan.path_confidence_thresholds,
            "hf_settings": [s.__dict__ for s in plan.hf_settings],
            "tree_decoders": plan.tree_grids,
            "draft_trees": {
                kind: [s.params for s in plan.draft_tree_grid if s.kind == kind] for kind in plan.draft_trees or {}
            },
            "tree_models": plan.tree_models,
            "prompt_mode": plan.prompt_options.prompt_mode,
        },
        "cost_model": {"source": setup.cost_source, **setup.cost.to_dict()},
        "results": results,
        "bench_png": plot.name,
    }
    write_json(folder / "bench.json", payload)
    print(f"wrote {folder / 'bench.json'} and {plot}")
    return payload


def fixed_k_ceiling(pair: Pair, temperature: float, k: int, cost: CostModel) -> dict | None:
    """The speed-up the draft's own held-out per-step acceptance (``eval.json`` in its folder, written by
    ``python -m train.feature_draft evaluate``) and ``cost`` allow FixedK(k), to print beside the measurement:
    greedy agreement per step for greedy decoding, expected acceptance Σ min(p, q) at temperature 1."""
    import json
    from pathlib import Path

    from ..core.costs import expected_fixed_k_speedup

    spec = pair.draft_spec
    path = Path(spec.path) / "eval.json" if spec is not None else None
    if path is None or not path.is_file() or temperature not in (0.0, 1.0):
        return None
    per_step = json.loads(path.read_text()).get("per_step")
    if not per_step or k > len(per_step):
        return None
    column = "greedy_agreement" if temperature == 0 else "expected_accept"
    alphas = [row[column] for row in per_step]
    return {
        "source": f"{path} ({column})",
        "alphas": alphas,
        "k": k,
        "expected_speedup": expected_fixed_k_speedup(alphas, k, cost.without_head()),  # FixedK calls no head
    }


def add_comparison_drafts(pair: Pair, spec: ModelSpec) -> None:
    """Load the standalone draft ``spec`` as comparison draft ``standalone`` and, when the pair's draft is a feature
    draft, the same model restricted to that draft's pruned vocabulary as ``standalone-pruned``."""
    from ..models.drafters import ModelDrafter
    from ..models.loading import load_model

    standalone = load_model(spec)
    pair.comparison_drafts["standalone"] = standalone
    kept = getattr(pair.draft, "kept_ids", None)
    if kept is not None:
        pair.comparison_drafts["standalone-pruned"] = ModelDrafter(standalone, kept.cpu(), with_hidden=False)


def _title(key: str, test_set: PromptSet, repeats: int, validation: dict) -> str:
    title = (
        f"bench, {key}, {len(test_set.prompts)} prompts × {repeats} repeats; validation: best K={validation['best_k']}"
    )
    if validation["best_entropy_threshold"] is not None:
        title += f", EntropyStop λ={validation['best_entropy_threshold']:g}"
    if validation.get("best_specdec_threshold") is not None:
        title += f", SpecDec++ h={validation['best_specdec_threshold']:g}"
    if "confidence" in validation:
        title += f", ConfidenceThreshold τ={validation['confidence']['tau']:.3g}"
    return title


def _with_ratios(summaries: Sequence[MethodSummary], best_k: int | None = None) -> list[dict]:
    """Method dicts with ratios of median measured (and modeled) tokens/s to the autoregressive and fixed-K rows
    (the fixed-K row at ``best_k`` when several ran: the K chosen on validation)."""
    own = [s for s in summaries if "draft" not in s.spec.params]
    ar = next((s for s in own if s.spec.kind == "autoregressive"), None)
    fixed = [
        s
        for s in own
        if s.spec.kind == "fixed_k" and not s.spec.copies and (best_k is None or s.spec.params["k"] == best_k)
    ]
    return [s.to_dict() | ratios(s, ar, fixed[-1] if fixed else None) for s in summaries]


def add_hindsight_ratios(summaries: Sequence[MethodSummary], methods: list[dict], select_by: str) -> dict:
    """Give each method dict its ratios to the fixed K best on the test prompts themselves (by ``select_by``):
    ``ratio_to_hindsight_fixed_k``, ``modeled_ratio_to_hindsight_fixed_k`` and their ``_ci95``. Returns that K."""
    own = [s for s in summaries if s.spec.kind == "fixed_k" and "draft" not in s.spec.params and not s.spec.copies]
    best = best_of(own, select_by)
    for summary, method in zip(summaries, methods):
        method.update(ratios_to(summary, best, "hindsight_fixed_k"))
    return {"k": int(best.spec.params["k"]), "select_by": select_by}
