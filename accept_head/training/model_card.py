"""Model cards: the README.md of an exported SpecDec++ bundle, written from what the run measured, and the Markdown
pieces every card in ``training`` is built from (:func:`card`, :func:`section`, :func:`blocks`, :func:`front_matter`,
:func:`plain_table`, :func:`read_json`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.tables import markdown_table
from ..engine.sweep import markdown_table as sweep_table
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

# ---- the pieces of every card ---------------------------------------------------------------------------------------


def card(*parts: str) -> str:
    """A model card's text: its parts (front matter, blocks, sections) in order, ending in exactly one newline."""
    return "".join(parts).rstrip("\n") + "\n"


def blocks(*parts: str) -> str:
    """Markdown blocks (a heading, a paragraph, a list, a table, a code fence), each followed by a blank line."""
    return "".join(f"{part}\n\n" for part in parts)


def section(title: str, *parts: str) -> str:
    """A ``## title`` section: the heading, then its blocks."""
    return blocks(f"## {title}", *parts)


def front_matter(**fields: str) -> str:
    """The YAML header of a Hugging Face model card, one ``key: value`` line per field, in order."""
    return blocks("---\n" + "".join(f"{key}: {value}\n" for key, value in fields.items()) + "---")


def plain_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table without column alignment (the draft cards' tables); with no rows, an empty line stands under
    its rule, as those cards have always written it."""
    return markdown_table(header, rows, "-" * len(header)) + ("" if rows else "\n")


def read_json(path: Path, default: Any = None) -> Any:
    """The JSON in ``path``, or ``default`` when there is no such file (a stage that did not run)."""
    return json.loads(path.read_text()) if path.is_file() else default


# ---- the bundle's card ----------------------------------------------------------------------------------------------


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
    return card(
        _intro(name, bundle),
        _data(datamodule),
        _split(datamodule.split_record()),
        _training(datamodule, provenance, hparams, command),
        section("Validation metrics (final head, raw probabilities)", _metrics_table(report.val_metrics)),
        _calibration(report, datamodule),
        _cost_model(report),
        _threshold_sweep(report, bundle),
        _closing(report),
    )


def _head_reads(bundle: SpecDecPP) -> str:
    """What the head reads, in words (``inputs`` in its config)."""
    head = bundle.head
    reads = (["the draft's final hidden state"] if head.reads_hidden else []) + [
        f"`{name}`" for name in head.scalar_inputs
    ]
    text = reads[0] if len(reads) == 1 else ", ".join(reads[:-1]) + " and " + reads[-1]
    return text + (" (its logit a learned correction of logit(q))" if head.residual_on == "logq" else "")


def _intro(name: str, bundle: SpecDecPP) -> str:
    """The title, what the bundle holds, and how to load it."""
    summary = (
        f"A `SpecDecPP` bundle (accept-head): target {_spec(bundle.target_spec, name)}, "
        f"draft {_spec(bundle.draft_spec, name)}, "
        f"a depth-{bundle.head.depth} acceptance head (width {bundle.head.out.in_features}) on {_head_reads(bundle)}, "
        f"stopping threshold **h\\* = {bundle.threshold:g}**{_unscored(bundle)}, "
        f"{bundle.min_candidates}–{bundle.max_candidates} "
        "candidates per round. Decoding is lossless: the output is distributed exactly as the target's."
    )
    if bundle.context_row:
        summary += (
            f" `generate` verifies up to {bundle.context_row} tokens copied from the text beside each chain "
            "(`context_row`)."
        )
    if bundle.tree:
        settings = ", ".join(f"`{key}: {value}`" for key, value in sorted(bundle.tree.items()))
        summary += f" `generate(tree=True)` grows draft trees with the bundle's tree settings: {settings}."
    usage = [
        "```python",
        "from accept_head import SpecDecPP",
        "",
        f'sd = SpecDecPP.from_pretrained("{name}")',
        'out = sd.generate("Write a Python function that reverses a string.", max_new_tokens=128)',
        "print(out.text, out.stats.verification_rate, out.stats.discard_rate)",
        "```",
    ]
    return blocks(f"# {Path(name).name}: SpecDec++ acceptance head", summary, "\n".join(usage))


def _data(datamodule) -> str:
    """The label dataset, its sources and its counts."""
    meta, sampling = datamodule.meta, datamodule.sampling
    lines = [
        f"- Label dataset `{datamodule.path}` written by `python -m data_gen` (format {meta.get('format')} "
        f"v{meta.get('format_version')}), label mode `{meta.get('label_mode')}`, sampling transform "
        f"temperature {sampling.temperature:g}, top_k {sampling.top_k}, top_p {sampling.top_p}; responses up to "
        f"{meta.get('max_new_tokens')} tokens, data_gen seed {meta.get('seed')}."
    ]
    lines += [
        f"- Source `{source.get('name')}` (`{source.get('path')}`, hash split {source.get('split') or 'all'}): "
        f"{source.get('rows')} prompts labelled."
        for source in meta.get("sources", [])
    ]
    stats = meta.get("stats", {})
    if stats:
        labelled = (
            f"{stats['candidates']} labelled candidates in {stats.get('rounds')} speculative rounds"
            if "candidates" in stats
            else f"{stats.get('tokens')} labelled tokens"
        )
        lines.append(
            f"- {stats.get('rows')} responses, {labelled}, mean soft label {_fmt(stats.get('mean_accept_prob'))}, "
            f"mean expected acceptance {_fmt(stats.get('mean_expected_accept'))}."
        )
    return section("Data", "\n".join(lines))


def _split(split: dict[str, Any]) -> str:
    """The prompt-level split and how the training tokens were mixed."""
    held_out = f"val_size {split['val_size']}" if split.get("val_size") else f"val_fraction {split.get('val_fraction')}"
    prompts = (
        f"- Prompt-level, seeded (split_seed {split.get('seed')}): {split.get('n_train')} training prompts, "
        f"{split.get('n_val')} validation prompts ({held_out}); the ids are in `split.json`. "
        f"Rows dropped: {split.get('dropped')}."
    )
    mixing = (
        f"- Token mixing ratio r = {split.get('mix_ratio')}, resampled every epoch (mix_seed {split.get('mix_seed')})."
        if not split.get("rollout")
        else "- On-policy rollout labels: the head read what the drafter stored for each candidate (its hidden state "
        "and its own numbers; no token mixing)."
    )
    return section("Split", f"{prompts}\n{mixing}")


def _training(datamodule, provenance: dict[str, Any], hparams: dict[str, Any] | None, command: str | None) -> str:
    """The head's hyperparameters, the optimisation and the command that ran it."""
    lines = []
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
    return section("Training", "\n".join(lines))


def _metrics_table(metrics: dict[str, float]) -> str:
    """The final head's validation metrics, one row per :data:`METRIC_ROWS` entry (n/a when not measured)."""
    rows = [[label, _fmt(metrics.get(key, float("nan")))] for key, label in METRIC_ROWS]
    return markdown_table(["metric", "value"], rows, "-r")


def _calibration(report: FitReport, datamodule) -> str:
    """The calibration map kept (and the greedy one), with the scores that chose it."""
    choice = report.calibration_choice
    if choice is None:
        return section("Calibration", "Calibration was not run; the head's raw probabilities are used.")
    parts = [f"Kept: **{choice.chosen}** (lowest ECE; scores {choice.evaluation})."]
    if report.calibration_excluded:
        parts.append(
            f"Fitted on the validation labels less the {len(report.calibration_excluded)} prompts the closing "
            "comparison reports on, so those prompts chose nothing."
        )
    parts.append(_scores_table(choice, "map"))
    greedy = report.greedy_calibration_choice
    if greedy is not None:
        prompts = len(set(datamodule.split.get("greedy", [])) - set(report.calibration_excluded))
        parts.append(
            f"Greedy decoding uses a second map, fitted on greedy labels of {prompts} "
            f"prompts the head did not train on (`{datamodule.greedy_path}`): kept **{greedy.chosen}** "
            f"(scores {greedy.evaluation})."
        )
        parts.append(_scores_table(greedy, "map (greedy labels)"))
    if "reliability" in report.artifacts:
        parts.append("![reliability diagram](reliability.png)")
    return section("Calibration", *parts)


def _cost_model(report: FitReport) -> str:
    """The cost model's draft and target times, and where they come from."""
    cost = report.cost_model
    if cost is None:
        return section("Cost model", "No cost model; h\\* was chosen by measured tokens/s.")
    r2 = f", R² {cost.r2:.3f}" if cost.r2 is not None else ""
    head = (
        f"; the head {1e3 * cost.t_head:.2f} ms of it, which the rules that never call it do not pay"
        if cost.t_head is not None
        else ""
    )
    return section(
        "Cost model",
        f"t_draft = {1e3 * cost.t_draft:.2f} ms (draft step + head; {1e3 * cost.t_step:.2f} ms after a round's first"
        f"{head}), t_target(K) = {1e3 * cost.t_target_a:.2f} + "
        f"{1e3 * cost.t_target_b:.3f}·K ms{r2} — {report.cost_model_source}.",
    )


def _threshold_sweep(report: FitReport, bundle: SpecDecPP) -> str:
    """How h* was chosen: the sweep's table against autoregressive decoding, and the greedy h*."""
    if report.sweep is None:
        return section("Threshold sweep", f"No sweep ran; h = {bundle.threshold:g} was set in the config.")
    base = next(iter(report.sweep.family("autoregressive")), None)
    parts = [
        f"h\\* = {bundle.threshold:g}: {report.threshold_selection}. Speedup is measured tokens/s over "
        "autoregressive decoding of the target; rates are per generated token.",
        sweep_table(report.sweep.rows, base),
    ]
    if bundle.greedy_threshold is not None:
        unscored = f" (unscored = {bundle.greedy_unscored})" if bundle.greedy_unscored else ""
        parts.append(
            f"Greedy decoding uses its own h\\* = {bundle.greedy_threshold:g}{unscored}: "
            f"{report.greedy_threshold_selection}."
        )
    if "pareto" in report.artifacts:
        parts.append("![verification rate vs discard rate](pareto.png)")
    return section("Threshold sweep", *parts)


def _closing(report: FitReport) -> str:
    """SpecDec++ at h* beside the baselines on held-out prompts (nothing when the comparison did not run)."""
    if not report.closing:
        return ""
    base = next((r for r in report.closing if r.family == "autoregressive"), None)
    parts = [f"On {report.closing_prompts}.", sweep_table(report.closing, base)]
    if any(row.family == "ablated" for row in report.closing):
        parts.append(
            "*head ablated*: the same stopping rule on the draft's own path probability 1 − Π q(y_j) instead of the "
            "head's, at its best h on the sweep's prompts, and no head call: what the head adds over what the draft "
            "already knows."
        )
    return section("SpecDec++ vs. baselines", *parts)


def _fmt(value: Any) -> str:
    """A metric as the card prints it: large whole floats as integers, other floats to 4 places, NaN as n/a."""
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
    extra += f", decoding with {spec.quantize} weights" if spec.quantize else ""
    return f"`{spec.path}` ({spec.dtype}{extra})"


def _scores_table(choice, header: str) -> str:
    """A calibration choice's ECE and Brier score per candidate map, as a Markdown table."""
    rows = [[n, _fmt(s["ece"]), _fmt(s["brier"])] for n, s in choice.scores.items()]
    return markdown_table([header, "ECE", "Brier"], rows, "-rr")


def _unscored(bundle) -> str:
    """How the stop rule counts the newest, not yet scored candidate (nothing for the paper's Alg. 2)."""
    if bundle.unscored == "confidence":
        return " (the newest, not yet scored candidate counted by its draft probability, so a round can stop at one)"
    return ""
