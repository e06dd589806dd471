"""``python -m eval predictors``: every acceptance predictor scored on the same held-out rollout candidates.

A stop rule is only as good as its estimate of P(y_k accepted | y_<k accepted). This command puts every estimate the
toolkit knows side by side on one ``label_mode: rollout`` dataset (``python -m data_gen``), offline — nothing decodes:

- ``q``: the draft's own probability of the candidate, q_k(y_k) = exp(``draft_logp``) (HF's confidence rule);
- ``eagle2``: EAGLE-2's confidence, the path's cumulative draft probability Π_{j≤k} q_j(y_j) = exp(path log q);
- ``adaedl``: AdaEDL's entropy bound 1 − sqrt(γ·H(q_k)) exactly as :class:`~accept_head.chain.baselines.EntropyStop`
  computes it (:func:`~accept_head.chain.baselines.entropy_lower_bound`), clipped to [0, 1] to be a probability;
- ``c2t``: the C2T-style classifier of :mod:`accept_head.trees.labels` (:data:`~accept_head.trees.labels.
  C2T_FEATURES`: log joint = path log q, entropy, depth, log q) fitted by its own
  :meth:`~accept_head.trees.labels.C2TClassifier.fit` on the *training* prompts' candidates of the same dataset;
- every head given (a bundle folder or a ``python -m train fit`` checkpoint), raw and, for a bundle, after its own
  calibration map for the labels' mode (:meth:`~accept_head.specdecpp.bundle.SpecDecPP.calibration_for`).

Every predictor that is not already calibrated is also scored after an isotonic map fitted on the training prompts'
candidates only (``+ isotonic``), so ECE compares like with like. Metrics, on the held-out prompts' candidates and
again on each round's first candidate alone: AUC against the decode's outcome ``accepted``, on the *judged*
candidates only (those up to and including a round's first rejection: the ones after it were never judged, though
their labels stay valid), the soft-weighted AUC against min(1, p/q), ECE (15 bins) and Brier against min(1, p/q) —
whose expectation is the acceptance probability — and the counts.

The split is by prompt: the training prompts of a bundle's ``split.json`` (``--split``) or of a seeded split like the
data module's (:func:`~accept_head.training.data.prompt_split`); every other prompt of the dataset is held out. A
head trained on a held-out prompt is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..acceptance.calibration import Calibration, apply_calibration, fit_isotonic
from ..acceptance.head import AcceptanceHead
from ..acceptance.inputs import HIDDEN, REGENERATE, SCALAR_INPUTS, SOURCES, require_inputs
from ..acceptance.inputs import stored_inputs as read_inputs
from ..acceptance.labels import load_label_dataset, recorded_temperature
from ..acceptance.metrics import ECE_BINS, binary_auc, brier_score, expected_calibration_error, soft_auc
from ..chain.baselines import entropy_lower_bound
from ..chain.rollout import read_hidden
from ..core.records import code_version, machine_info, write_json
from ..core.tables import markdown_table
from ..models.pairs import ModelSpec
from ..specdecpp.bundle import SpecDecPP
from ..training.data import is_rollout, prompt_split
from ..trees.labels import C2TClassifier
from .common import check_labelled_by, fmt, output_folder

BASELINES = ("q", "eagle2", "adaedl", "c2t")
"""The predictors that need no head (``--baselines``), in table order."""
DESCRIPTIONS = {
    "q": "the draft's probability q(y)",
    "eagle2": "EAGLE-2's path confidence exp(path log q)",
    "adaedl": "AdaEDL's entropy bound 1 - sqrt(gamma H), clipped to [0, 1]",
    "c2t": "C2T classifier (log joint, entropy, depth, log q) fitted on the training prompts",
}
REQUIRED = ("accept_prob", "accepted", *SOURCES)
"""The rollout columns every predictor and metric reads (``hidden`` too when a head reads it)."""
LOG_FLOOR = math.log(1e-30)
"""C2T's features clip probabilities at 1e-30 before the log (:func:`~accept_head.trees.labels.node_features`)."""


