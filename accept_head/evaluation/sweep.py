"""``python -m eval sweep``: any stop policies × parameter grids on prompt sets — verification rate, discard rate,
measured and modeled tokens/s, mean accepted length — and the Pareto plot of SpecDec++'s Figure 4."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.costs import CostModel
from ..core.prompts import PromptOptions, PromptSet, PromptSource
from ..core.records import machine_info, write_json
from ..core.tables import text_table
from ..engine.pair_loading import Pair, PairOptions
from ..engine.runner import MethodSpec, MethodSummary, PolicyGrid, Runner, expand_grids, run_interleaved, summarize
from .common import fmt, output_folder, resolve_cost_model
from .plots import pareto_plot

DEFAULT_GRIDS: list[dict] = [
    {"kind": "autoregressive"},
    {"kind": "fixed_k", "grid": {"k": [1, 2, 3, 4, 6, 8, 10, 12]}},
    {"kind": "specdecpp", "grid": {"threshold": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]}},
    {"kind": "heuristic"},
    {"kind": "confidence", "grid": {"tau": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]}},
    {"kind": "entropy", "grid": {"threshold": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]}},
    {"kind": "path_confidence", "grid": {"threshold": [0.5, 0.7, 0.8, 0.9, 0.95, 0.98]}},
    {"kind": "oracle"},
]
"""The grid ``sweep`` runs when no ``--policies`` are given (SpecDec++'s needs a bundle and is skipped without)."""


def temperature_key(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"T={temperature:g}"


def sweep_table(summaries: Sequence[MethodSummary], title: str) -> str:
    """Terminal table of a sweep (speedups in measured tokens/s against its autoregressive run, if any)."""
    baseline = next((s for s in summaries if s.spec.kind == "autoregressive"), None)
    base = baseline.median_tokens_per_second if baseline is not None else None
    rows = [
        [
            s.spec.name,
            fmt(s.median_tokens_per_second),
            fmt(s.pooled.modeled_tokens_per_second),
            fmt(s.median_tokens_per_second / base, 2, "x") if base else "–",
            fmt(s.pooled.verification_rate, 3),
            fmt(s.pooled.discard_rate, 3),
            "–" if s.spec.kind == "autoregressive" else f"{s.pooled.mean_accepted:.2f}/{s.pooled.mean_proposed:.2f}",
        ]
        for s in summaries
    ]
    header = ["method", "tok/s", "modeled tok/s", "vs AR", "verif. rate", "discard rate", "accepted/proposed"]
    return text_table(header, rows, title=title)


def run_sweep(
    pair: Pair,
    prompt_set: PromptSet,
    specs: Sequence[MethodSpec],
    temperature: float,
    max_new_tokens: int,
    cost_model: CostModel | None,
    seed: int = 0,
    progress: bool = True,
    bigram_cache: str | None = None,
    outputs: dict[str, list[list[tuple[int, ...]]]] | None = None,
    ignore_eos: bool = False,
    warmup: int = 0,
    **runner_options: Any,
) -> tuple[list[MethodSummary], list[dict]]:
    """Run every spec that can run at ``temperature`` on ``prompt_set``; return the summaries and the skipped specs
    (with the reason). ``outputs``, when a dict, receives each decode's new tokens (see :func:`run_decoders`);
    ``ignore_eos`` decodes past EOS so every method writes exactly ``max_new_tokens``; the first ``warmup`` prompts
    are decoded once by every method before timing; ``runner_options`` go to :class:`Runner` (e.g. ``tree_cost``,
    ``tree_models``)."""
    runner = Runner(
        pair, max_new_tokens, temperature, bigram_cache=bigram_cache, ignore_eos=ignore_eos, **runner_options
    )
    runnable, skipped = [], []
    for spec in specs:
        reason = runner.supports(spec)
        if reason:
            skipped.append({**spec.to_dict(), "reason": reason})
        else:
            runnable.append(spec)
    runs = run_interleaved(
        runner,
        runnable,
        prompt_set.prompts,
        seed=seed,
        warmup=warmup,
        progress=progress,
        desc=f"{prompt_set.name} {temperature_key(temperature)}",
        outputs=outputs,
    )
    return summarize(runnable, runs, cost_model), skipped


def sweep(
    prompts: list[PromptSource],
    pair: PairOptions | None = None,
    prompt_options: PromptOptions | None = None,
    policies: list[PolicyGrid] | None = None,
    temperatures: list[float] | None = None,
    max_new_tokens: int = 128,
    cost_model: str = "bundle",
    seed: int = 0,
    output_dir: str = "eval_out/sweep",
    progress: bool = True,
) -> dict:
    """Decode a prompt set with stop policies over parameter grids and compare them.

    For every temperature and method: verification rate N_target/N, discard rate N_discarded/N, measured tokens/s,
    modeled tokens/s (eq. 2.1 with the cost model) and mean accepted/proposed candidates per round. Methods are run
    interleaved per prompt with the same per-prompt seeds. Writes sweep.json and one Pareto plot (verification vs
    discard rate) per temperature, and prints a table per temperature.

    Args:
        prompts: Prompt sources, e.g. ``[{path: humaneval, limit: 16}]`` or files with ``field`` and ``split``.
        pair: The pair; its bundle is needed for the ``specdecpp`` policies.
        prompt_options: How prompts are encoded.
        policies: Method grids, e.g. ``[{kind: fixed_k, grid: {k: [2, 4]}}, {kind: entropy, grid: {threshold:
            [0.3, 0.5]}}]``; kinds: autoregressive, fixed_k, specdecpp, heuristic, confidence, entropy,
            path_confidence, hf_assisted, oracle. Default: :data:`DEFAULT_GRIDS`.
        temperatures: Sampling temperatures (0 = greedy; the oracle runs only there). Default [0, 1].
        max_new_tokens: Tokens generated per prompt (at most).
        cost_model: ``bundle``, ``measure`` or a costs.json from ``python -m eval costs``.
        seed: Seed of the prompt shuffle and of every decoding generator.
        output_dir: Folder for sweep.json and the PNGs.
        progress: Show a progress bar.
    """
    pair_options, prompt_options = pair or PairOptions(), prompt_options or PromptOptions()
    temperatures = [0.0, 1.0] if temperatures is None else [float(t) for t in temperatures]
    grids = policies if policies is not None else [PolicyGrid(**g) for g in DEFAULT_GRIDS]
    specs = expand_grids(grids)
    if not specs:
        raise ValueError("No methods to sweep: give --policies with at least one grid.")
    folder = output_folder(output_dir)
    pair = pair_options.load()
    if pair.bundle is None and policies is None:  # the default grids' SpecDec++ needs a bundle
        specs = [s for s in specs if s.kind != "specdecpp"]
    prompt_set = prompt_options.encode("prompts", prompts, pair.tokenizer, seed)
    model, model_source = resolve_cost_model(cost_model, pair, seed)
    results: dict = {}
    for temperature in temperatures:
        key = temperature_key(temperature)
        summaries, skipped = run_sweep(pair, prompt_set, specs, temperature, max_new_tokens, model, seed, progress)
        print(sweep_table(summaries, f"sweep, {key}, {len(prompt_set.prompts)} prompts"))
        plot = pareto_plot(
            summaries,
            folder / f"pareto_{key.replace('=', '')}.png",
            f"{key}, {len(prompt_set.prompts)} prompts, ≤{max_new_tokens} new tokens",
        )
        results[key] = {
            "temperature": temperature,
            "methods": [s.to_dict() for s in summaries],
            "skipped": skipped,
            "pareto_png": plot.name,
        }
    payload = {
        "command": "sweep",
        "machine": machine_info(),
        "pair": pair.describe(),
        "prompts": prompt_set.describe(),
        "settings": {"max_new_tokens": max_new_tokens, "seed": seed, "prompt_mode": prompt_options.prompt_mode},
        "cost_model": {"source": model_source, **model.to_dict()},
        "results": results,
    }
    write_json(folder / "sweep.json", payload)
    print(f"wrote {folder / 'sweep.json'} and {len(results)} Pareto plot(s)")
    return payload
