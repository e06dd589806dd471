"""``python -m eval free_stop``: the adaptive stop of :mod:`accept_head.engine.free_stop` against the best static
setting of
the same learning-free decoder (N-Grammys, Lookahead), on prompts that chose nothing.

Per temperature and decoder:

1. *Train* (:func:`~accept_head.engine.free_stop.fit_predictor`): decode the training prompts with the decoder's
generous
   ``pool`` setting and a :class:`~accept_head.engine.free_stop.LabelRecorder`, fit a
   :class:`~accept_head.engine.free_stop.GuessPredictor` (calibrated out of fold by prompt); its calibration is
   reported on
   labels collected the same way on the validation prompts.
2. *Validate*: decode the validation prompts once with every static setting and with the adaptive stop at every
   threshold h (with and without the cost curve); keep the best static setting and the best adaptive one by
   modeled (or measured) tokens/s.
3. *Test*: decode the test prompts with the target alone, the best static setting and the best adaptive one,
   interleaved (A B C A B C …, one seed per prompt shared by every method) over ``repeats`` passes after a warm-up,
   and print tokens per target call, wall-clock tokens/s (median, min–max over passes) and modeled tokens/s.

Every decode runs through :mod:`accept_head.engine.runner` (the stop is a method's ``stop`` parameter). Modeled seconds
of
a run: Σ over target calls of the measured cost-per-tree-size curve at the tokens the call fed
(:class:`~accept_head.core.costs.TreeCost`, priced by :func:`~accept_head.engine.runner.aggregate`), plus the measured
time
spent building guesses and running the stop.
Writes ``free_stop.json``, ``tree_costs.json`` and each fitted predictor (``<decoder>-<temperature>-predictor.json``).
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.costs import TreeCost
from ..core.prompts import PromptOptions, PromptSet, PromptSource, check_disjoint
from ..core.records import machine_info, write_json
from ..core.tables import text_table
from ..engine.free_stop import AdaptiveRowStop, GuessPredictor, fit_predictor
from ..engine.measure import measure_tree_costs
from ..engine.pair_loading import Pair, PairOptions
from ..engine.runner import MethodSpec, MethodSummary, Runner, best_of, run_interleaved, summarize, tree_params
from ..learning_free.ngrammys import ModelBigram
from ..models.pairs import ModelSpec
from .common import fmt, load_target, output_folder, tokens_per_second_cells
from .sweep import temperature_key

DECODERS = ("ngrammys", "lookahead")


@dataclass
class NgrammysSetting:
    """One static N-Grammys setting (:func:`~accept_head.learning_free.ngrammys.ngrammys_generate`)."""

    k: int = 10
    """Rows per round."""
    w: int = 4
    """Tokens per row."""
    q: int = 2
    """Context n-gram query length."""
    strategy: str = "mixed"
    """model, context or mixed."""


@dataclass
class LookaheadSetting:
    """One static Lookahead setting (:func:`~accept_head.learning_free.lookahead.lookahead_generate`)."""

    window: int = 5
    """W: Jacobi window columns."""
    ngram: int = 4
    """N: n-gram size (guesses of N − 1 tokens)."""
    guess_set: int = 5
    """G: guesses verified per step."""
    context_ngrams: bool = False
    """Seed the pool with the prompt's and the output's own n-grams."""


def _setting_name(decoder: str, setting: NgrammysSetting | LookaheadSetting) -> str:
    if decoder == "ngrammys":
        return f"N-Grammys k={setting.k} w={setting.w} q={setting.q} {setting.strategy}"
    extra = " context" if setting.context_ngrams else ""
    return f"Lookahead W={setting.window} N={setting.ngram} G={setting.guess_set}{extra}"


def _spec(decoder: str, setting: NgrammysSetting | LookaheadSetting, stop: AdaptiveRowStop | None = None) -> MethodSpec:
    """The engine's method for a static setting, or for the pool setting under an adaptive stop."""
    name = _setting_name(decoder, setting)
    if stop is None:
        return MethodSpec(decoder, asdict(setting), label=name)
    label = f"{name} + stop h={stop.threshold:g}{' cost' if stop.cost is not None else ''}"
    return MethodSpec(decoder, asdict(setting) | {"stop": stop}, label=label)


