"""``python -m eval calibration``: how well the head's acceptance probabilities match what happens.

Two views, each raw and after the bundle's calibration map, beside the draft's own probability of the candidate
q(y) (the training-free predictor ConfidenceThreshold stops on) scored as a predictor of the same labels:

* **offline** — on a ``data_gen`` dataset, scored as in training: the draft reads (prompt, Z) with Z the token-mixed
  response (Z_i = X_i with probability r, else the draft's Y_i) and the head scores every position holding a Y_i
  against its soft label min(1, p_i(Y_i)/q_i(Y_i)).
* **on-policy** — on the states the adaptive decoder actually visits: SpecDec++ decodes prompts and every scored
  candidate y_i is recorded with its prediction and whether it was accepted (candidates after the first rejection are
  never judged and not recorded). This is what the stopping rule relies on at inference.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..acceptance.labels import recorded_temperature
from ..acceptance.metrics import (
    ReliabilityBins,
    binary_auc,
    brier_score,
    expected_calibration_error,
    reliability_bins,
    soft_auc,
)
from ..acceptance.plots import reliability_plot
from ..chain.policies import HeadThreshold, RoundState
from ..core.prompts import PromptOptions, PromptSet, PromptSource
from ..core.records import machine_info, write_json
from ..core.seeds import seeded_generator
from ..core.tables import text_table
from ..engine.pair_loading import Pair, PairOptions
from ..engine.runner import MethodSpec, Runner, run_interleaved
from ..training.data import is_rollout
from .common import check_labelled_by, fmt, output_folder

VARIANTS = ("raw", "calibrated", "draft confidence")
"""The predictors each view scores: the head raw, the head after its calibration map, the draft's own q(y)."""


def probability_metrics(probs: Sequence[float] | torch.Tensor, labels: Sequence[float] | torch.Tensor) -> dict:
    """ECE (15 equal-width bins), Brier score, soft-label AUC, binarised AUC, mean prediction and label, count."""
    p = torch.as_tensor(probs, dtype=torch.float64).reshape(-1)
    y = torch.as_tensor(labels, dtype=torch.float64).reshape(-1)
    if p.numel() == 0:
        return {"n": 0} | dict.fromkeys(("ece", "brier", "auc", "auc_binary", "mean_pred", "mean_label"), math.nan)
    return {
        "n": int(p.numel()),
        "ece": expected_calibration_error(p, y),
        "brier": brier_score(p, y),
        "auc": soft_auc(p, y),
        "auc_binary": binary_auc(p, y),
        "mean_pred": float(p.mean()),
        "mean_label": float(y.mean()),
    }


def _scored(probs: Sequence[float], labels: Sequence[float]) -> dict:
    """:func:`probability_metrics` and the reliability bins of one predictor."""
    p, y = torch.tensor(probs, dtype=torch.float64), torch.tensor(labels, dtype=torch.float64)
    return {"metrics": probability_metrics(p, y), "reliability": reliability_bins(p, y).__dict__}


