"""Score acceptance heads on the same held-out on-policy labels: does a head trained on rollout labels predict real
speculative rounds better than one trained on token-mixing labels? And, given test prompts, how fast does each
decode?

    python -m eval label_modes --dataset data/labels/label-modes/standalone-heldout \
        --bundles '[runs/label-modes/rollout, runs/label-modes/sample]'   # the defaults
    python -m eval label_modes ... --prompts '[{path: humaneval, offset: 64, limit: 4}]' --temperatures '[1]'

``dataset`` is a ``label_mode: rollout`` dataset (``python -m data_gen``) made with the bundles' draft on prompts none
of them trained or chose anything on: every candidate of real rounds, its drafter's hidden state and its label
min(1, p/q) (and the scalar inputs heads beyond the paper's read, :mod:`accept_head.acceptance.inputs`). Each head
scores exactly those candidates, so the heads are compared on the same positions; metrics
are those of training's validation (:func:`accept_head.acceptance.metrics.acceptance_metrics`), raw and after each
bundle's own
calibration map.

With ``prompts``, every bundle also decodes them at its own h* (the bundles must share one target and draft), beside
the autoregressive target and any ``fixed_k`` rows, interleaved prompt by prompt (:func:`~accept_head.engine.runner.
run_decoders`) with the same seeds, and the table of measured and modeled tokens/s is printed per temperature. The
prompts must be ones that chose nothing for these bundles (not their training, calibration or sweep prompts).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..acceptance.calibration import apply_calibration
from ..acceptance.inputs import HIDDEN, SCALAR_INPUTS, SOURCES, require_inputs, stored_inputs
from ..acceptance.labels import load_label_dataset, recorded_temperature
from ..acceptance.metrics import acceptance_metrics
from ..chain.rollout import read_hidden
from ..core.prompts import PromptOptions, PromptSource
from ..core.tables import text_table
from ..engine.pair_loading import load_pair
from ..engine.runner import MethodSpec, Runner, h_star_spec, run_decoders, summarize
from ..specdecpp.bundle import SpecDecPP
from ..training.data import is_rollout
from .bench import BENCH_HEADER, _method_rows, _with_ratios
from .common import resolve_cost_model
from .sweep import temperature_key

VIEWS = ("raw", "calibrated", "other map")
SHOWN = ("auc", "ece", "brier", "bce", "mean_pred", "mean_label", "positions")


def held_out_states(dataset: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(hidden states (M, d), soft labels (M,), scalar inputs (M, S) — NaN where the dataset lacks one —, meta) of
    every candidate of a rollout dataset."""
    data, meta = load_label_dataset(dataset)
    if not is_rollout(meta):
        raise ValueError(
            f"{dataset} holds label_mode={meta.get('label_mode')!r} labels; scoring needs on-policy rollout labels "
            "with stored hidden states (python -m data_gen ... --label_mode rollout)."
        )
    counts = [len(labels) for labels in data["accept_prob"]]
    first = next((i for i, n in enumerate(counts) if n), None)
    if first is None:
        raise ValueError(f"{dataset} holds no labelled candidates.")
    hidden = torch.cat(read_hidden(data, len(data[first]["hidden"]) // counts[first], counts))
    labels = torch.tensor([x for row in data["accept_prob"] for x in row], dtype=torch.float32)
    columns = {c: [x for row in data[c] for x in row] for c in SOURCES if c in data.column_names}
    inputs = stored_inputs(columns, len(labels))
    return hidden, labels, inputs, meta


def score(
    bundle: SpecDecPP,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    greedy: bool = False,
    inputs: torch.Tensor | None = None,
) -> dict[str, dict[str, float]]:
    """The bundle's head on ``hidden`` (and the scalar ``inputs`` (M, S) of :func:`held_out_states` when it reads
    them): metrics of its raw and calibrated predictions against ``labels`` (calibrated by the bundle's map for greedy
    decoding when the labels are greedy ones). A bundle with a greedy map is also scored with the other mode's map
    (``other map``), which shows what a map fitted for the mode buys."""
    head = bundle.head
    held = [HIDDEN] + (
        [] if inputs is None else [n for i, n in enumerate(SCALAR_INPUTS) if inputs[:, i].isfinite().all()]
    )
    require_inputs(head.inputs, held, "the held-out dataset")
    scalars = None if inputs is None else inputs[:, [SCALAR_INPUTS.index(n) for n in head.scalar_inputs]]
    if hidden.shape[-1] != head.hidden_size:
        raise ValueError(
            f"The held-out hidden states have width {hidden.shape[-1]} but the head reads {head.hidden_size}: the "
            "dataset was made with another draft than the bundle's."
        )
    param = next(head.parameters())
    with torch.inference_mode():
        scalars = None if scalars is None else scalars.to(param.device)
        logits = head(hidden.to(param.device, param.dtype), scalars).float().cpu()

    def calibrated(calibration) -> dict[str, float]:
        probs = apply_calibration(calibration, torch.sigmoid(logits)).clamp(1e-6, 1 - 1e-6)
        return acceptance_metrics(torch.logit(probs), labels)

    views = {"raw": acceptance_metrics(logits, labels), "calibrated": calibrated(bundle.calibration_for(greedy))}
    if bundle.greedy_calibration is not None:
        views["other map"] = calibrated(bundle.calibration_for(not greedy))
    return views


def label_modes(
    dataset: str = "data/labels/label-modes/standalone-heldout",
    bundles: list[str] | None = None,
    output: str | None = None,
    prompts: list[PromptSource] | None = None,
    prompt_options: PromptOptions | None = None,
    temperatures: list[float] | None = None,
    max_new_tokens: int = 96,
    repeats: int = 3,
    warmup: int = 1,
    fixed_k: list[int] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Score every bundle's head on ``dataset``; print one table and write it as JSON to ``output`` when given.
    With ``prompts``, also decode them with every bundle at its h*, interleaved, and add the throughput tables.

    Args:
        dataset: A rollout label dataset made with the bundles' draft on held-out prompts.
        bundles: SpecDecPP bundle folders (default: the two heads of ``docs/findings.md``'s label-mode comparison).
        output: Optional JSON file for the scores.
        prompts: Test prompt sources to measure each bundle's tokens/s on (none: scores only).
        prompt_options: How the test prompts are encoded.
        temperatures: Sampling temperatures of the throughput runs (0 is greedy). Default [1].
        max_new_tokens: Tokens generated per prompt, the same for every method.
        repeats: Timed passes over the test prompts (tokens/s is the median over them).
        warmup: Test prompts decoded once by every method before timing.
        fixed_k: FixedK rows decoded beside the bundles (K chosen elsewhere, e.g. by ``python -m eval bench``).
        seed: Seed of the per-prompt generators.
        progress: Show progress bars.
    """
    bundles = bundles or ["runs/label-modes/rollout", "runs/label-modes/sample"]
    hidden, labels, inputs, meta = held_out_states(dataset)
    results = {}
    for path in bundles:
        bundle = SpecDecPP.from_pretrained(path)
        data_meta = bundle.provenance.get("data_meta") or {}
        greedy = recorded_temperature(meta) == 0
        results[path] = {"label_mode": data_meta.get("label_mode"), **score(bundle, hidden, labels, greedy, inputs)}
        del bundle
    rows = [
        [path, str(r["label_mode"]), view] + [f"{r[view][k]:.4g}" for k in SHOWN]
        for path, r in results.items()
        for view in VIEWS
        if view in r
    ]
    title = f"heads on {dataset} ({int(labels.numel())} held-out candidates)"
    print(text_table(["bundle", "trained on", "view", *SHOWN], rows, title=title))
    payload = {"dataset": dataset, "candidates": int(labels.numel()), "heads": results}
    if prompts:
        payload["throughput"] = decode_throughput(
            bundles,
            prompts,
            prompt_options or PromptOptions(),
            temperatures or [1.0],
            max_new_tokens,
            repeats,
            warmup,
            fixed_k or [],
            seed,
            progress,
        )
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(payload, indent=2) + "\n")
    return payload


def decode_throughput(
    bundles: list[str],
    prompts: list[PromptSource],
    prompt_options: PromptOptions,
    temperatures: list[float],
    max_new_tokens: int,
    repeats: int,
    warmup: int,
    fixed_k: list[int],
    seed: int,
    progress: bool,
) -> dict:
    """Tokens/s of every bundle at its own h* on ``prompts`` beside the autoregressive target (and FixedK rows),
    interleaved, per temperature; priced by the first bundle's cost model. ``{temperature key: {"prompts": ids,
    "methods": [method dicts as the bench writes them]}}``."""
    pair = load_pair(bundles[0])
    heads = {bundles[0]: pair.bundle}
    first = SpecDecPP.read_config(bundles[0])
    for path in bundles[1:]:
        other = SpecDecPP.read_config(path)
        for role in ("target", "draft"):
            if other[role] != first[role]:
                raise ValueError(
                    f"{path} was trained for {role} {other[role]} but {bundles[0]} for {first[role]}; throughput "
                    "is compared on one pair: pass bundles of the same target and draft."
                )
        heads[path] = SpecDecPP.from_pretrained(path, target=pair.target, draft=pair.draft, tokenizer=pair.tokenizer)
    cost_model, _ = resolve_cost_model("bundle", pair, seed)
    test = prompt_options.encode("test", prompts, pair.tokenizer, seed=seed)
    out = {}
    for temperature in temperatures:
        runners = {path: Runner(pair, max_new_tokens, temperature, head=bundle) for path, bundle in heads.items()}
        specs = [MethodSpec("autoregressive"), *[MethodSpec("fixed_k", {"k": k}) for k in fixed_k]]
        decoders = {spec.name: runners[bundles[0]].decoder(spec) for spec in specs}
        for path, runner in runners.items():
            own = h_star_spec(heads[path], greedy=temperature == 0)
            spec = MethodSpec(own.kind, own.params, label=f"{own.name} ({path})")
            decoders[spec.name] = runner.decoder(spec)
            specs.append(spec)
        key = temperature_key(temperature)
        runs = run_decoders(decoders, test.prompts, seed, repeats, warmup, progress, desc=f"label_modes {key}")
        methods = _with_ratios(summarize(specs, runs, cost_model))
        title = f"{key}: {len(test.prompts)} test prompts x {repeats} repeats, {max_new_tokens} new tokens"
        print(text_table(BENCH_HEADER, _method_rows(methods), title=title))
        out[key] = {"temperature": temperature, "prompts": [p.id for p in test.prompts], "methods": methods}
    return out