def _row(summary: MethodSummary) -> dict:
    """A method's row of free_stop.json: what it ran, and its counts and rates pooled over prompts and repeats
    (tokens/s also per repeat; fed tokens per target call)."""
    spec, pooled, tps = summary.spec, summary.pooled, summary.tokens_per_second
    stop = spec.params.get("stop")
    return {
        "name": spec.name,
        "decoder": spec.kind,
        "setting": {k: v for k, v in spec.params.items() if k != "stop"} or None,
        "adaptive": stop is not None,
        **({"params": {"threshold": stop.threshold, "cost_cap": stop.cost is not None}} if stop is not None else {}),
        "tokens_per_target_call": summary.tokens_per_target_call,
        "fed_per_call": summary.tree["mean_fed"] if summary.tree else float(pooled.target_calls > 0),
        "tokens_per_second": {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "per_repeat": tps},
        "modeled_tokens_per_second": pooled.modeled_tokens_per_second,
        "generated": pooled.generated,
        "target_calls": pooled.target_calls,
    }


TABLE_HEADER = ["method", "tok/call", "fed/call", "tok/s", "min–max", "modeled", "vs static", "vs AR"]


def _table_rows(rows: Sequence[dict]) -> list[list[str]]:
    return [
        [
            row["name"],
            fmt(row["tokens_per_target_call"], 2),
            fmt(row["fed_per_call"], 1),
            *tokens_per_second_cells(row),
            fmt(row["modeled_tokens_per_second"]),
            fmt(row.get("ratio_to_static"), 2, "x"),
            fmt(row.get("ratio_to_autoregressive"), 2, "x"),
        ]
        for row in rows
    ]


@dataclass
class FreeStopPlan:
    """:func:`free_stop`'s parameters, a None default filled in and every value checked before any model loads."""

    pair: PairOptions
    prompt_options: PromptOptions
    prompts: list[PromptSource]
    validation_prompts: list[PromptSource]
    training_prompts: list[PromptSource]
    decoders: list[str]
    ngrammys_settings: list[NgrammysSetting] | None
    ngrammys_pool: NgrammysSetting | None
    lookahead_settings: list[LookaheadSetting] | None
    lookahead_pool: LookaheadSetting | None
    thresholds: list[float]
    cost_cap: list[bool]
    max_new_tokens: int
    temperatures: list[float]
    repeats: int
    warmup: int
    select_by: str
    tree_costs: str
    tree_cost_sizes: list[int] | None
    cost_repeats: int
    bigram_top: int
    bigram_cache: str | None
    feature_q: int
    predictor_c: float
    seed: int
    output_dir: str
    static: dict[str, list[NgrammysSetting | LookaheadSetting]] = field(init=False)
    """Each decoder's static settings searched on validation (``ngrammys_settings``, ``lookahead_settings``)."""
    pools: dict[str, NgrammysSetting | LookaheadSetting] = field(init=False)
    """Each decoder's pool setting (``ngrammys_pool``, ``lookahead_pool``)."""

    def __post_init__(self) -> None:
        """Fill in the defaults; a ValueError names a bad value."""
        self.decoders = list(DECODERS) if self.decoders is None else list(self.decoders)
        unknown = sorted(set(self.decoders) - set(DECODERS))
        if unknown or not self.decoders:
            raise ValueError(f"decoders={self.decoders} must be a non-empty list drawn from {DECODERS}.")
        self.static, self.pools = _static_and_pools(self)
        self.thresholds = (
            [0.5, 0.7, 0.8, 0.9, 0.95, 1.0] if self.thresholds is None else [float(h) for h in self.thresholds]
        )
        if not self.thresholds or any(not 0 <= h <= 1 for h in self.thresholds):
            raise ValueError(f"thresholds={self.thresholds} must be a non-empty list of h in [0, 1].")
        self.cost_cap = [False, True] if self.cost_cap is None else [bool(c) for c in self.cost_cap]
        if not self.cost_cap:
            raise ValueError("cost_cap must hold at least one of false, true.")
        self.temperatures = [0.0] if self.temperatures is None else [float(t) for t in self.temperatures]
        if self.select_by not in ("modeled", "measured"):
            raise ValueError(f"select_by={self.select_by!r} must be 'modeled' or 'measured'.")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0 (got {self.repeats}, {self.warmup}).")
        for name, value in (("prompts", self.prompts), ("validation_prompts", self.validation_prompts)):
            if not value:
                raise ValueError(f"--{name} is required: give at least one prompt source.")
        if not self.training_prompts:
            raise ValueError("--training_prompts is required: the predictor is fitted on their verification passes.")
        self.pair, self.prompt_options = self.pair or PairOptions(), self.prompt_options or PromptOptions()