@dataclass
class Candidates:
    """Every labelled candidate of a rollout dataset, rows concatenated (C candidates)."""

    path: str
    meta: dict
    prompt_ids: list[str]
    """(C,) the prompt of each candidate."""
    labels: torch.Tensor
    """(C,) float64 soft labels min(1, p/q) (1[y = argmax p] for greedy labels)."""
    accepted: torch.Tensor
    """(C,) bool: whether the decode accepted the candidate."""
    step: torch.Tensor
    """(C,) long: k, the candidate's 1-based index in its round."""
    inputs: torch.Tensor
    """(C, S) float32 scalar inputs in :data:`~accept_head.acceptance.inputs.SCALAR_INPUTS` order."""
    hidden: torch.Tensor | None
    """(C, d) the drafter's hidden states, when a head reads them."""

    @property
    def greedy(self) -> bool:
        return recorded_temperature(self.meta) == 0

    @property
    def judged(self) -> torch.Tensor:
        """(C,) bool: the candidates the decode judged — a round's first one, and each after an accepted one."""
        previous = torch.cat([torch.ones(1, dtype=torch.bool), self.accepted[:-1]])
        return (self.step == 1) | previous

    def column(self, name: str) -> torch.Tensor:
        """(C,) float64 scalar input ``name`` (``logq``, ``entropy``, ``top1``, ``depth``, ``path_logq``)."""
        return self.inputs[:, SCALAR_INPUTS.index(name)].double()

    def among(self, prompts: set[str]) -> torch.Tensor:
        """(C,) bool: the candidates of ``prompts``."""
        return torch.tensor([pid in prompts for pid in self.prompt_ids], dtype=torch.bool)


def load_candidates(path: str, with_hidden: bool) -> Candidates:
    """Every candidate of the rollout dataset at ``path`` (its hidden states only ``with_hidden``); ValueError when it
    is not a rollout dataset or lacks a column the predictors read."""
    data, meta = load_label_dataset(path)
    if not is_rollout(meta):
        raise ValueError(
            f"{path} holds label_mode={meta.get('label_mode')!r} labels; the predictors are compared on rollout "
            f"candidates, which store every scalar and the outcome `accepted`: {REGENERATE}."
        )
    missing = [c for c in (*REQUIRED, *(["hidden"] if with_hidden else [])) if c not in data.column_names]
    if missing:
        raise ValueError(f"{path} lacks the columns {missing} the predictors read: {REGENERATE}.")
    columns = data.select_columns(["prompt_id", *REQUIRED]).to_dict()
    counts = [len(labels) for labels in columns["accept_prob"]]
    if not sum(counts):
        raise ValueError(f"{path} holds no labelled candidate.")
    flat = {name: [x for row in columns[name] for x in row] for name in REQUIRED}
    hidden = None
    if with_hidden:
        width = (meta.get("rollout") or {}).get("hidden_size")
        if not width:
            raise ValueError(f"{path}/meta.json records no rollout.hidden_size: {REGENERATE}.")
        hidden = torch.cat(read_hidden(data, int(width), counts))
    return Candidates(
        path=str(path),
        meta=meta,
        prompt_ids=[pid for pid, n in zip(columns["prompt_id"], counts) for _ in range(n)],
        labels=torch.tensor(flat["accept_prob"], dtype=torch.float64),
        accepted=torch.tensor(flat["accepted"], dtype=torch.bool),
        step=torch.tensor(flat["step"], dtype=torch.long),
        inputs=read_inputs({c: flat[c] for c in SOURCES}),
        hidden=hidden,
    )


# ---- the split -----------------------------------------------------------------------------------------------------