@torch.inference_mode()
def offline_predictions(
    pair: Pair, dataset: str, mix_ratio: float = 0.15, seed: int = 0, max_rows: int | None = 200
) -> tuple[list[float], list[float], list[float]]:
    """Raw head probabilities, soft labels and the draft's own probability q_i(Y_i) (the training-free predictor
    ConfidenceThreshold uses) on a data_gen dataset, with training's token mixing (ratio r).

    For each row the draft reads (prompt, Z) once; the hidden state at the position whose input is Z_i = Y_i is the
    head's input e_i (the state SpecDec++ scores y_i with). Mixing is seeded per row from (seed, prompt id).
    """
    from ..acceptance.labels import load_label_dataset
    from ..acceptance.mixing import mix_tokens
    from ..models.features import decoder_matches_lm_head_input, final_hidden_states

    if pair.bundle is None:
        raise ValueError("offline calibration needs a bundle with a head (--bundle).")
    data, meta = load_label_dataset(dataset)
    if is_rollout(meta):
        raise ValueError(
            f"--dataset={dataset!r} holds rollout labels (data_gen's label_mode rollout); the offline view needs "
            "token-level labels (--label_mode sample or greedy). For rollout labels leave out --dataset (the "
            f"on-policy view) or run `python -m eval predictors --dataset {dataset}`."
        )
    check_labelled_by(meta, pair.bundle.draft_spec, dataset, "the bundle's head")
    head, draft = pair.bundle.head, pair.draft
    if head.scalar_inputs:
        raise ValueError(
            f"The head reads {list(head.scalar_inputs)} besides the hidden state, which the offline view (token "
            f"mixing on {dataset}) does not have; leave out --dataset (the on-policy view) or run `python -m eval "
            "label_modes` on rollout labels."
        )
    device = next(draft.parameters()).device
    use_decoder = decoder_matches_lm_head_input(draft)
    rows = held_out_rows(data, dataset, getattr(pair, "bundle_path", None))
    rows = rows if max_rows is None else rows[:max_rows]
    probs: list[float] = []
    labels: list[float] = []
    confidence: list[float] = []
    for index in rows:
        row = data[index]
        prompt = torch.tensor(row["prompt_ids"], dtype=torch.long)
        response = torch.tensor(row["response_ids"], dtype=torch.long)
        drafted = torch.tensor(row["draft_ids"], dtype=torch.long)
        if response.numel() == 0:
            continue
        generator = seeded_generator(seed, 0, str(row["prompt_id"]))
        z, from_draft = mix_tokens(response, drafted, mix_ratio, generator)
        ids = torch.cat([prompt, z])[None, :].to(device)
        hidden = final_hidden_states(draft, ids, use_decoder=use_decoder)[0, prompt.numel() :]  # (N, H)
        scored = head.accept_prob(hidden[from_draft.to(device)]).float().cpu()
        probs += scored.tolist()
        labels += torch.tensor(row["accept_prob"], dtype=torch.float32)[from_draft].tolist()
        confidence += torch.tensor(row["draft_logp"], dtype=torch.float32)[from_draft].exp().tolist()
    return probs, labels, confidence


def held_out_rows(data, dataset: str, bundle_path: str | None) -> list[int]:
    """Indices of the rows of ``data`` whose prompt the bundle's head did not train on: the ``train`` prompt ids of the
    ``split.json`` that ``python -m train fit`` writes into the bundle folder are left out (every row when the bundle
    has none). ValueError when nothing is left."""
    split = Path(bundle_path) / "split.json" if bundle_path else None
    trained = set()
    if split is not None and split.is_file():
        trained = {str(i) for i in json.loads(split.read_text()).get("train") or []}
    rows = [i for i, prompt_id in enumerate(data["prompt_id"]) if str(prompt_id) not in trained]
    if not rows:
        raise ValueError(
            f"Every prompt of --dataset={dataset!r} is one the bundle's head trained on ({split}): the offline view "
            "would score it on its own training data. Pass labels of held-out prompts (e.g. the eval split) or leave "
            "out --dataset."
        )
    if len(rows) < len(data):
        print(
            f"offline view: {len(data) - len(rows)} of {len(data)} rows of {dataset} left out: the head trained on them"
        )
    return rows


@dataclass
class OnPolicy:
    """Every candidate SpecDec++ judged while decoding: raw and calibrated prediction, the draft's probability q(y),
    the label (1 accepted, 0 the first rejected one) and the candidate's 1-based position in its round."""

    raw: list[float] = field(default_factory=list)
    calibrated: list[float] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    labels: list[float] = field(default_factory=list)
    index: list[int] = field(default_factory=list)

    def by_position(self, max_index: int = 10) -> list[dict]:
        """Mean predicted (calibrated) vs realised acceptance per candidate index in the round."""
        out = []
        for i in range(1, max_index + 1):
            members = [k for k, j in enumerate(self.index) if j == i]
            if not members:
                continue
            out.append(
                {
                    "candidate": i,
                    "n": len(members),
                    "mean_pred_raw": sum(self.raw[k] for k in members) / len(members),
                    "mean_pred": sum(self.calibrated[k] for k in members) / len(members),
                    "realised": sum(self.labels[k] for k in members) / len(members),
                }
            )
        return out


