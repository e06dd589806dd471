"""``python -m eval report``: regenerate ``docs/results.md`` and its figures from one run for a bundle.

The page is written from scratch from what this run measures — sweeps of every method family on in-distribution and
out-of-distribution prompt sets at each temperature, the cost model, the head's calibration — so no number in it is
typed by hand. The same numbers are stored next to the figures as ``results.json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from ..acceptance.plots import reliability_plot
from ..core.costs import CostModel
from ..core.prompts import PromptOptions, PromptSet, PromptSource, check_disjoint
from ..core.records import machine_info, write_json
from ..core.tables import text_table
from ..engine.pair_loading import Pair, PairOptions
from ..engine.runner import (
    CHAIN_RUNTIME_KINDS,
    DRAFT_TREES,
    TREE_DECODERS,
    MethodSpec,
    MethodSummary,
    PolicyGrid,
    best_of,
    choose_settings,
    expand_grids,
    greedy_identity,
    h_star_spec,
    headroom_share,
    selection_basis,
)
from ..models.pairs import ModelSpec
from ..trees.labels import TreeModels
from .bench import add_comparison_drafts, with_bundle_tree_settings
from .calibration import CALIBRATION_HEADER, calibration_rows, calibration_views, reliability_panels
from .common import draft_held_out, output_folder, ratio, ratios, ratios_to, resolve_cost_model, with_args_doc
from .plots import costs_plot, pareto_plot
from .report_page import TRAINING_FREE, render_markdown
from .sweep import run_sweep, sweep_table, temperature_key

REPORT_GRIDS: list[dict] = [
    {"kind": "autoregressive"},
    {"kind": "fixed_k", "grid": {"k": [1, 2, 3, 4, 6, 8]}},
    {"kind": "specdecpp", "grid": {"threshold": [0.2, 0.4, 0.6, 0.8]}},
    {"kind": "heuristic"},
    {"kind": "confidence", "grid": {"tau": [0.2, 0.4, 0.6]}},
    {"kind": "entropy", "grid": {"threshold": [0.3, 0.5, 0.7]}},
    {"kind": "path_confidence", "grid": {"threshold": [0.7, 0.9, 0.95]}},
    {"kind": "hf_assisted", "grid": {"num_assistant_tokens": [5], "schedule": ["heuristic"]}},
    {"kind": "hf_assisted", "grid": {"num_assistant_tokens": [20], "confidence_threshold": [0.4]}},
    {"kind": "ngrammys", "grid": {"k": [5, 10], "w": [4, 6]}},
    {"kind": "lookahead", "grid": {"window": [4], "ngram": [3], "guess_set": [4]}},
    {"kind": "ouroboros", "grid": {"gamma": [4], "candidates": [4]}},
    {"kind": "head_tree", "grid": {"threshold": [None, 0.5]}},
    {"kind": "confidence_tree", "grid": {"max_depth": [4], "max_nodes": [16]}},
    {"kind": "static_tree"},
    {"kind": "c2t_tree"},
    {"kind": "cost_tree"},
    {"kind": "oracle"},
]
"""Methods the report sweeps by default (SpecDec++ at the bundle's h* is always added)."""

GOALS = {
    "fixed_k": 1.15,
    "autoregressive": 2.0,
    "autoregressive_sampling": 1.7,
    "hf_assisted": 1.15,
    "training_free": 1.05,
    "oracle_headroom": 0.5,
}
"""The project's targets: SpecDec++ at h* against each baseline (throughput ratios; against autoregressive 2.0×
greedy and 1.7× when sampling) and the share of the oracle's headroom it captures."""

FIGURES_WRITTEN = ("*.png", "results.json")


def head_sources(provenance: dict) -> tuple[list[PromptSource], int]:
    """The prompt sources the head was trained on, moved to the held-out ``eval`` hash split, and the split seed.

    Read from the bundle's provenance: ``data_meta.sources`` (the data_gen dataset's meta) when present, else the first
    list of source dicts with a ``path`` found anywhere in it.
    """
    fields = PromptSource.__dataclass_fields__

    def find(node: Any) -> list[dict] | None:
        if isinstance(node, list) and node and all(isinstance(x, dict) and "path" in x for x in node):
            return node
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            found = find(child)
            if found:
                return found
        return None

    provenance = provenance or {}
    meta = provenance.get("data_meta") if isinstance(provenance.get("data_meta"), dict) else {}
    found = find(meta.get("sources")) or find(provenance)
    if not found:
        raise ValueError(
            "The bundle's provenance records no prompt sources; pass --in_distribution, e.g. "
            "'[{path: ../shared/data/alpaca_eval/alpaca_eval.jsonl, name: alpaca_eval, split: eval}]'."
        )
    out = []
    for raw in found:
        source = {k: v for k, v in raw.items() if k in fields}
        source.update(split="eval", limit=None)
        out.append(PromptSource(**source))
    return out, int(meta.get("split_seed") or 0)


def _h_star_spec(pair: Pair, specs: list[MethodSpec], greedy: bool) -> list[MethodSpec]:
    """Add SpecDec++ at the bundle's h* for the decoding mode (labelled) and, when the bundle copies rows from the text
    (``context_row``), the same h* as ``generate`` decodes it with them; drop a grid point that equals either."""
    stars = [h_star_spec(pair.bundle, greedy)]
    if getattr(pair.bundle, "context_row", 0):
        stars.append(h_star_spec(pair.bundle, greedy, copies=True))
    h, unscored = pair.bundle.h_star(greedy)

    def settings(s: MethodSpec) -> dict | None:
        """What a SpecDec++ spec decodes with, defaults filled in (None for a spec setting anything else)."""
        if s.kind != "specdecpp" or not set(s.params) <= {"threshold", "unscored", "context_row"}:
            return None
        p = s.params
        return {
            "h": float(p.get("threshold", h)),
            "unscored": p.get("unscored", unscored),
            "copies": p.get("context_row", 0),
        }

    taken = [settings(star) for star in stars]
    return [s for s in specs if settings(s) is None or settings(s) not in taken] + stars


def _with_comparison_draft(pair: Pair, spec: MethodSpec) -> MethodSpec:
    """``spec`` decoding with the comparison draft ``standalone`` when it needs a Hugging Face draft (HF assisted,
    Ouroboros), names none, and the pair's own draft is not one."""
    needs_hf = spec.kind in ("hf_assisted", "ouroboros") and "draft" not in spec.params
    if needs_hf and not isinstance(pair.draft, PreTrainedModel) and "standalone" in pair.comparison_drafts:
        return MethodSpec(spec.kind, {**spec.params, "draft": "standalone"}, spec.label, spec.role)
    return spec


def _h_star(summaries: Sequence[MethodSummary], role: str = "h_star") -> MethodSummary | None:
    return next((s for s in summaries if s.spec.role == role), None)


def analyse(summaries: Sequence[MethodSummary], select_by: str) -> dict:
    """Best setting per family, SpecDec++ at h*, ratios and the oracle headroom shares (modeled throughput).

    Settings that copy rows from the text (``context_row``) are a family of their own beside their plain kind
    (``"fixed_k context_row"``): "best FixedK" stays the plain chain's, and a copying row is also compared with the
    best FixedK that copies (``ratio_to_best_fixed_k_copies``)."""
    families = sorted({(s.spec.kind, s.spec.copies) for s in summaries}, key=lambda f: (_ORDER.index(f[0]), f[1]))
    best = {f: best_of([s for s in summaries if (s.spec.kind, s.spec.copies) == f], select_by) for f in families}
    stars = {False: _h_star(summaries), True: _h_star(summaries, "h_star_copies")}
    ar, fixed, oracle = (best.get((kind, False)) for kind in ("autoregressive", "fixed_k", "oracle"))
    fixed_copies = best.get(("fixed_k", True))
    rows = []
    for kind, copies in families:
        top, star = best[(kind, copies)], stars[copies]
        members = [top] + ([star] if kind == "specdecpp" and star is not None and star is not top else [])
        for s in members:
            share = None
            if oracle is not None and fixed is not None and s.spec.kind not in ("oracle", "autoregressive"):
                share = _modeled_headroom(s, fixed, oracle)
            row = {**s.to_dict(), "best_of_family": s is top, **ratios(s, ar, fixed), "oracle_headroom_share": share}
            if copies:
                row |= ratios_to(s, fixed_copies, "best_fixed_k_copies") | ratios_to(s, stars[False], "h_star")
            rows.append(row)
    named = {(f"{kind} context_row" if copies else kind): s.spec.name for (kind, copies), s in best.items()}
    return {
        "rows": rows,
        "best": named,
        "h_star": stars[False].spec.name if stars[False] else None,
        "h_star_copies": stars[True].spec.name if stars[True] else None,
    }


def _modeled_headroom(s: MethodSummary, fixed: MethodSummary, oracle: MethodSummary) -> float | None:
    """:func:`~accept_head.engine.runner.headroom_share` of ``s`` over the best FixedK, in modeled tokens/s."""
    return headroom_share(*(m.pooled.modeled_tokens_per_second for m in (s, fixed, oracle)))


_ORDER = (
    *CHAIN_RUNTIME_KINDS,  # the target alone, then the chain rules
    "hf_assisted",
    *TREE_DECODERS,
    *DRAFT_TREES,
    "oracle",
)


def goal_rows(sets: dict, temperature_keys: Sequence[str], select_by: str, summaries: dict) -> list[dict]:
    """Each goal of the issue, per prompt set and temperature, with the measured and modeled value and whether the
    measured one (modeled for the headroom share) meets it."""
    out = []
    for set_name in sets:
        for key in temperature_keys:
            runs = summaries[set_name][key]
            star = _h_star(runs)
            if star is None:
                continue

            def against(kinds: Sequence[str]) -> MethodSummary | None:
                return best_of([s for s in runs if s.spec.kind in kinds and not s.spec.copies], select_by)

            vs_ar = GOALS["autoregressive" if key == "greedy" else "autoregressive_sampling"]
            fixed, oracle = against(["fixed_k"]), against(["oracle"])
            checks = [
                ("≥ 1.15× best FixedK", fixed, GOALS["fixed_k"]),
                (f"≥ {vs_ar:g}× autoregressive", against(["autoregressive"]), vs_ar),
                ("≥ 1.15× best HF assisted setting", against(["hf_assisted"]), GOALS["hf_assisted"]),
                ("≥ 1.05× best of Heuristic / Confidence / Entropy", against(TRAINING_FREE), GOALS["training_free"]),
            ]
            for goal, other, target in checks:
                if other is None:
                    continue
                measured = ratio(star.median_tokens_per_second, other.median_tokens_per_second)
                modeled = ratio(star.pooled.modeled_tokens_per_second, other.pooled.modeled_tokens_per_second)
                # The same ratio for the oracle: how far any stop rule could go with this draft (greedy only).
                ceiling = (
                    None
                    if oracle is None
                    else ratio(oracle.pooled.modeled_tokens_per_second, other.pooled.modeled_tokens_per_second)
                )
                out.append(
                    {
                        "goal": goal,
                        "set": set_name,
                        "temperature": key,
                        "against": other.spec.name,
                        "measured": measured,
                        "modeled": modeled,
                        "oracle_modeled": ceiling,
                        "met": measured is not None and measured >= target,
                    }
                )
            if fixed is not None and oracle is not None:
                share = _modeled_headroom(star, fixed, oracle)
                out.append(
                    {
                        "goal": "≥ 50% of the oracle headroom (modeled)",
                        "set": set_name,
                        "temperature": key,
                        "against": f"{fixed.spec.name} → Oracle",
                        "measured": None,
                        "modeled": share,
                        "oracle_modeled": None,
                        "met": share is not None and share >= GOALS["oracle_headroom"],
                    }
                )
    return out


@dataclass
class ReportPlan:
    """:func:`report`'s parameters (documented in :data:`REPORT_ARGS`), a None default filled in and every value
    checked before any model loads."""

    pair: PairOptions
    prompt_options: PromptOptions
    in_distribution: list[PromptSource] | None
    out_of_distribution: list[PromptSource] | None
    prompts: str | None
    prompts_field: str
    limit: int | None
    validation_prompts: list[PromptSource] | None
    validation_limit: int | None
    comparison_draft: ModelSpec | None
    policies: list[PolicyGrid] | None
    bigram_cache: str | None
    tree_models: str | None
    temperatures: list[float]
    max_new_tokens: int
    dataset: str | None
    calibration_rows_limit: int | None
    mix_ratio: float
    select_by: str
    cost_model: str
    seed: int
    output: str
    progress: bool
    ignore_eos: bool

    def __post_init__(self) -> None:
        """Fill in the defaults; a ValueError names a bad value."""
        self.pair, self.prompt_options = self.pair or PairOptions(), self.prompt_options or PromptOptions()
        self.pair.require_bundle("report")
        if self.select_by not in ("modeled", "measured"):
            raise ValueError(f"select_by={self.select_by!r} must be 'modeled' or 'measured'.")
        if self.page.suffix != ".md":
            raise ValueError(f"output={self.output!r} must be a Markdown file path ending in .md.")
        self.temperatures = [0.0, 1.0] if self.temperatures is None else [float(t) for t in self.temperatures]

    @property
    def page(self) -> Path:
        """The Markdown page to write."""
        return Path(self.output)

    @property
    def figures(self) -> Path:
        """The page's folder of figures and results.json (the page's path without ``.md``)."""
        return self.page.with_suffix("")


@dataclass
class ReportSetup:
    """What :func:`report` loads once and decodes with on every prompt set and temperature."""

    pair: Pair
    sets: dict[str, PromptSet]
    """The test prompt sets by name: in-distribution, out-of-distribution and ``prompts``' set."""
    val_set: PromptSet
    prompt_options: PromptOptions
    """``prompt_options`` with ``split_seed`` resolved (given, else the one the head's data was split with)."""
    cost: CostModel
    cost_source: str
    """Where ``cost`` came from (``measured``, ``bundle`` or a costs.json path)."""
    runner_options: dict
    """:class:`~accept_head.engine.runner.Runner` options of every decode (the trees' cost model, the tree models)."""
    specs_by_mode: dict[bool, list[MethodSpec]]
    """Every setting searched on validation, greedy (True) or sampling, SpecDec++ at that mode's h* included."""
    staging: Path
    """Where this run draws its figures before they replace the last run's (an interrupted run leaves those)."""


REPORT_ARGS = """
    Args:
        pair: The pair (its bundle is required).
        prompt_options: How prompts are encoded.
        in_distribution: In-distribution prompt sources (held-out ``split: eval`` of the head's sources); default: the
            sources recorded in the bundle's provenance, moved to the eval split.
        out_of_distribution: Out-of-distribution prompt sources; default ``[{path: humaneval}]``; ``[]`` for none.
        prompts: An extra prompt file (JSON/JSONL/CSV/parquet, or text with one prompt per line), reported as its
            own out-of-distribution set.
        prompts_field: The column holding the prompt in ``prompts``.
        limit: Prompts per set (taken round-robin across its sources); null keeps all.
        validation_prompts: Prompt sources that choose every method's setting; default: the in-distribution
            sources moved to the ``head`` hash split. Must not overlap any test set.
        validation_limit: Validation prompts (round-robin across their sources); null keeps all.
        comparison_draft: A standalone Hugging Face draft (``draft: standalone`` in a method's params) for the
            methods that need one when the pair's draft is a feature draft: HF assisted generation and Ouroboros
            take it automatically.
        policies: Method grids searched on validation (default :data:`REPORT_GRIDS`); SpecDec++ at h* is always
            added and always reported.
        bigram_cache: Folder of N-Grammys' model-bigram tables (default ``$ACCEPT_HEAD_CACHE/bigram``).
        tree_models: Folder written by ``python -m train.trees`` (C2T classifiers, tree-trained heads), which the
            ``c2t_tree`` rows and ``head_tree`` with ``head: tree`` need; without it they are skipped with the reason.
            The cost-priced trees plan with this run's cost model.
        temperatures: Sampling temperatures (0 = greedy, where the oracle runs). Default [0, 1].
        max_new_tokens: Tokens generated per prompt (at most).
        dataset: A data_gen dataset for the offline calibration view (held out from the head's training).
        calibration_rows_limit: Dataset rows used by the offline calibration view.
        mix_ratio: Token-mixing ratio of the offline calibration view.
        select_by: Pick each family's best setting by ``modeled`` or ``measured`` tokens/s.
        cost_model: ``measure`` (now, so every number comes from this run), ``bundle`` or a costs.json.
        seed: Seed of the prompt shuffle and of every decoding generator.
        output: The Markdown page to write; figures go to the folder of the same name without ``.md``.
        progress: Show progress bars.
        ignore_eos: Decode past EOS, so every method writes exactly ``max_new_tokens`` per prompt and tokens/s
            compares outputs of one length (at T > 0 methods otherwise stop at different lengths), as serving
            benchmarks time it. False stops at EOS; the tables show the tokens each method wrote either way.
    """
"""The ``Args:`` section of :func:`report`'s docstring, its ``--help`` (attached by
:func:`~accept_head.evaluation.common.with_args_doc`)."""


@with_args_doc(REPORT_ARGS)
def report(
    pair: PairOptions | None = None,
    prompt_options: PromptOptions | None = None,
    in_distribution: list[PromptSource] | None = None,
    out_of_distribution: list[PromptSource] | None = None,
    prompts: str | None = None,
    prompts_field: str = "instruction",
    limit: int | None = 8,
    validation_prompts: list[PromptSource] | None = None,
    validation_limit: int | None = 4,
    comparison_draft: ModelSpec | None = None,
    policies: list[PolicyGrid] | None = None,
    bigram_cache: str | None = None,
    tree_models: str | None = None,
    temperatures: list[float] | None = None,
    max_new_tokens: int = 96,
    dataset: str | None = None,
    calibration_rows_limit: int | None = 200,
    mix_ratio: float = 0.15,
    select_by: str = "modeled",
    cost_model: str = "measure",
    seed: int = 0,
    output: str = "docs/results.md",
    progress: bool = True,
    ignore_eos: bool = True,
) -> dict:
    """Regenerate the results page of a bundle from scratch.

    Every method grid (``policies``) is decoded on the validation prompts first, per temperature, and each kind's
    best setting there (:func:`~accept_head.engine.runner.choose_settings`) is what the page reports on the test sets,
    beside
    SpecDec++ at the bundle's h*: nothing reported is chosen on the prompts it is reported on. The page holds a
    best-throughput table shaped like SpecDec++'s Table 1, the winner per prompt set and decoding mode, each chosen
    method's numbers (tokens per target call included), the share of the oracle's headroom each captures
    ((policy − best FixedK) / (Oracle − best FixedK), modeled), the goals checked against the measurements, Pareto
    plots (verification vs discard rate) of the validation grid and of each test set, the cost model and the head's
    calibration (offline and on-policy). Writes ``output`` and, in the folder of the same name, its PNGs and
    results.json. Needs a bundle (``--bundle``); ``split_seed`` defaults to the one recorded in its provenance, else 0.
    """
    plan = ReportPlan(**locals())  # every parameter above, checked before any model loads
    setup = load_report(plan)
    chosen, validation, figures = choose_on_validation(plan, setup)
    summaries, results, test_figures = decode_test_sets(plan, setup, chosen)
    calibration, calibration_figures = calibrate(plan, setup)
    figures |= test_figures | calibration_figures
    goals = goal_rows(setup.sets, [temperature_key(t) for t in plan.temperatures], plan.select_by, summaries)
    return write_report(plan, setup, validation, results, calibration, goals, figures)


def load_report(plan: ReportPlan) -> ReportSetup:
    """Empty the staging folder, expand the method grids, load the pair with its comparison draft and the prompt
    sets, and resolve the cost model."""
    staging = output_folder(plan.figures.with_name(plan.figures.name + ".partial"))
    for leftover in staging.iterdir():  # of a run interrupted before
        leftover.unlink()
    grid = expand_grids(plan.policies if plan.policies is not None else REPORT_GRIDS)  # checked before any model loads
    pair = plan.pair.load()  # a bundle path always loads as pair.bundle (or raises)
    if plan.comparison_draft is not None:
        add_comparison_drafts(pair, ModelSpec.coerce(plan.comparison_draft))
        grid = [_with_comparison_draft(pair, spec) for spec in grid]
    prompt_options, sets, val_set = report_prompt_sets(plan, pair)
    cost, cost_source = resolve_cost_model(plan.cost_model, pair, plan.seed)
    runner_options = {"tree_cost": cost, "tree_models": TreeModels.load(plan.tree_models) if plan.tree_models else None}
    grid = with_bundle_tree_settings(grid, pair.bundle)  # named and grouped by what they decode (copies included)
    specs_by_mode = {greedy: _h_star_spec(pair, grid, greedy) for greedy in (False, True)}
    return ReportSetup(pair, sets, val_set, prompt_options, cost, cost_source, runner_options, specs_by_mode, staging)


def report_prompt_sets(plan: ReportPlan, pair: Pair) -> tuple[PromptOptions, dict[str, PromptSet], PromptSet]:
    """The test prompt sets by name and the validation set, none sharing a prompt with it, and the prompt options
    they were encoded with (``split_seed`` defaults to the one the head's data was split with)."""
    id_sources = plan.in_distribution or head_sources(pair.bundle.provenance)[0]
    prompt_options = plan.prompt_options
    if prompt_options.split_seed is None:  # the one the head's data was split with (as head_sources reads it)
        meta = pair.bundle.provenance.get("data_meta") or {}
        prompt_options = replace(prompt_options, split_seed=int(meta.get("split_seed") or 0))
    ood_sources = [PromptSource(path="humaneval")] if plan.out_of_distribution is None else plan.out_of_distribution
    encode = dict(tokenizer=pair.tokenizer, seed=plan.seed, limit=plan.limit)
    sets: dict[str, PromptSet] = {"in-distribution": prompt_options.encode("in-distribution", id_sources, **encode)}
    if ood_sources:  # [] asks for none (e.g. when every out-of-distribution prompt chose the draft)
        sets["out-of-distribution"] = prompt_options.encode("out-of-distribution", ood_sources, **encode)
    if plan.prompts is not None:
        name = Path(plan.prompts).stem
        sets[name] = prompt_options.encode(name, [PromptSource(path=plan.prompts, field=plan.prompts_field)], **encode)
    val_sources = plan.validation_prompts or [replace(s, split="head", offset=0, limit=None) for s in id_sources]
    val_set = prompt_options.encode("validation", val_sources, **(encode | {"limit": plan.validation_limit}))
    for prompt_set in sets.values():
        check_disjoint(prompt_set, val_set)
        draft_held_out(pair, prompt_set, prompt_options)  # warns when the draft's recipe chose on them
    return prompt_options, sets, val_set


def _sweep(
    plan: ReportPlan,
    setup: ReportSetup,
    prompt_set: PromptSet,
    specs: Sequence[MethodSpec],
    temperature: float,
    outputs: dict | None = None,
) -> tuple[list[MethodSummary], list[dict]]:
    """:func:`~accept_head.evaluation.sweep.run_sweep` of ``specs`` on ``prompt_set`` with the report's settings."""
    return run_sweep(
        setup.pair,
        prompt_set,
        specs,
        temperature,
        plan.max_new_tokens,
        setup.cost,
        plan.seed,
        plan.progress,
        plan.bigram_cache,
        outputs,
        ignore_eos=plan.ignore_eos,
        **setup.runner_options,
    )


def choose_on_validation(plan: ReportPlan, setup: ReportSetup) -> tuple[dict, dict, dict[str, str]]:
    """Decode every setting on the validation prompts at each temperature and choose each kind's best
    (:func:`~accept_head.engine.runner.choose_settings`); per temperature key the chosen specs and the validation
    record of results.json, and the Pareto figures drawn."""
    chosen: dict[str, list[MethodSpec]] = {}
    validation: dict = {}
    figures: dict[str, str] = {}
    for temperature in plan.temperatures:
        key = temperature_key(temperature)
        runs, skipped = _sweep(plan, setup, setup.val_set, setup.specs_by_mode[temperature == 0], temperature)
        chosen[key] = choose_settings(runs, plan.select_by)
        validation[key] = {
            "methods": [s.to_dict() | {"selected_by": selection_basis(s.spec, plan.select_by)} for s in runs],
            "chosen": [spec.name for spec in chosen[key]],
            "skipped": skipped,
        }
        figures[f"pareto validation {key}"] = _show(runs, setup.staging, "validation", key, len(setup.val_set.prompts))
    return chosen, validation, figures


def decode_test_sets(
    plan: ReportPlan, setup: ReportSetup, chosen: dict[str, list[MethodSpec]]
) -> tuple[dict[str, dict[str, list[MethodSummary]]], dict, dict[str, str]]:
    """Decode every test set with the settings ``chosen`` on validation, per temperature; the summaries and the
    results of results.json per set and temperature key (with the analysis and, greedy, each method's identity to
    autoregressive decoding), and the Pareto figures drawn."""
    summaries: dict[str, dict[str, list[MethodSummary]]] = {}
    results: dict = {}
    figures: dict[str, str] = {}
    for set_name, prompt_set in setup.sets.items():
        summaries[set_name], results[set_name] = {}, {}
        for temperature in plan.temperatures:
            key = temperature_key(temperature)
            outputs: dict = {}
            runs, skipped = _sweep(plan, setup, prompt_set, chosen[key], temperature, outputs)
            summaries[set_name][key] = runs
            figures[f"pareto {set_name} {key}"] = _show(runs, setup.staging, set_name, key, len(prompt_set.prompts))
            results[set_name][key] = {
                "temperature": temperature,
                "methods": [s.to_dict() for s in runs],
                "skipped": skipped,
                "analysis": analyse(runs, plan.select_by),
            }
            reference = next((r.spec.name for r in runs if r.spec.kind == "autoregressive"), None)
            if temperature == 0 and reference is not None:
                results[set_name][key]["greedy_identity"] = greedy_identity(outputs, reference)
    return summaries, results, figures


def calibrate(plan: ReportPlan, setup: ReportSetup) -> tuple[dict, dict[str, str]]:
    """The head's calibration views (offline on ``dataset``, on-policy on the in-distribution prompts), printed, and
    their reliability figure."""
    pair = setup.pair
    calibration = calibration_views(
        pair,
        plan.dataset,
        setup.sets["in-distribution"],
        pair.bundle.temperature,
        plan.max_new_tokens,
        None,
        plan.mix_ratio,
        plan.calibration_rows_limit,
        plan.seed,
    )
    figure = reliability_plot(
        reliability_panels(calibration), setup.staging / "reliability.png", "acceptance head calibration"
    )
    print(text_table(CALIBRATION_HEADER, calibration_rows(calibration), title="acceptance head calibration"))
    return calibration, {"reliability": figure.name}


def write_report(
    plan: ReportPlan,
    setup: ReportSetup,
    validation: dict,
    results: dict,
    calibration: dict,
    goals: list[dict],
    figures: dict[str, str],
) -> dict:
    """Draw the cost model (when measured), write results.json, move the figures into place and write the page
    rendered from what was stored; the payload."""
    if setup.cost.measured.get("target"):
        figures["costs"] = costs_plot(setup.cost, setup.staging / "costs.png", "cost model of this run").name
    payload = {
        "command": "report",
        "machine": machine_info(),
        "pair": setup.pair.describe(),
        "prompt_sets": {name: s.describe() for name, s in setup.sets.items()},
        "validation_prompts": setup.val_set.describe(),
        "validation": validation,
        "settings": {
            "max_new_tokens": plan.max_new_tokens,
            "ignore_eos": plan.ignore_eos,
            "temperatures": plan.temperatures,
            "select_by": plan.select_by,
            "seed": plan.seed,
            "split_seed": setup.prompt_options.split_seed,
            "prompt_mode": setup.prompt_options.prompt_mode,
            "limit": plan.limit,
            "methods": [s.to_dict() for s in setup.specs_by_mode[False]],
            "greedy_h_star": h_star_spec(setup.pair.bundle, greedy=True).to_dict(),
        },
        "cost_model": {"source": setup.cost_source, **setup.cost.to_dict()},
        "results": results,
        "calibration": calibration,
        "goals": goals,
        "figures": figures,
    }
    stored = json.loads(write_json(setup.staging / "results.json", payload).read_text())
    _replace_figures(setup.staging, output_folder(plan.figures))
    plan.page.write_text(render_markdown(stored, plan.figures.name))  # from what was stored: results.json re-renders it
    print(f"wrote {plan.page} and {len(figures)} figure(s) + results.json in {plan.figures}")
    return payload


def _replace_figures(staging: Path, figures: Path) -> None:
    """Move a finished run's figures from ``staging`` into ``figures``; nothing of an earlier run survives."""
    for pattern in FIGURES_WRITTEN:
        for stale in figures.glob(pattern):
            stale.unlink()
    for made in staging.iterdir():
        made.replace(figures / made.name)
    staging.rmdir()


def _show(runs: Sequence[MethodSummary], figures: Path, set_name: str, key: str, prompts: int) -> str:
    """Print the runs of one prompt set and temperature as a table and draw their Pareto plot; the PNG's name."""
    print(sweep_table(runs, f"{set_name}, {key}, {prompts} prompts"))
    title = f"{set_name}, {key}: {prompts} prompts" + (", every setting searched" if set_name == "validation" else "")
    return pareto_plot(runs, figures / f"pareto_{_slug(set_name)}_{_slug(key)}.png", title).name


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-").replace("--", "-")