def split_train_ids(
    split: str | None, prompt_ids: list[str], split_seed: int, val_fraction: float, val_size: int | None
) -> tuple[set[str], dict]:
    """The training prompt ids the comparison fits on (every other prompt is held out) and a record of where they
    came from: ``split`` (a bundle folder holding ``split.json``, or such a file) or, without it, the data module's
    seeded split of the dataset's prompts (:func:`~accept_head.training.data.prompt_split`)."""
    if split is None:
        try:
            record = prompt_split(sorted(set(prompt_ids)), val_fraction, val_size, split_seed)
        except ValueError as err:
            raise ValueError(f"{err} (this command's flags: --val_fraction, --val_size)") from err
        source = {"kind": "seeded", "split_seed": split_seed, "val_fraction": val_fraction, "val_size": val_size}
        return set(record["train"]), source
    path = Path(split)
    file = path / "split.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"--split={split!r}: there is no split.json there. Pass a bundle folder `python -m train fit` exported "
            "(it holds split.json), a split.json, or leave --split out for a seeded split (--split_seed, "
            "--val_fraction, --val_size)."
        )
    record = json.loads(file.read_text())
    if not isinstance(record, dict) or not isinstance(record.get("train"), list):
        raise ValueError(
            f"--split={split!r}: {file} has no `train` list of prompt ids; pass a split.json of a fit run."
        )
    return set(record["train"]), {"kind": "file", "file": str(file), "val": list(record.get("val") or [])}


# ---- heads ---------------------------------------------------------------------------------------------------------


@dataclass
class LoadedHead:
    """A head to score, with what is known of how it was made."""

    name: str
    """The path it was given as."""
    kind: str
    """``bundle`` or ``checkpoint``."""
    head: AcceptanceHead
    calibration: Calibration | None = None
    greedy_calibration: Calibration | None = None
    split: dict | None = None
    """Its training run's split (``train`` ids), or a checkpoint's data settings to recompute it from."""
    draft: ModelSpec | None = None
    """The draft it was trained for (None: not recorded)."""

    def calibration_for(self, greedy: bool) -> Calibration | None:
        """The map a bundle decodes this mode with (:meth:`SpecDecPP.calibration_for`); None without one."""
        return self.greedy_calibration if greedy and self.greedy_calibration is not None else self.calibration

    def train_ids(self, dataset: str, prompt_ids: list[str]) -> set[str] | None:
        """The prompts the head trained on: its split.json, or its checkpoint's seeded split recomputed on
        ``prompt_ids`` when it trained on this very ``dataset``; None when unknown."""
        if self.split is None:
            return None
        if "train" in self.split:
            return set(self.split["train"])
        keys = ("val_fraction", "val_size", "split_seed", "train_fraction")
        same_dataset = Path(self.split.get("path") or "").resolve() == Path(dataset).resolve()
        if not same_dataset or any(k not in self.split for k in keys):
            return None
        return set(prompt_split(sorted(set(prompt_ids)), *(self.split[k] for k in keys))["train"])


def load_head(path: str) -> LoadedHead:
    """A bundle folder's head and calibration maps (no model is loaded), or the head of a Lightning checkpoint of
    ``python -m train fit``."""
    where = Path(path)
    if where.is_dir():
        config = SpecDecPP.read_config(where)
        head = AcceptanceHead.from_pretrained(where, config=config["head"]).float().eval()
        maps = [
            Calibration.from_dict(config[k]) if config.get(k) else None for k in ("calibration", "greedy_calibration")
        ]
        split = where / "split.json"
        record = json.loads(split.read_text()) if split.is_file() else None
        draft = _recorded_draft(config.get("draft"), where)
        return LoadedHead(path, "bundle", head, *maps, split=record, draft=draft)
    if where.is_file() and where.suffix == ".ckpt":
        return _checkpoint_head(where, path)
    raise FileNotFoundError(
        f"--heads: {path!r} is neither a bundle folder (config.json + head.safetensors, written by `python -m train "
        "fit`'s export) nor a Lightning checkpoint of `python -m train fit` (runs/<name>/version_N/checkpoints/*.ckpt)."
    )