class RecordingHeadThreshold(HeadThreshold):
    """SpecDec++'s policy that also records, for every scored candidate, its raw and calibrated predicted acceptance,
    the draft's probability of it, and — after verification — whether it was accepted (1), the first rejected one
    (0), or never judged (dropped)."""

    def __init__(self, base: HeadThreshold) -> None:
        super().__init__(
            base.head,
            base.threshold,
            base.min_candidates,
            base.max_candidates,
            base.calibration,
            unscored=base.unscored,
        )
        self.records = OnPolicy()
        self._raw: list[float] = []
        """The raw scores of the round being drafted (``RoundState.accept_probs`` holds the calibrated ones)."""

    def score(self, hidden: torch.Tensor, state: RoundState | None = None) -> float:
        raw = self.raw_score(hidden, state)
        self._raw.append(raw)
        return float(self.calibration(raw)) if self.calibration is not None else raw

    def update(self, state: RoundState, accepted: int) -> None:
        scored = zip(self._raw, state.accept_probs, state.token_probs)
        records = self.records
        for i, (raw, calibrated, confidence) in enumerate(scored):
            if i > accepted:  # after the first rejection: never judged
                break
            records.raw.append(raw)
            records.calibrated.append(calibrated)
            records.confidence.append(confidence)
            records.labels.append(1.0 if i < accepted else 0.0)
            records.index.append(i + 1)
        self._raw = []


def on_policy_records(
    pair: Pair,
    prompt_set: PromptSet,
    temperature: float,
    max_new_tokens: int,
    threshold: float | None = None,
    seed: int = 0,
) -> OnPolicy:
    """Decode ``prompt_set`` with SpecDec++ (the bundle's h* unless ``threshold``; the sampling h* in either mode)
    through the engine and record every judged candidate."""
    if pair.bundle is None:
        raise ValueError("on-policy calibration needs a bundle with a head (--bundle).")
    h, unscored = pair.bundle.h_star()
    method = MethodSpec("specdecpp", {"threshold": h if threshold is None else threshold, "unscored": unscored})
    runner = _RecordingRunner(pair, max_new_tokens, temperature)
    run_interleaved(runner, [method], prompt_set.prompts, seed, progress=False)
    return runner.recorder.records


class _RecordingRunner(Runner):
    """A :class:`~accept_head.engine.runner.Runner` whose SpecDec++ policy records what it judged
    (:class:`RecordingHeadThreshold`)."""

    def policy(self, spec: MethodSpec) -> RecordingHeadThreshold:
        self.recorder = RecordingHeadThreshold(super().policy(spec))
        return self.recorder


def calibration_views(
    pair: Pair,
    dataset: str | None,
    prompt_set: PromptSet | None,
    temperature: float,
    max_new_tokens: int,
    threshold: float | None,
    mix_ratio: float,
    max_rows: int | None,
    seed: int,
) -> dict:
    """Metrics and reliability bins of every available view ({view: {variant: ...}}) plus on-policy by position."""
    views: dict = {}
    if dataset is not None:
        probs, labels, confidence = offline_predictions(pair, dataset, mix_ratio, seed, max_rows)  # needs a bundle
        meta = json.loads((Path(dataset) / "meta.json").read_text())
        calibration = pair.bundle.calibration_for(greedy=recorded_temperature(meta) == 0)  # the labels' mode's map
        calibrated = probs if calibration is None else [float(calibration(float(p))) for p in probs]
        views["offline"] = {v: _scored(p, labels) for v, p in zip(VARIANTS, (probs, calibrated, confidence))}
    if prompt_set is not None:
        records = on_policy_records(pair, prompt_set, temperature, max_new_tokens, threshold, seed)
        scores = (records.raw, records.calibrated, records.confidence)
        views["on_policy"] = {v: _scored(p, records.labels) for v, p in zip(VARIANTS, scores)}
        views["on_policy"]["by_position"] = records.by_position()
    return views


def calibration_rows(views: dict) -> list[list[str]]:
    rows = []
    for view, variants in views.items():
        for variant in VARIANTS:
            if variant not in variants:
                continue
            m = variants[variant]["metrics"]
            rows.append(
                [
                    f"{view} {variant}",
                    str(m["n"]),
                    fmt(m["ece"], 4),
                    fmt(m["brier"], 4),
                    fmt(m["auc"], 3),
                    fmt(m["mean_pred"], 3),
                    fmt(m["mean_label"], 3),
                ]
            )
    return rows