def _static_and_pools(plan: FreeStopPlan) -> tuple[dict[str, list], dict[str, NgrammysSetting | LookaheadSetting]]:
    """Each decoder's static settings and pool setting, defaults filled in; a ValueError names a bad one."""
    static = {
        "ngrammys": [NgrammysSetting(k, w) for k in (1, 3, 5, 10) for w in (1, 2, 4)]
        if plan.ngrammys_settings is None
        else [_coerce(NgrammysSetting, s) for s in plan.ngrammys_settings],
        "lookahead": [LookaheadSetting(*s) for s in ((5, 4, 5), (3, 3, 3), (5, 5, 5), (7, 4, 7))]
        if plan.lookahead_settings is None
        else [_coerce(LookaheadSetting, s) for s in plan.lookahead_settings],
    }
    pools = {
        "ngrammys": NgrammysSetting(10, 8)
        if plan.ngrammys_pool is None
        else _coerce(NgrammysSetting, plan.ngrammys_pool),
        "lookahead": LookaheadSetting(5, 6, 10)
        if plan.lookahead_pool is None
        else _coerce(LookaheadSetting, plan.lookahead_pool),
    }
    for decoder in plan.decoders:
        if not static[decoder]:
            raise ValueError(f"{decoder}_settings must hold at least one static setting.")
        for setting in [*static[decoder], pools[decoder]]:
            tree_params(decoder, asdict(setting))  # raises ValueError naming a bad value
    if (
        pools["ngrammys"].strategy != "context"
        and max(s.k for s in [*static["ngrammys"], pools["ngrammys"]]) > plan.bigram_top
    ):
        raise ValueError(
            f"an N-Grammys setting asks for more rows k than bigram_top={plan.bigram_top}; raise bigram_top."
        )
    return static, pools


@dataclass
class FreeStopSetup:
    """What :func:`free_stop` loads once and decodes with at every temperature."""

    pair: Pair
    """The target (and its tokenizer); its draft is not used."""
    sets: dict[str, PromptSet]
    """The test, validation and training prompts, no two sharing a prompt."""
    cost: TreeCost
    cost_source: str
    """Where ``cost`` came from (``measured`` or a tree_costs.json path)."""
    folder: Path
    """Where free_stop.json, tree_costs.json and the predictors go."""