def _checkpoint_head(where: Path, name: str) -> LoadedHead:
    """The head of a ``python -m train fit`` checkpoint: its hyperparameters rebuild it, its ``head.*`` weights fill
    it; the run's split.json or data settings say which prompts it trained on."""
    try:
        checkpoint = torch.load(where, map_location="cpu", weights_only=True)
        config = checkpoint["hyper_parameters"]
        head = AcceptanceHead.from_config(config)
        state = {k.removeprefix("head."): v for k, v in checkpoint["state_dict"].items() if k.startswith("head.")}
        head.load_state_dict(state)
    except (KeyError, RuntimeError, TypeError, OSError) as err:
        raise ValueError(
            f"--heads: {name!r} is not a checkpoint of an acceptance head written by `python -m train fit` ({err})."
        ) from err
    split = where.parent.parent / "split.json"
    data = checkpoint.get("datamodule_hyper_parameters") or {}
    record = json.loads(split.read_text()) if split.is_file() else data
    return LoadedHead(name, "checkpoint", head.float().eval(), split=record, draft=_recorded_draft(data.get("draft")))


def _recorded_draft(raw: Any, bundle: Path | None = None) -> ModelSpec | None:
    """The draft spec a bundle's config or a checkpoint's data settings record (a bundle's relative to it); None
    when none is recorded."""
    if not isinstance(raw, dict) or "path" not in raw:
        return None
    try:
        spec = ModelSpec(**raw)
    except TypeError:
        return None
    if bundle is not None and not spec.path.startswith(("package:", "hf:")) and (bundle / spec.path).exists():
        spec.path = str((bundle / spec.path).resolve())
    return spec


def heads_dataset(path: str, heads: list[LoadedHead]) -> Candidates:
    """The candidates of the rollout labels at ``path`` (their hidden states when a head reads them), refused when a
    head was trained for another draft than the one that labelled them."""
    candidates = load_candidates(path, any(loaded.head.reads_hidden for loaded in heads))
    for loaded in heads:
        check_labelled_by(candidates.meta, loaded.draft, candidates.path, f"--heads {loaded.name}")
    return candidates


def head_probs(loaded: LoadedHead, candidates: Candidates) -> torch.Tensor:
    """(C,) float64 acceptance probabilities of the raw head on every candidate."""
    head = loaded.head
    held = ([HIDDEN] if candidates.hidden is not None else []) + list(SCALAR_INPUTS)  # load_candidates checked them
    require_inputs(head.inputs, held, f"the dataset {candidates.path}")
    if head.reads_hidden and candidates.hidden.shape[-1] != head.hidden_size:
        raise ValueError(
            f"--heads {loaded.name} reads hidden states of width {head.hidden_size} but {candidates.path} stores "
            f"width {candidates.hidden.shape[-1]}: the dataset was made with another draft than the head's."
        )
    scalars = candidates.inputs[:, [SCALAR_INPUTS.index(n) for n in head.scalar_inputs]] if head.scalar_inputs else None
    hidden = candidates.hidden.float() if head.reads_hidden else None
    with torch.inference_mode():
        return torch.sigmoid(head(hidden, scalars).double())


def check_held_out(heads: list[LoadedHead], candidates: Candidates, held: set[str]) -> dict[str, str]:
    """ValueError when a head trained on a held-out prompt; per head, whether that could be checked."""
    checks = {}
    for loaded in heads:
        trained = loaded.train_ids(candidates.path, candidates.prompt_ids)
        if trained is None:
            checks[loaded.name] = "unchecked: its training prompts are unknown (no split.json, another dataset)"
            continue
        overlap = sorted(trained & held)
        if overlap:
            raise ValueError(
                f"--heads {loaded.name} was trained on {len(overlap)} of the {len(held)} held-out prompts of "
                f"{candidates.path} (e.g. {overlap[:3]}): pass the split it trained with (--split <its bundle or "
                "split.json>, or its run's --split_seed/--val_fraction/--val_size)."
            )
        checks[loaded.name] = "checked: no held-out prompt is one of its training prompts"
        chose = held & set((loaded.split or {}).get("val") or [])
        if loaded.kind == "bundle" and chose:
            checks[loaded.name] += (
                f"; {len(chose)} held-out prompts are its validation prompts, on which its calibration map and h* "
                "were chosen"
            )
    return checks