CALIBRATION_HEADER = ["view", "n", "ECE", "Brier", "AUC", "mean pred", "mean label"]


def position_rows(positions: Sequence[dict]) -> list[list[str]]:
    """Table cells of :meth:`OnPolicy.by_position`: candidate, n, predicted raw and calibrated, realised."""
    return [
        [str(r["candidate"]), str(r["n"]), fmt(r["mean_pred_raw"], 3), fmt(r["mean_pred"], 3), fmt(r["realised"], 3)]
        for r in positions
    ]


def reliability_panels(views: dict) -> dict:
    titles = {"offline": "offline (data_gen, token mixing)", "on_policy": "on-policy (decoder's visited states)"}
    return {
        titles.get(view, view): {
            variant: ReliabilityBins(**variants[variant]["reliability"])
            for variant in ("raw", "calibrated")
            if variant in variants
        }
        for view, variants in views.items()
    }


def calibration(
    dataset: str | None = None,
    prompts: list[PromptSource] | None = None,
    pair: PairOptions | None = None,
    prompt_options: PromptOptions | None = None,
    temperature: float | None = None,
    threshold: float | None = None,
    max_new_tokens: int = 128,
    mix_ratio: float = 0.15,
    max_rows: int | None = 200,
    seed: int = 0,
    output_dir: str = "eval_out/calibration",
) -> dict:
    """Reliability diagram, ECE, Brier score and AUC of a bundle's head — raw and calibrated — offline on a data_gen
    dataset and on-policy on the states SpecDec++ visits while decoding prompts (predicted vs realised acceptance,
    also per candidate index). Writes calibration.json and reliability.png and prints the table. Needs a bundle
    (``--bundle``: the head, its calibration map and h*).

    Args:
        dataset: A data_gen dataset for the offline view (held out from the head's training, e.g. its eval split).
        prompts: Prompt sources for the on-policy view.
        pair: The pair (its bundle is required).
        prompt_options: How prompts are encoded.
        temperature: Decoding temperature of the on-policy view (default: the one the head was trained for).
        threshold: h of the on-policy decoder (default: the bundle's h*).
        max_new_tokens: Tokens generated per prompt in the on-policy view.
        mix_ratio: Token-mixing ratio r of the offline view (the official code trains with 0.15).
        max_rows: Dataset rows used by the offline view (null: all).
        seed: Seed of the mixing, the prompt shuffle and the decoding generators.
        output_dir: Folder for calibration.json and reliability.png.
    """
    pair_options, prompt_options = pair or PairOptions(), prompt_options or PromptOptions()
    pair_options.require_bundle("calibration")
    if dataset is None and not prompts:
        raise ValueError("Nothing to evaluate: give --dataset (offline view) and/or --prompts (on-policy view).")
    folder = output_folder(output_dir)
    pair = pair_options.load()
    temperature = pair.bundle.temperature if temperature is None else float(temperature)
    prompt_set = prompt_options.encode("on-policy", prompts, pair.tokenizer, seed) if prompts else None
    views = calibration_views(
        pair, dataset, prompt_set, temperature, max_new_tokens, threshold, mix_ratio, max_rows, seed
    )
    plot = reliability_plot(reliability_panels(views), folder / "reliability.png", "acceptance head calibration")
    payload = {
        "command": "calibration",
        "machine": machine_info(),
        "pair": pair.describe(),
        "dataset": dataset,
        "prompts": prompt_set.describe() if prompt_set is not None else None,
        "settings": {
            "temperature": temperature,
            "threshold": pair.bundle.threshold if threshold is None else threshold,
            "max_new_tokens": max_new_tokens,
            "mix_ratio": mix_ratio,
            "max_rows": max_rows,
            "seed": seed,
        },
        "views": views,
        "reliability_png": plot.name,
    }
    write_json(folder / "calibration.json", payload)
    print(text_table(CALIBRATION_HEADER, calibration_rows(views), title="acceptance head calibration"))
    if "on_policy" in views:
        rows = position_rows(views["on_policy"]["by_position"])
        print(text_table(["candidate", "n", "pred raw", "pred cal.", "realised"], rows, title="on-policy by position"))
    print(f"wrote {folder / 'calibration.json'} and {plot}")
    return payload