def free_stop(
    pair: PairOptions | None = None,
    prompt_options: PromptOptions | None = None,
    prompts: list[PromptSource] | None = None,
    validation_prompts: list[PromptSource] | None = None,
    training_prompts: list[PromptSource] | None = None,
    decoders: list[str] | None = None,
    ngrammys_settings: list[NgrammysSetting] | None = None,
    ngrammys_pool: NgrammysSetting | None = None,
    lookahead_settings: list[LookaheadSetting] | None = None,
    lookahead_pool: LookaheadSetting | None = None,
    thresholds: list[float] | None = None,
    cost_cap: list[bool] | None = None,
    max_new_tokens: int = 96,
    temperatures: list[float] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    select_by: str = "modeled",
    tree_costs: str = "measure",
    tree_cost_sizes: list[int] | None = None,
    cost_repeats: int = 10,
    bigram_top: int = 32,
    bigram_cache: str | None = None,
    feature_q: int = 2,
    predictor_c: float = 1.0,
    seed: int = 0,
    output_dir: str = "eval_out/free_stop",
) -> dict:
    """Benchmark the adaptive stop for learning-free decoders (accept_head.engine.free_stop) against the best static
    setting of the same decoder: fit the acceptance predictor on the training prompts, choose the threshold h and
    the static setting on the validation prompts, report on the test prompts. Writes free_stop.json,
    tree_costs.json and the fitted predictors, and prints one table per temperature. Only the pair's target is
    decoded: ``--target`` or the bundle's (its draft and head are not used).

    Args:
        pair: The target (``draft`` is not used).
        prompt_options: How prompts are encoded.
        prompts: Test prompt sources; must share no prompt with the other two sets.
        validation_prompts: Prompt sources for choosing h and the best static setting.
        training_prompts: Prompt sources whose verification passes label the predictor's training data.
        decoders: Learning-free decoders to compare: ngrammys, lookahead (default both).
        ngrammys_settings: Static N-Grammys grid searched on validation (default k x w over {1, 3, 5, 10} x
            {1, 2, 4}, mixed, q=2).
        ngrammys_pool: The guesses the adaptive N-Grammys stop chooses from, and the setting that labels the
            training data (default k=10, w=8).
        lookahead_settings: Static Lookahead grid searched on validation (default W=5 N=4 G=5, W=3 N=3 G=3,
            W=5 N=5 G=5, W=7 N=4 G=7).
        lookahead_pool: The adaptive Lookahead setting (the stop cuts its guesses; the window is always fed) and
            the setting that labels the training data (default W=5, N=6, G=10).
        thresholds: h grid of the adaptive stop searched on validation (default 0.5, 0.7, 0.8, 0.9, 0.95, 1.0).
        cost_cap: Whether the stop also prices the round by the tree-cost curve; both values are searched on
            validation (default [false, true]).
        max_new_tokens: Tokens generated per prompt (at most), the same for every method.
        temperatures: Sampling temperatures; 0 is greedy (default [0]). A predictor is fitted per temperature.
        repeats: Timed passes over the test prompts.
        warmup: Test prompts decoded once by every method before timing.
        select_by: Choose h and the static setting by ``modeled`` (the tree-cost curve) or ``measured`` tokens/s.
        tree_costs: ``measure`` (time the target's tree-masked calls now) or a tree_costs.json written by an
            earlier run.
        tree_cost_sizes: Tokens fed per call to time (default 1, 2, 4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 81).
        cost_repeats: Timed runs per size when measuring the curve.
        bigram_top: Successors per token in N-Grammys' model-bigram table (also read by the predictor's features).
        bigram_cache: Folder of the cached bigram tables (default ~/.cache/accept_head/bigram).
        feature_q: n-gram length of the predictor's context-agreement features.
        predictor_c: Inverse L2 regularisation of the predictor's logistic regression.
        seed: Seed of the prompt shuffle, the calibration folds and every decoding generator.
        output_dir: Folder for free_stop.json, tree_costs.json and the predictors.
    """
    plan = FreeStopPlan(**locals())  # every parameter above, checked before any model loads
    setup = load_free_stop(plan)
    results = {temperature_key(t): run_temperature(plan, setup, t) for t in plan.temperatures}
    return write_free_stop(plan, setup, results)


def load_free_stop(plan: FreeStopPlan) -> FreeStopSetup:
    """Load the target and the three prompt sets; measure (or read) the tree-cost curve and write tree_costs.json."""
    folder = output_folder(plan.output_dir)
    pair = load_target(plan.pair)
    sets = {
        name: plan.prompt_options.encode(name, sources, pair.tokenizer, plan.seed)
        for name, sources in (
            ("test", plan.prompts),
            ("validation", plan.validation_prompts),
            ("training", plan.training_prompts),
        )
    }
    for first, second in itertools.combinations(sets.values(), 2):
        check_disjoint(first, second)
    cost, cost_source = _tree_cost(
        pair.target, plan.tree_costs, plan.tree_cost_sizes, plan.pools, plan.cost_repeats, plan.seed
    )
    write_json(folder / "tree_costs.json", {"tree_cost": cost.to_dict(), "source": cost_source})
    return FreeStopSetup(pair, sets, cost, cost_source, folder)