# ---- predictors and metrics ----------------------------------------------------------------------------------------


def check_baselines(names: list[str] | None) -> list[str]:
    """``names`` in table order (default: all of :data:`BASELINES`); ValueError naming an unknown one."""
    names = list(BASELINES) if names is None else list(names)
    unknown = [name for name in names if name not in BASELINES]
    if unknown:
        raise ValueError(
            f"--baselines: unknown predictor name(s) {unknown}; choose from {list(BASELINES)} (heads are given with "
            "--heads)."
        )
    return [name for name in BASELINES if name in names]


def check_settings(entropy_gamma: float, bootstrap: int) -> None:
    """ValueError naming a setting of the command that is out of range, and what it must be."""
    if not entropy_gamma > 0:
        raise ValueError(f"--entropy_gamma={entropy_gamma} must be > 0 (AdaEDL's entropy scale; EntropyStop's 0.2).")
    if bootstrap < 0:
        raise ValueError(f"--bootstrap={bootstrap} must be >= 0 (resamples of the held-out prompts; 0: none).")


def c2t_inputs(candidates: Candidates) -> torch.Tensor:
    """(C, 4) C2T features of chain candidates: log joint (the path's log q), entropy, depth, log q — what
    :func:`~accept_head.trees.labels.node_features` gives a tree node, logs clipped the same way."""
    logs = [candidates.column(n).clamp_min(LOG_FLOOR) for n in ("path_logq", "logq")]
    return torch.stack([logs[0], candidates.column("entropy"), candidates.column("depth"), logs[1]], -1).float()


def baseline_probs(name: str, candidates: Candidates, train: torch.Tensor, gamma: float, seed: int) -> torch.Tensor:
    """(C,) float64 probabilities of the baseline ``name`` on every candidate; ``c2t`` is fitted on the ``train``
    candidates (C,) bool only."""
    if name == "q":
        return candidates.column("logq").exp()
    if name == "eagle2":
        return candidates.column("path_logq").exp()
    if name == "adaedl":
        bounds = [entropy_lower_bound(h, gamma) for h in candidates.column("entropy").tolist()]
        return torch.tensor(bounds, dtype=torch.float64).clamp(0.0, 1.0)
    features = c2t_inputs(candidates)
    classifier = C2TClassifier.fit(features[train].tolist(), candidates.labels[train].tolist(), seed=seed)
    with torch.inference_mode():
        return torch.sigmoid(classifier(features).double())


def predictor_metrics(probs: torch.Tensor, labels: torch.Tensor, accepted: torch.Tensor, judged: torch.Tensor) -> dict:
    """Metrics of (M,) predictions: AUC against ``accepted`` on the ``judged`` ones (M,) bool, soft AUC, ECE
    (:data:`~accept_head.acceptance.metrics.ECE_BINS` bins) and Brier against the soft ``labels`` (M,), counts."""
    probs, labels = probs.double(), labels.double()
    empty = not probs.numel()
    return {
        "n": int(probs.numel()),
        "judged": int(judged.sum()),
        "auc_accepted": binary_auc(probs[judged], accepted[judged].double()),
        "auc_soft": soft_auc(probs, labels),
        "ece": expected_calibration_error(probs, labels, ECE_BINS),
        "brier": brier_score(probs, labels),
        "mean_pred": math.nan if empty else float(probs.mean()),
        "mean_label": math.nan if empty else float(labels.mean()),
    }


def views(probs: torch.Tensor, candidates: Candidates, held: torch.Tensor) -> dict[str, dict]:
    """:func:`predictor_metrics` of (C,) predictions on the ``held`` candidates (``all``) and on their rounds' first
    candidates (``first``)."""
    judged = candidates.judged
    out = {}
    for view, mask in (("all", held), ("first", held & (candidates.step == 1))):
        out[view] = predictor_metrics(probs[mask], candidates.labels[mask], candidates.accepted[mask], judged[mask])
    return out


