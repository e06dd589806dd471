"""Score acceptance heads on the same held-out on-policy labels: does a head trained on rollout labels predict real
speculative rounds better than one trained on token-mixing labels?

    python -m eval label_modes --dataset data/labels/label-modes/standalone-heldout \
        --bundles '[runs/label-modes/rollout, runs/label-modes/sample]'   # the defaults

``dataset`` is a ``label_mode: rollout`` dataset (``python -m data_gen``) made with the bundles' draft on prompts none
of them trained or chose anything on: every candidate of real rounds, its drafter's hidden state and its label
min(1, p/q). Each head scores exactly those hidden states, so the heads are compared on the same positions; metrics
are those of training's validation (:func:`accept_head.metrics.acceptance_metrics`), raw and after each bundle's own
calibration map.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import SpecDecPP
from ..calibration import apply_calibration
from ..labels import load_label_dataset, recorded_temperature
from ..metrics import acceptance_metrics
from ..rollout import read_hidden
from ..tables import text_table
from ..training.data import is_rollout

VIEWS = ("raw", "calibrated", "other map")
SHOWN = ("auc", "ece", "brier", "bce", "mean_pred", "mean_label", "positions")


def held_out_states(dataset: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(hidden states (M, d), soft labels (M,), meta) of every candidate of a rollout dataset."""
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
    return hidden, labels, meta


def score(
    bundle: SpecDecPP, hidden: torch.Tensor, labels: torch.Tensor, greedy: bool = False
) -> dict[str, dict[str, float]]:
    """The bundle's head on ``hidden``: metrics of its raw and calibrated predictions against ``labels`` (calibrated
    by the bundle's map for greedy decoding when the labels are greedy ones). A bundle with a greedy map is also
    scored with the other mode's map (``other map``), which shows what a map fitted for the mode buys."""
    head = bundle.head
    if hidden.shape[-1] != head.hidden_size:
        raise ValueError(
            f"The held-out hidden states have width {hidden.shape[-1]} but the head reads {head.hidden_size}: the "
            "dataset was made with another draft than the bundle's."
        )
    param = next(head.parameters())
    with torch.inference_mode():
        logits = head(hidden.to(param.device, param.dtype)).float().cpu()

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
) -> dict:
    """Score every bundle's head on ``dataset``; print one table and write it as JSON to ``output`` when given.

    Args:
        dataset: A rollout label dataset made with the bundles' draft on held-out prompts.
        bundles: SpecDecPP bundle folders (default: the two heads of ``docs/ablations.md``'s label-mode comparison).
        output: Optional JSON file for the scores.
    """
    bundles = bundles or ["runs/label-modes/rollout", "runs/label-modes/sample"]
    hidden, labels, meta = held_out_states(dataset)
    results = {}
    for path in bundles:
        bundle = SpecDecPP.from_pretrained(path)
        data_meta = bundle.provenance.get("data_meta") or {}
        greedy = recorded_temperature(meta) == 0
        results[path] = {"label_mode": data_meta.get("label_mode"), **score(bundle, hidden, labels, greedy)}
    rows = [
        [path, str(r["label_mode"]), view] + [f"{r[view][k]:.4g}" for k in SHOWN]
        for path, r in results.items()
        for view in VIEWS
        if view in r
    ]
    title = f"heads on {dataset} ({int(labels.numel())} held-out candidates)"
    print(text_table(["bundle", "trained on", "view", *SHOWN], rows, title=title))
    payload = {"dataset": dataset, "candidates": int(labels.numel()), "heads": results}
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(payload, indent=2) + "\n")
    return payload