def run_temperature(plan: FreeStopPlan, setup: FreeStopSetup, temperature: float) -> dict:
    """Per decoder, fit the predictor and choose the static setting and the adaptive stop on validation; then decode
    the test prompts with the target alone and each decoder's two choices, and print the table; free_stop.json's
    result at ``temperature``."""
    key = temperature_key(temperature)
    runner = Runner(
        setup.pair, plan.max_new_tokens, temperature, bigram_cache=plan.bigram_cache, bigram_top=plan.bigram_top
    )
    bigram = runner.bigram(plan.bigram_top)
    chosen: dict[str, dict] = {}
    methods = [MethodSpec("autoregressive", label="autoregressive")]
    for decoder in plan.decoders:
        predictor, record = fit_stop(plan, setup, runner, decoder, key)
        rows, best_static, best_adaptive = choose_stop(plan, setup, runner, decoder, key, predictor, bigram)
        chosen[decoder] = record | {
            "validation": rows,
            "best_static": best_static.name,
            "best_adaptive": best_adaptive.name,
        }
        methods += [best_static, best_adaptive]
    rows = decode_test(plan, setup, runner, methods, key)
    test, validation = setup.sets["test"].prompts, setup.sets["validation"].prompts
    title = (
        f"free_stop, {key}, {len(test)} test prompts × {plan.repeats} repeats, ≤{plan.max_new_tokens} new tokens; "
        f"h and static settings chosen on {len(validation)} validation prompts by {plan.select_by} tok/s"
    )
    print(text_table(TABLE_HEADER, _table_rows(rows), title=title))
    return {"temperature": temperature, "decoders": chosen, "methods": rows}


def fit_stop(
    plan: FreeStopPlan, setup: FreeStopSetup, runner: Runner, decoder: str, key: str
) -> tuple[GuessPredictor, dict]:
    """Fit ``decoder``'s acceptance predictor on the training prompts' verification passes (pool setting), save it
    and print its calibration on the validation prompts; the predictor and its record of free_stop.json."""
    started = time.perf_counter()
    training, validation = setup.sets["training"].prompts, setup.sets["validation"].prompts
    predictor, train_labels, held_out = fit_predictor(
        runner,
        _spec(decoder, plan.pools[decoder]),
        training,
        validation,
        q=plan.feature_q,
        c=plan.predictor_c,
        seed=plan.seed,
    )
    path = predictor.save(setup.folder / f"{decoder}-{key}-predictor.json")
    print(
        f"{decoder} {key}: predictor on {len(train_labels)} guessed tokens of {len(training)} training "
        f"prompts (calibration: {predictor.provenance['calibration']['chosen']}); on {held_out['n']:.0f} "
        f"validation tokens ECE {held_out['ece']:.3f}, Brier {held_out['brier']:.3f}, "
        f"AUC {held_out['auc']:.3f}, "
        f"mean predicted {held_out['mean_pred']:.3f} vs accepted {held_out['mean_label']:.3f} "
        f"({time.perf_counter() - started:.0f} s)"
    )
    record = {
        "predictor": str(path),
        "predictor_provenance": predictor.provenance,
        "training_labels": len(train_labels),
        "validation_calibration": held_out,
    }
    return predictor, record


def choose_stop(
    plan: FreeStopPlan,
    setup: FreeStopSetup,
    runner: Runner,
    decoder: str,
    key: str,
    predictor: GuessPredictor,
    bigram: ModelBigram,
) -> tuple[list[dict], MethodSpec, MethodSpec]:
    """Decode the validation prompts with every static setting of ``decoder`` and with its pool under the adaptive
    stop at every h (with and without the cost cap); their rows, the best static setting and the best adaptive one."""
    static = [_spec(decoder, s) for s in plan.static[decoder]]
    adaptive = [
        _spec(decoder, plan.pools[decoder], AdaptiveRowStop(predictor, h, bigram, setup.cost if cap else None))
        for h in plan.thresholds
        for cap in plan.cost_cap
    ]
    validation = setup.sets["validation"].prompts
    print(f"{decoder} {key}: validating {len(static + adaptive)} settings on {len(validation)} prompts")
    runs = run_interleaved(runner, static + adaptive, validation, plan.seed, desc=f"{decoder} validation")
    summaries = summarize(static + adaptive, runs, setup.cost)
    best_static = best_of(summaries[: len(static)], plan.select_by).spec
    best_adaptive = best_of(summaries[len(static) :], plan.select_by).spec
    return [_row(s) for s in summaries], best_static, best_adaptive