def auc_gap(
    probs: torch.Tensor,
    reference: torch.Tensor,
    candidates: Candidates,
    held: torch.Tensor,
    resamples: int,
    seed: int,
) -> dict:
    """AUC against ``accepted`` of (C,) ``probs`` minus that of (C,) ``reference`` on the held-out judged candidates,
    with a 95% interval from resampling the held-out *prompts* with replacement (both predictors on the same resample:
    a paired prompt bootstrap, since a prompt's candidates are not independent). Resamples with one outcome only are
    skipped and counted out."""
    import numpy as np

    rows = (held & candidates.judged).nonzero().squeeze(-1)
    by_prompt: dict[str, list[int]] = {}
    for position, row in enumerate(rows.tolist()):
        by_prompt.setdefault(candidates.prompt_ids[row], []).append(position)
    groups = [torch.tensor(by_prompt[key]) for key in sorted(by_prompt)]
    a, b, truth = probs[rows].double(), reference[rows].double(), candidates.accepted[rows].double()
    delta = binary_auc(a, truth) - binary_auc(b, truth)  # nan when one outcome only
    if math.isnan(delta):
        return {"delta": math.nan, "ci95": [math.nan, math.nan], "resamples": 0, "prompts": len(groups)}
    gaps = []
    rng = np.random.default_rng(seed)
    for _ in range(resamples):
        picked = torch.cat([groups[i] for i in rng.integers(len(groups), size=len(groups))])
        gap = binary_auc(a[picked], truth[picked]) - binary_auc(b[picked], truth[picked])
        if not math.isnan(gap):
            gaps.append(gap)
    low, high = (float(x) for x in np.percentile(gaps, [2.5, 97.5])) if gaps else (math.nan, math.nan)
    return {"delta": delta, "ci95": [low, high], "resamples": len(gaps), "prompts": len(groups)}


def raw_predictions(
    candidates: Candidates,
    train: torch.Tensor,
    heads: list[LoadedHead],
    baselines: list[str],
    gamma: float,
    seed: int,
) -> dict[str, tuple[str, torch.Tensor, Calibration | None]]:
    """``{name: (description, (C,) probabilities on every candidate, the bundle's map for the labels' mode)}`` of
    every baseline (C2T only when there are ``train`` candidates to fit it on) and every head."""
    out: dict[str, tuple[str, torch.Tensor, Calibration | None]] = {}
    for name in baselines:
        if name != "c2t" or bool(train.any()):
            out[name] = (DESCRIPTIONS[name], baseline_probs(name, candidates, train, gamma, seed), None)
    for loaded in heads:
        description = f"{loaded.kind} head reading {list(loaded.head.inputs)}"
        out[f"head {loaded.name}"] = (
            description,
            head_probs(loaded, candidates),
            loaded.calibration_for(candidates.greedy),
        )
    return out


