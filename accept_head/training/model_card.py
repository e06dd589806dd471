"""The README.md model card of an exported SpecDec++ bundle, written from what the run measured."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..engine.sweep import markdown_table
from ..specdecpp.bundle import SpecDecPP, portable_spec
from .report import FitReport

METRIC_ROWS = (
    ("ece", "ECE (15 bins, soft labels)"),
    ("brier", "Brier score"),
    ("auc", "AUC (soft-weighted)"),
    ("auc_binary", "AUC (labels binarised at 0.5)"),
    ("bce", "BCE vs soft labels"),
    ("weighted_bce", "weighted BCE (training loss)"),
    ("mean_pred", "mean prediction"),
    ("mean_label", "mean label"),
    ("positions", "positions"),
)


def _fmt(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 10:
        return str(int(value))
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.4f}"
    return str(value)


def _spec(spec, folder: str) -> str:
    """A model as the bundle in ``folder`` records it."""
    if spec is None:
        return "(not recorded)"
    spec = portable_spec(spec, folder)
    extra = f", gguf_file {spec.gguf_file}" if spec.gguf_file else ""
    return f"`{spec.path}` ({spec.dtype}{extra})"


def model_card(
    name: str,
    bundle: SpecDecPP,
    datamodule,
    report: FitReport,
    provenance: dict[str, Any],
    hparams: dict[str, Any] | None = None,
    command: str | None = None,
) -> str:
    """Markdown describing data, split, training, metrics, calibration, cost model, h* and the sweep."""
    meta = datamodule.meta
    split = datamodule.split_record()
    stats = meta.get("stats", {})
    sampling = datamodule.sampling
    title = Path(name).name
    lines = [
        f"# {title}: SpecDec++ acceptance head",
        "",
        f"A `SpecDecPP` bundle (accept-head): target {_spec(bundle.target_spec, name)}, "
        f"draft {_spec(bundle.draft_spec, name)}, "
        f"a depth-{bundle.head.depth} acceptance head (width {bundle.head.hidden_size}) on the draft's final hidden "
        f"state, stopping threshold **h\\* = {bundle.threshold:g}**{_unscored(bundle)}, "
        f"{bundle.min_candidates}–{bundle.max_candidates} "
        "candidates per round. Decoding is lossless: the output is distributed exactly as the target's.",
        "",
        "```python",
        "from accept_head import SpecDecPP",
        "",
        f'sd = SpecDecPP.from_pretrained("{name}")',
        'out = sd.generate("Write a Python function that reverses a string.", max_new_tokens=128)',
        "print(out.text, out.stats.verification_rate, out.stats.discard_rate)",
        "```",
        "",
        "## Data",
        "",
        f"- Label dataset `{datamodule.path}` written by `python -m data_gen` (format {meta.get('format')} "
        f"v{meta.get('format_version')}), label mode `{meta.get('label_mode')}`, sampling transform "
        f"temperature {sampling.temperature:g}, top_k {sampling.top_k}, top_p {sampling.top_p}; responses up to "
        f"{meta.get('max_new_tokens')} tokens, data_gen seed {meta.get('seed')}.",
    ]
    for source in meta.get("sources", []):
        lines.append(
            f"- Source `{source.get('name')}` (`{source.get('path')}`, hash split {source.get('split') or 'all'}): "
            f"{source.get('rows')} prompts labelled."
        )
    if stats:
        lines.append(
            f"- {stats.get('rows')} responses, "
            + (
                f"{stats['candidates']} labelled candidates in {stats.get('rounds')} speculative rounds"
                if "candidates" in stats
                else f"{stats.get('tokens')} labelled tokens"
            )
            + ", mean soft label "
            f"{_fmt(stats.get('mean_accept_prob'))}, mean expected acceptance "
            f"{_fmt(stats.get('mean_expected_accept'))}."
        )
    lines += [
        "",
        "## Split",
        "",
        f"- Prompt-level, seeded (split_seed {split.get('seed')}): {split.get('n_train')} training prompts, "
        f"{split.get('n_val')} validation prompts ("
        + (f"val_size {split['val_size']}" if split.get("val_size") else f"val_fraction {split.get('val_fraction')}")
        + f"); the ids are in `split.json`. Rows dropped: {split.get('dropped')}.",
        f"- Token mixing ratio r = {split.get('mix_ratio')}, resampled every epoch (mix_seed {split.get('mix_seed')})."
        if not split.get("rollout")
        else "- On-policy rollout labels: the head read the drafter's stored hidden states of each candidate "
        "(no token mixing).",
        "",
        "## Training",
        "",
    ]
    if hparams:
        keys = ("depth", "w_acc", "w_rej", "lr", "weight_decay", "warmup_fraction", "min_lr_ratio")
        lines.append("- " + ", ".join(f"{k} {hparams[k]}" for k in keys if k in hparams) + ".")
    training = provenance.get("training", {})
    lines.append(
        f"- {training.get('epochs')} epochs, {training.get('steps')} optimizer steps, batch size "
        f"{datamodule.batch_size} prompts; AdamW with linear warm-up and cosine decay; the draft stays frozen."
    )
    if command:
        lines.append(f"- Command: `{command}` (full configuration in `config.json` → provenance.config).")
    lines += ["", "## Validation metrics (final head, raw probabilities)", "", "| metric | value |", "|---|---:|"]
    lines += [f"| {label} | {_fmt(report.val_metrics.get(key, float('nan')))} |" for key, label in METRIC_ROWS]
    choice = report.calibration_choice
    lines += ["", "## Calibration", ""]
    if choice is None:
        lines.append("Calibration was not run; the head's raw probabilities are used.")
    else:
        lines += [f"Kept: **{choice.chosen}** (lowest ECE; scores {choice.evaluation}).", ""]
        if report.calibration_excluded:
            lines += [
                f"Fitted on the validation labels less the {len(report.calibration_excluded)} prompts the closing "
                "comparison reports on, so those prompts chose nothing.",
                "",
            ]
        lines += _scores_table(choice, "map")
        greedy = report.greedy_calibration_choice
        if greedy is not None:
            prompts = len(set(datamodule.split.get("greedy", [])) - set(report.calibration_excluded))
            lines += [
                "",
                f"Greedy decoding uses a second map, fitted on greedy labels of {prompts} "
                f"prompts the head did not train on (`{datamodule.greedy_path}`): kept **{greedy.chosen}** "
                f"(scores {greedy.evaluation}).",
                "",
            ]
            lines += _scores_table(greedy, "map (greedy labels)")
        if "reliability" in report.artifacts:
            lines += ["", "![reliability diagram](reliability.png)"]
    cost = report.cost_model
    lines += ["", "## Cost model", ""]
    if cost is None:
        lines.append("No cost model; h\\* was chosen by measured tokens/s.")
    else:
        r2 = f", R² {cost.r2:.3f}" if cost.r2 is not None else ""
        lines.append(
            f"t_draft = {1e3 * cost.t_draft:.2f} ms (draft step + head), t_target(K) = {1e3 * cost.t_target_a:.2f} + "
            f"{1e3 * cost.t_target_b:.3f}·K ms{r2} — {report.cost_model_source}."
        )
    lines += ["", "## Threshold sweep", ""]
    if report.sweep is None:
        lines.append(f"No sweep ran; h = {bundle.threshold:g} was set in the config.")
    else:
        base = next(iter(report.sweep.family("autoregressive")), None)
        lines += [
            f"h\\* = {bundle.threshold:g}: {report.threshold_selection}. Speedup is measured tokens/s over "
            "autoregressive decoding of the target; rates are per generated token.",
            "",
            markdown_table(report.sweep.rows, base),
        ]
        if bundle.greedy_threshold is not None:
            unscored = f" (unscored = {bundle.greedy_unscored})" if bundle.greedy_unscored else ""
            lines += [
                "",
                f"Greedy decoding uses its own h\\* = {bundle.greedy_threshold:g}{unscored}: "
                f"{report.greedy_threshold_selection}.",
            ]
        if "pareto" in report.artifacts:
            lines += ["", "![verification rate vs discard rate](pareto.png)"]
    if report.closing:
        base = next((r for r in report.closing if r.family == "autoregressive"), None)
        lines += ["", "## SpecDec++ vs. baselines", "", f"On {report.closing_prompts}.", ""]
        lines.append(markdown_table(report.closing, base))
    lines.append("")
    return "\n".join(lines)


def _scores_table(choice, header: str) -> list[str]:
    """A calibration choice's ECE and Brier score per candidate map, as markdown table lines."""
    rows = [f"| {n} | {_fmt(s['ece'])} | {_fmt(s['brier'])} |" for n, s in choice.scores.items()]
    return [f"| {header} | ECE | Brier |", "|---|---:|---:|", *rows]


def _unscored(bundle) -> str:
    if bundle.unscored == "confidence":
        return " (the newest, not yet scored candidate counted by its draft probability, so a round can stop at one)"
    return ""