def decode_test(
    plan: FreeStopPlan, setup: FreeStopSetup, runner: Runner, methods: list[MethodSpec], key: str
) -> list[dict]:
    """Decode the test prompts with ``methods`` interleaved, ``repeats`` times after the warm-up; their rows, with
    tokens/s ratios to autoregressive decoding and to the static setting of the same decoder."""
    test = setup.sets["test"].prompts
    print(f"{key}: {len(methods)} methods on {len(test)} test prompts × {plan.repeats} repeats")
    runs = run_interleaved(runner, methods, test, plan.seed, plan.repeats, plan.warmup, desc=f"{key} test")
    rows = [_row(s) for s in summarize(methods, runs, setup.cost)]
    base = rows[0]["tokens_per_second"]["median"]
    for i, row in enumerate(rows):
        row["ratio_to_autoregressive"] = row["tokens_per_second"]["median"] / base if base else None
        if row["decoder"] != "autoregressive":  # an adaptive row follows its decoder's static one
            ref = rows[i - 1] if row["adaptive"] else row
            row["ratio_to_static"] = row["tokens_per_second"]["median"] / ref["tokens_per_second"]["median"]
            row["modeled_ratio_to_static"] = row["modeled_tokens_per_second"] / ref["modeled_tokens_per_second"]
    return rows


def write_free_stop(plan: FreeStopPlan, setup: FreeStopSetup, results: dict) -> dict:
    """Write free_stop.json (the prompt sets, the settings, the tree-cost curve and ``results``); the payload."""
    decoders, target = plan.decoders, plan.pair.target
    payload = {
        "command": "free_stop",
        "machine": machine_info(),
        "target": None if target is None else ModelSpec.coerce(target).to_dict(),
        "bundle": plan.pair.bundle,
        "prompts": {name: s.describe() for name, s in setup.sets.items()},
        "settings": {
            "max_new_tokens": plan.max_new_tokens,
            "repeats": plan.repeats,
            "warmup": plan.warmup,
            "select_by": plan.select_by,
            "thresholds": plan.thresholds,
            "cost_cap": plan.cost_cap,
            "pools": {d: asdict(plan.pools[d]) for d in decoders},
            "static": {d: [asdict(s) for s in plan.static[d]] for d in decoders},
            "bigram_top": plan.bigram_top,
            "feature_q": plan.feature_q,
            "predictor_c": plan.predictor_c,
            "seed": plan.seed,
        },
        "tree_cost": {"source": setup.cost_source, **setup.cost.to_dict()},
        "results": results,
    }
    write_json(setup.folder / "free_stop.json", payload)
    print(f"wrote {setup.folder / 'free_stop.json'}")
    return payload


def _coerce(cls, value):
    return cls(**value) if isinstance(value, dict) else value


def _tree_cost(
    model, source: str, sizes: list[int] | None, pools: dict, repeats: int, seed: int
) -> tuple[TreeCost, str]:
    """The cost-per-tree-size curve: measured now (up to the largest pool's tree) or read from a JSON file."""
    if source != "measure":
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(
                f"tree_costs={source!r} is neither 'measure' nor an existing tree_costs.json; run once with "
                "--tree_costs measure (it writes one into output_dir)."
            )
        raw = json.loads(path.read_text())
        return TreeCost.from_dict(raw.get("tree_cost", raw)), str(path)
    n, la = pools["ngrammys"], pools["lookahead"]
    largest = max(1 + n.k * n.w, la.window * (la.ngram - 1) + 1 + la.guess_set * (la.ngram - 1))
    sizes = sizes or [1, 2, 4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 81]
    sizes = sorted({*sizes, largest}) if max(sizes) < largest else sorted(set(sizes))
    return measure_tree_costs(model, sizes, repeats=repeats, warmup=max(1, repeats // 5), seed=seed), "measured"