def score_dataset(
    candidates: Candidates,
    train_ids: set[str],
    heads: list[LoadedHead],
    baselines: list[str],
    isotonic: bool,
    gamma: float,
    seed: int,
    bootstrap: int = 0,
) -> dict:
    """Every predictor on one dataset's held-out candidates: ``{"path", "label_mode", "temperature", "prompts",
    "candidates", "held_out_prompts", "heads", "skipped", "predictors": {name: {"description", "all", "first"}}}``,
    each predictor followed by its ``+ bundle map`` and ``+ isotonic`` rows. ValueError without a held-out prompt;
    without a training prompt the fitted predictors (C2T, the isotonic maps) are skipped, and ``skipped`` says so."""
    train = candidates.among(train_ids)
    held = ~train
    held_ids = {pid for pid, h in zip(candidates.prompt_ids, held.tolist()) if h}
    if not held_ids:
        raise ValueError(f"Every prompt of {candidates.path} is a training prompt of the split: nothing is held out.")
    fits = bool(train.any())
    skipped = {} if fits else {"c2t and + isotonic": f"{candidates.path} holds none of the split's training prompts"}
    checks = check_held_out(heads, candidates, held_ids)
    mode = "greedy" if candidates.greedy else "sampling"
    results: dict[str, dict] = {}
    raw = raw_predictions(candidates, train, heads, baselines, gamma, seed)
    for name, (description, probs, calibration) in raw.items():
        results[name] = {"description": description, **views(probs, candidates, held)}
        if bootstrap and "q" in raw and name != "q":
            results[name]["auc_vs_q"] = auc_gap(probs, raw["q"][1], candidates, held, bootstrap, seed)
        if calibration is not None:
            mapped = apply_calibration(calibration, probs)
            description_map = f"the bundle's {calibration.kind} map for {mode}"
            results[f"{name} + bundle map"] = {"description": description_map, **views(mapped, candidates, held)}
        if isotonic and fits:
            mapped = apply_calibration(fit_isotonic(probs[train], candidates.labels[train]), probs)
            description_iso = f"{description}, then an isotonic map fitted on the training prompts"
            results[f"{name} + isotonic"] = {"description": description_iso, **views(mapped, candidates, held)}
    return {
        "path": candidates.path,
        "label_mode": candidates.meta.get("label_mode"),
        "temperature": recorded_temperature(candidates.meta),
        "prompts": {"train": len(set(candidates.prompt_ids) - held_ids), "held_out": len(held_ids)},
        "candidates": {"train": int(train.sum()), "held_out": int(held.sum())},
        "held_out_prompts": sorted(held_ids),
        "heads": checks,
        "skipped": skipped,
        "predictors": results,
    }


# ---- the table and the command -------------------------------------------------------------------------------------

HEADER = ["predictor", "n", "judged", "AUC accepted", "AUC soft", "ECE", "Brier", "mean pred", "mean label"]


def markdown(result: dict, view: str) -> str:
    """One Markdown table of a dataset's predictors in ``view`` (``all`` or ``first``); on ``all``, with
    ``--bootstrap``, each predictor's AUC minus q's and its 95% prompt-bootstrap interval."""
    gaps = view == "all" and any("auc_vs_q" in scores for scores in result["predictors"].values())
    rows = []
    for name, scores in result["predictors"].items():
        m = scores[view]
        row = [name, str(m["n"]), str(m["judged"])]
        row += [fmt(m[k], 4) for k in ("auc_accepted", "auc_soft", "ece", "brier", "mean_pred", "mean_label")]
        if gaps:
            gap = scores.get("auc_vs_q")
            row.append("" if gap is None else f"{gap['delta']:+.4f} [{gap['ci95'][0]:+.4f}, {gap['ci95'][1]:+.4f}]")
        rows.append(row)
    return markdown_table(HEADER + (["AUC − q [95% CI]"] if gaps else []), rows)


def report(results: dict[str, dict]) -> str:
    """The Markdown page: per dataset, its split's counts, the table of all held-out candidates and that of the
    rounds' first candidates."""
    lines = []
    for role, result in results.items():
        mode = "greedy" if result["temperature"] == 0 else f"T={result['temperature']}"
        prompts, candidates = result["prompts"], result["candidates"]
        lines += [
            f"## {role}: {result['path']} ({mode})",
            "",
            f"Held out: {prompts['held_out']} prompts, {candidates['held_out']} candidates; fitted on: "
            f"{prompts['train']} training prompts, {candidates['train']} candidates.",
        ]
        lines += [f"Skipped {k}: {v}." for k, v in result["skipped"].items()]
        for view, title in (("all", "every held-out candidate"), ("first", "each round's first candidate")):
            lines += ["", f"### {title}", "", markdown(result, view)]
        lines.append("")
    return "\n".join(lines)


def predictors(
    dataset: str,
    greedy_dataset: str | None = None,
    heads: list[str] | None = None,
    split: str | None = None,
    split_seed: int = 0,
    val_fraction: float = 0.1,
    val_size: int | None = None,
    baselines: list[str] | None = None,
    isotonic: bool = True,
    entropy_gamma: float = 0.2,
    seed: int = 0,
    bootstrap: int = 0,
    output_dir: str = "eval_out/predictors",
) -> dict:
    """Every acceptance predictor — the heads given, the draft's q(y), EAGLE-2's path confidence, AdaEDL's entropy
    bound, a C2T classifier — scored on the same held-out candidates of a rollout label dataset: AUC against the
    decode's outcome, soft AUC, ECE and Brier against min(1, p/q), also on each round's first candidate alone, and
    after an isotonic map fitted on the training prompts. Offline: nothing decodes. Prints Markdown tables and writes
    predictors.json and predictors.md.

    Args:
        dataset: A rollout label dataset (``python -m data_gen --label_mode rollout``) made with the heads' draft.
        greedy_dataset: Optionally a greedy rollout dataset (``--temperature 0``), scored the same way with the same
            split; bundles are scored on it with their greedy calibration map.
        heads: Heads to score: bundle folders (their calibration maps are scored too) and/or Lightning checkpoints
            ``python -m train fit`` wrote (``runs/<name>/version_N/checkpoints/*.ckpt``). Default: none.
        split: Where the training prompts come from: a bundle folder holding ``split.json`` or such a file; every
            other prompt of the dataset is held out. Default: the data module's seeded split of the dataset's prompts.
        split_seed: Seed of the seeded split (without ``split``).
        val_fraction: Held-out fraction of the seeded split.
        val_size: Held-out prompt count of the seeded split (overrides ``val_fraction``).
        baselines: Which of ``q``, ``eagle2``, ``adaedl``, ``c2t`` to score (default: all).
        isotonic: Also score every uncalibrated predictor after an isotonic map fitted on the training prompts.
        entropy_gamma: AdaEDL's γ in 1 − sqrt(γ·H) (EntropyStop's default).
        seed: Seed of the C2T classifier's initialisation (and of the bootstrap's resamples).
        bootstrap: Resamples of the held-out prompts for each predictor's AUC minus q's, with its 95% interval (a
            paired prompt bootstrap on every held-out candidate); 0: none.
        output_dir: Folder for predictors.json and predictors.md.
    """
    baselines = check_baselines(baselines)
    check_settings(entropy_gamma, bootstrap)
    folder = output_folder(output_dir)
    loaded = [load_head(path) for path in heads or []]
    candidates = heads_dataset(dataset, loaded)
    train_ids, source = split_train_ids(split, candidates.prompt_ids, split_seed, val_fraction, val_size)
    settings = (baselines, isotonic, entropy_gamma, seed, bootstrap)
    results = {"dataset": score_dataset(candidates, train_ids, loaded, *settings)}
    if greedy_dataset is not None:
        greedy = heads_dataset(greedy_dataset, loaded)
        if not greedy.greedy:
            raise ValueError(
                f"--greedy_dataset={greedy_dataset!r} holds labels made at temperature "
                f"{recorded_temperature(greedy.meta)!r}; pass greedy rollout labels (data_gen --temperature 0)."
            )
        results["greedy_dataset"] = score_dataset(greedy, train_ids, loaded, *settings)
    page = report(results)
    print(page)
    payload = {
        "command": "predictors",
        "machine": machine_info(),
        "code": code_version(),
        "split": {**source, "train_prompts": len(train_ids)},
        "settings": {
            "heads": [h.name for h in loaded],
            "baselines": baselines,
            "isotonic": isotonic,
            "entropy_gamma": entropy_gamma,
            "ece_bins": ECE_BINS,
            "seed": seed,
            "bootstrap": bootstrap,
        },
        "results": results,
    }
    write_json(folder / "predictors.json", payload)
    (folder / "predictors.md").write_text(f"# Acceptance predictors on held-out rollout candidates\n\n{page}")
    print(f"wrote {folder / 'predictors.json'} and {folder / 'predictors.md'}")
    return payload
