"""What runs at the end of ``fit``: calibration, cost model, threshold sweep, export — each a switchable callback.

They run in that order in ``on_train_end`` (the model is still on its device), on the global-zero process only, and
pass their results on through the module's :class:`~accept_head.training.report.FitReport`. Each works without the
ones before it: the sweep without a cost model picks h* by measured tokens/s, the export without a sweep needs
``export.threshold``.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import json
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ..acceptance.calibration import (
    CALIBRATION_METHODS,
    Calibration,
    apply_calibration,
    choose_calibration,
    fit_calibration,
)
from ..acceptance.metrics import expected_calibration_error, reliability_bins
from ..acceptance.plots import reliability_plot
from ..core import __version__
from ..core.costs import CostModel
from ..core.records import where_measured
from ..core.sampling import SamplingConfig
from ..engine.measure import measure_costs
from ..engine.sweep import FIXED_K, THRESHOLDS, check_fixed_k, check_thresholds, format_table, pareto_plot, run_sweep
from ..specdecpp.bundle import CONFIG_NAME, TREE_SETTINGS, SpecDecPP
from ..trees.growth import check_context_row
from .data import AcceptanceDataModule
from .model_card import model_card
from .report import FitReport


def artifact_dir(trainer: Trainer) -> Path:
    """Where end-of-fit files go: the logger's run folder (``trainer.log_dir``), else the root dir.

    ``trainer.log_dir`` is a broadcast under DDP, so every process must call this, not just rank zero.
    """
    folder = Path(trainer.log_dir or trainer.default_root_dir)
    if trainer.is_global_zero:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def _log(trainer: Trainer, metrics: dict[str, float]) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def _datamodule(trainer: Trainer) -> AcceptanceDataModule:
    dm = trainer.datamodule
    if not isinstance(dm, AcceptanceDataModule):
        raise TypeError(f"The end-of-fit callbacks need an AcceptanceDataModule, got {type(dm).__name__}.")
    return dm


def _check_same_device(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    t, d = next(target.parameters()).device, next(draft.parameters()).device
    if t != d:
        raise ValueError(
            f"The target runs on {t} but the draft on {d}; speculative decoding needs both on one device. "
            f"Set --data.target.device={d} (or train on the target's device)."
        )


def _full_parameters(trainer: Trainer) -> contextlib.AbstractContextManager:
    """Under FSDP, gather the sharded draft and head on rank 0 for the end-of-fit stages (a collective every rank
    enters); a no-op for other strategies. Lightning runs FSDP on GPUs only, so this path is not exercised by the CPU
    test suite."""
    from lightning.pytorch.strategies import FSDPStrategy

    if not isinstance(trainer.strategy, FSDPStrategy):
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False, rank0_only=True)


class EndOfFitStage(Callback):
    """Base class: runs :meth:`run` once after training, on global rank zero, when ``enabled``."""

    enabled: bool = True

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled:
            return
        folder = artifact_dir(trainer)  # collective under DDP (the log dir is broadcast): every rank asks
        with _full_parameters(trainer):
            if trainer.is_global_zero:
                was_training = pl_module.training
                pl_module.eval()
                try:
                    self.run(trainer, pl_module, pl_module.fit_report, folder)
                finally:
                    pl_module.train(was_training)
        trainer.strategy.barrier(type(self).__name__)

    def run(self, trainer: Trainer, pl_module: LightningModule, report: FitReport, folder: Path) -> None:
        """The stage's work, on global rank zero; ``folder`` is where its files go (next to the logs)."""
        raise NotImplementedError


class CalibrateHead(EndOfFitStage):
    """Fit temperature scaling and isotonic regression on validation predictions; keep the best map (or none)."""

    def __init__(
        self,
        enabled: bool = True,
        methods: list[str] = list(CALIBRATION_METHODS),
        folds: int = 2,
        n_bins: int = 15,
        seed: int = 0,
    ) -> None:
        """
        Args:
            enabled: Run this stage.
            methods: Candidate maps: ``temperature`` and/or ``isotonic`` (raw probabilities always compete).
            folds: Cross-fitting folds by prompt for the before/after scores (the kept map is refit on all data).
            n_bins: Bins of the ECE and the reliability diagram.
            seed: Seed of the fold assignment.
        """
        for method in methods:
            if method not in CALIBRATION_METHODS:
                raise ValueError(
                    f"calibration.methods has {method!r}; choose from {list(CALIBRATION_METHODS)} "
                    "(e.g. --calibration.methods=[temperature,isotonic])."
                )
        if folds < 1:
            raise ValueError(f"calibration.folds={folds} must be >= 1.")
        self.enabled, self.methods, self.folds, self.n_bins, self.seed = enabled, list(methods), folds, n_bins, seed

    def run(self, trainer: Trainer, pl_module: LightningModule, report: FitReport, folder: Path) -> None:
        dm = _datamodule(trainer)
        # The prompts a sweep reports its held-out comparison on choose nothing, the calibration map included.
        reserved = {pid for cb in trainer.callbacks if isinstance(cb, ThresholdSweep) for pid, _ in cb.held_out(dm)}
        report.calibration_excluded = sorted(reserved)
        panels = {}
        loader = dm.calibration_dataloader(exclude=reserved)
        report.calibration_choice, panels["validation"] = self._calibrate(trainer, pl_module, loader, "")
        report.calibration = report.calibration_choice.calibration
        greedy = dm.calibration_dataloader(greedy=True, exclude=reserved)
        if greedy is not None:
            report.greedy_calibration_choice, panels["greedy labels"] = self._calibrate(
                trainer, pl_module, greedy, "greedy "
            )
            report.greedy_calibration = report.greedy_calibration_choice.calibration
        path = reliability_plot(panels, folder / "reliability.png", "Acceptance head reliability")
        report.artifacts["reliability"] = str(path)

    def _calibrate(self, trainer: Trainer, pl_module: LightningModule, loader, prefix: str):
        """The calibration choice on one loader's labels and its reliability curves (in-sample maps, for the
        picture; the legend's ECE is in-sample too)."""
        logits, labels, rows = pl_module.predict_loader(loader)
        choice = choose_calibration(logits, labels, rows, self.methods, self.folds, self.seed, self.n_bins)
        raw = torch.sigmoid(logits.double())
        fitted = {method: apply_calibration(fit_calibration(method, logits, labels), raw) for method in self.methods}
        predictions = {"raw": raw} | fitted
        curves = {
            f"{name} (ECE {expected_calibration_error(probs, labels, self.n_bins):.3f})": reliability_bins(
                probs, labels, self.n_bins
            )
            for name, probs in predictions.items()
        }
        key = f"calibration/{prefix.strip()}_" if prefix else "calibration/"
        _log(trainer, {f"{key}{name}_{k}": v for name, s in choice.scores.items() for k, v in s.items()})
        lines = [f"{prefix}calibration ({choice.evaluation}, {len(labels)} positions): kept {choice.chosen}"]
        lines += [f"  {name:12s} ECE {s['ece']:.4f}  Brier {s['brier']:.4f}" for name, s in choice.scores.items()]
        print("\n".join(lines), flush=True)
        return choice, curves


class MeasureCosts(EndOfFitStage):
    """The cost model of eq. 2.1–2.3: measure t_draft (draft step + head) and t_target(K) = a + b·K here, or take
    them from the config."""

    def __init__(
        self,
        enabled: bool = True,
        measure: bool = True,
        t_draft: float | None = None,
        t_target_a: float | None = None,
        t_target_b: float = 0.0,
        t_draft_next: float | None = None,
        t_head: float | None = None,
        t_head_next: float | None = None,
        ks: list[int] = list(range(1, 21)),
        context: int = 128,
        repeats: int = 15,
        warmup: int = 3,
        seed: int = 0,
    ) -> None:
        """
        Args:
            enabled: Run this stage (without it the sweep ranks policies by measured tokens/s).
            measure: Time the models on this machine; False takes ``t_draft`` / ``t_target_a`` / ``t_target_b``.
            t_draft: Seconds per draft step including the head (when ``measure`` is False).
            t_target_a: Seconds per target call, constant part (when ``measure`` is False).
            t_target_b: Seconds per verified candidate (when ``measure`` is False).
            t_draft_next: Seconds per draft step after the first of a round (when ``measure`` is False; None:
                ``t_draft``).
            t_head, t_head_next: The head's share of ``t_draft`` / ``t_draft_next`` (when ``measure`` is False; None:
                not known, and the rules that never call the head are priced with it too).
            ks: Candidate counts K to time the target at.
            context: Tokens in the KV cache during the timings.
            repeats: Timed calls per measurement (the median is kept).
            warmup: Untimed calls before each measurement.
            seed: Seed of the random token ids fed to the models.
        """
        if enabled and not measure and (t_draft is None or t_target_a is None):
            raise ValueError(
                "cost_model.measure=false needs cost_model.t_draft and cost_model.t_target_a (seconds); set them or "
                "use --cost_model.measure=true."
            )
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"cost_model.ks={ks} must be a non-empty list of K >= 1.")
        self.enabled, self.measure = enabled, measure
        self.t_draft, self.t_target_a, self.t_target_b = t_draft, t_target_a, t_target_b
        self.t_draft_next, self.t_head, self.t_head_next = t_draft_next, t_head, t_head_next
        self.ks, self.context, self.repeats, self.warmup, self.seed = list(ks), context, repeats, warmup, seed

    def run(self, trainer: Trainer, pl_module: LightningModule, report: FitReport, folder: Path) -> None:
        if self.measure:
            dm = _datamodule(trainer)
            target = dm.target()
            _check_same_device(target, pl_module.draft)
            cost = measure_costs(
                target, pl_module.draft, pl_module.head, self.ks, self.context, self.repeats, self.warmup, self.seed
            )
            report.cost_model_source = where_measured(target)
        else:
            cost = CostModel(
                t_draft=self.t_draft,
                t_target_a=self.t_target_a,
                t_target_b=self.t_target_b,
                t_draft_next=self.t_draft_next,
                t_head=self.t_head,
                t_head_next=self.t_head_next,
            )
            report.cost_model_source = "config"
        report.cost_model = cost
        names = ("t_draft", "t_step", "t_target_a", "t_target_b")
        metrics = {f"cost/{name}_ms": 1e3 * getattr(cost, name) for name in names}
        _log(trainer, metrics | ({"cost/r2": cost.r2} if cost.r2 is not None else {}))
        r2 = f", R² {cost.r2:.3f}" if cost.r2 is not None else ""
        head = f", the head {1e3 * cost.t_head:.2f} ms of it" if cost.t_head is not None else ""
        print(
            f"cost model ({report.cost_model_source}): t_draft {1e3 * cost.t_draft:.2f} ms "
            f"({1e3 * cost.t_step:.2f} after a round's first{head}), "
            f"t_target(K) = {1e3 * cost.t_target_a:.2f} + {1e3 * cost.t_target_b:.3f}·K ms{r2}",
            flush=True,
        )


class ThresholdSweep(EndOfFitStage):
    """Decode held-out validation prompts with SpecDec++ for every h and with FixedK for every K; pick h*.

    Logs the table (``sweep.csv`` / ``sweep.json`` next to the logs, a W&B table when a WandbLogger is attached),
    saves the Pareto plot and records the closing comparison (autoregressive, best fixed K, SpecDec++ at h* and, with
    ``ablated``, its rule with the head ablated at that rule's best h) in the report; :func:`closing_table` formats it
    (``python -m train fit`` prints it last).
    """

    def __init__(
        self,
        enabled: bool = True,
        thresholds: list[float] = list(THRESHOLDS),
        fixed_k: list[int] = list(FIXED_K),
        prompts: int = 16,
        max_new_tokens: int = 128,
        eval_prompts: int = 0,
        min_candidates: int = 2,
        max_candidates: int = 20,
        unscored: list[str | None] = [None],  # noqa: B006 (jsonargparse reads the default)
        ablated: bool = False,
        select: Literal["modeled", "measured"] = "modeled",
        autoregressive: bool = True,
        greedy: bool = False,
        context_row: int | None = None,
        seed: int = 0,
        progress: bool = True,
    ) -> None:
        """
        Args:
            enabled: Run this stage.
            thresholds: Grid of h in (0, 1) for SpecDec++ (one value evaluates just that h, as in W&B sweeps).
            fixed_k: Grid of K for the fixed-K baseline (empty: no baseline).
            prompts: Validation prompts decoded by every policy (the first ones of the seeded validation order).
            max_new_tokens: New tokens per prompt.
            eval_prompts: If > 0, the closing table is measured on this many further validation prompts that the
                sweep did not see; 0 reuses the sweep's rows.
            min_candidates: Candidates SpecDec++ always drafts per round (the official evaluation forces 2).
            max_candidates: Cap on candidates per round (the paper: 20).
            unscored: HeadThreshold variants swept with every h: ``null`` is Alg. 2 (the newest, unscored candidate
                is ignored, so rounds submit at least two); ``confidence`` counts its draft probability instead.
                h* and the variant are chosen together.
            ablated: Also decode every h with the head ablated — the same threshold on the draft's own path
                probability 1 − Π q(y_j) (:class:`~accept_head.chain.baselines.PathConfidenceStop`), no head call —
                and add that rule at its best h to the closing comparison: whether the head pays over what the draft
                already knows. It chooses nothing for the bundle.
            select: Pick h* (and the best K) by ``modeled`` latency (cost model, eq. 2.3) or ``measured`` tokens/s.
            autoregressive: Decode with the target alone too (the reference of the speed-ups; False saves its time
                when only the thresholds are compared, e.g. in ``python -m eval ablate``).
            greedy: Also sweep the thresholds with greedy decoding on the same prompts and store that h* as the
                bundle's greedy h* (greedy and sampling are different problems; the bundle picks h* by mode). Off:
                the h* swept at the data's temperature serves both modes.
            context_row: Tokens copied from the text that every chain of the sweep also verifies (FixedK, SpecDec++,
                the ablated rule). Default (null): the export stage's ``context_row``, what the bundle's ``generate``
                will decode, so h* is chosen for the decoder the bundle ships; 0 sweeps the plain chain.
            seed: Seed of the per-prompt sampling generators (the same for every policy).
            progress: Show a progress bar.
        """
        check_thresholds(thresholds)
        check_fixed_k(fixed_k)
        if not thresholds:
            raise ValueError("sweep.thresholds is empty: give at least one h in (0, 1).")
        if prompts < 1 or max_new_tokens < 1 or eval_prompts < 0:
            raise ValueError(
                f"sweep.prompts={prompts} and sweep.max_new_tokens={max_new_tokens} must be >= 1, "
                f"sweep.eval_prompts={eval_prompts} >= 0."
            )
        self.enabled, self.thresholds, self.fixed_k = enabled, [float(h) for h in thresholds], list(fixed_k)
        self.prompts, self.max_new_tokens, self.eval_prompts = prompts, max_new_tokens, eval_prompts
        self.min_candidates, self.max_candidates = min_candidates, max_candidates
        self.unscored = list(unscored) or [None]
        self.ablated = ablated
        self.select, self.autoregressive, self.seed, self.progress = select, autoregressive, seed, progress
        self.greedy = greedy
        self.context_row = None if context_row is None else check_context_row(context_row)
        self.copies = self.context_row or 0  # what this run sweeps with; run() resolves None to the export stage's

    def held_out(self, dm: AcceptanceDataModule) -> list[tuple[str, list[int]]]:
        """The ``eval_prompts`` validation prompts after the sweep's own, which the closing comparison reports on:
        no stage may fit or choose anything on them (:class:`CalibrateHead` leaves them out)."""
        if not self.enabled or not self.eval_prompts:
            return []
        held = dm.val_prompts(self.eval_prompts, offset=len(dm.val_prompts(self.prompts)))
        if 0 < len(held) < self.eval_prompts:
            warnings.warn(
                f"sweep.eval_prompts={self.eval_prompts} but only {len(held)} validation prompts remain after the "
                f"sweep's {self.prompts}: the closing comparison reports on {len(held)} (a larger data.val_size gives "
                "it more).",
                stacklevel=2,
            )
        return held

    def _run(
        self,
        dm: AcceptanceDataModule,
        pl_module: LightningModule,
        report: FitReport,
        prompts: list[tuple[str, list[int]]],
        desc: str,
        sampling: SamplingConfig | None = None,
        calibration: Calibration | None = None,
        **grid: Any,
    ):
        """:func:`run_sweep` of ``prompts``; ``grid`` overrides the stage's grids (thresholds, fixed_k, unscored,
        ablated)."""
        grid = {
            "thresholds": self.thresholds,
            "fixed_k": self.fixed_k,
            "unscored": self.unscored,
            "ablated": self.thresholds if self.ablated else [],
            "context_row": self.copies,
        } | grid
        target = dm.target()
        _check_same_device(target, pl_module.draft)
        return run_sweep(
            target,
            pl_module.draft,
            pl_module.head,
            [ids for _, ids in prompts],
            max_new_tokens=self.max_new_tokens,
            sampling=dm.sampling if sampling is None else sampling,
            eos_token_id=dm.eos_token_ids,
            cost_model=report.cost_model,
            min_candidates=self.min_candidates,
            max_candidates=self.max_candidates,
            calibration=report.calibration if calibration is None else calibration,
            seed=self.seed,
            progress=self.progress,
            desc=desc,
            autoregressive=self.autoregressive,
            **grid,
        )

    def run(self, trainer: Trainer, pl_module: LightningModule, report: FitReport, folder: Path) -> None:
        dm = _datamodule(trainer)
        prompts = dm.val_prompts(self.prompts)
        if len(prompts) < self.prompts:
            print(f"sweep: the validation split has only {len(prompts)} prompts (asked for {self.prompts})")
        by = self.select if report.cost_model is not None else "measured"
        self.copies = self.context_row if self.context_row is not None else _export_context_row(trainer)
        result = self._run(dm, pl_module, report, prompts, "threshold sweep")
        best = result.best("threshold", by)
        report.sweep, report.threshold, report.unscored = result, float(best.param), best.variant
        report.min_candidates, report.max_candidates = self.min_candidates, self.max_candidates
        decoded = list(dict.fromkeys(row.variant for row in result.family("threshold")))  # one: a scalars-only head
        report.threshold_selection = (
            f"lowest {by} latency per token over h in {self.thresholds}"
            + (f" × unscored in {decoded}" if decoded != [None] else "")
            + f" on {len(prompts)} held-out validation "
            f"prompts, up to {self.max_new_tokens} new tokens each"
            + (f", every chain verifying {self.copies} tokens copied from the text beside it" if self.copies else "")
        )
        report.artifacts["pareto"] = str(pareto_plot(result, folder / "pareto.png"))
        report.artifacts["sweep_csv"] = str(_write_sweep(result.to_records(), folder))
        self._log_table(trainer, result.to_records())
        baseline = _print_sweep(result, best, len(prompts), by)
        if self.greedy and not dm.sampling.greedy:
            self._greedy_h_star(dm, pl_module, report, prompts, by)

        best_k = result.best("fixed_k", by) if result.family("fixed_k") else None
        ablated = result.best("ablated", by) if result.family("ablated") else None
        held = self.held_out(dm)
        if self.eval_prompts and not held:
            print(f"sweep: no validation prompts left after the sweep's {len(prompts)} for sweep.eval_prompts")
        if held:
            closing = self._run(
                dm,
                pl_module,
                report,
                held,
                "held-out comparison",
                thresholds=[report.threshold],
                unscored=[report.unscored],
                fixed_k=[int(best_k.param)] if best_k is not None else [],
                ablated=[ablated.param] if ablated is not None else [],
            )
            report.closing = closing.rows
            report.closing_prompts = (
                f"{len(held)} validation prompts not used for training, calibration or choosing h*/K, "
                f"up to {self.max_new_tokens} new tokens"
            )
        else:
            report.closing = [row for row in (baseline, best_k, best, ablated) if row is not None]
            report.closing_prompts = (
                f"the {len(prompts)} validation prompts of the sweep (held out from training; h* and K were chosen "
                f"on them), up to {self.max_new_tokens} new tokens"
            )
        self._log_closing(trainer, report)

    def _greedy_h_star(self, dm, pl_module: LightningModule, report: FitReport, prompts: list, by: str) -> None:
        """The same threshold grid decoded greedily on the same validation prompts: the bundle's greedy h*."""
        result = self._run(
            dm,
            pl_module,
            report,
            prompts,
            "greedy threshold sweep",
            sampling=SamplingConfig(0.0),
            calibration=report.greedy_calibration,
            fixed_k=[],
        )
        best = result.best("threshold", by)
        report.greedy_threshold, report.greedy_unscored = float(best.param), best.variant
        report.greedy_threshold_selection = (
            f"lowest {by} latency per token over the same grid and prompts, decoding greedily"
            + (" with the greedy calibration" if report.greedy_calibration is not None else "")
        )
        _print_sweep(result, best, len(prompts), by, prefix="greedy ")

    @staticmethod
    def _log_table(trainer: Trainer, records: list[dict]) -> None:
        from lightning.pytorch.loggers import WandbLogger

        columns = list(records[0])
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(key="sweep/table", columns=columns, data=[[r[c] for c in columns] for r in records])

    @staticmethod
    def _log_closing(trainer: Trainer, report: FitReport) -> None:
        """Scalars for dashboards and W&B sweeps: ``specdecpp/*`` (at h*), ``fixed_k/*``, ``autoregressive/*`` and
        ``head_ablated/*`` (the rule on the draft's own q, when swept)."""
        metrics: dict[str, float] = {"specdecpp/threshold": float(report.threshold)}
        names = {"threshold": "specdecpp", "fixed_k": "fixed_k", "autoregressive": "autoregressive"}
        names["ablated"] = "head_ablated"
        base = next((r.result for r in report.closing if r.family == "autoregressive"), None)
        for row in report.closing:
            prefix, r = names[row.family], row.result
            metrics[f"{prefix}/tokens_per_second"] = r.tokens_per_second
            metrics[f"{prefix}/verification_rate"] = r.verification_rate
            metrics[f"{prefix}/discard_rate"] = r.discard_rate
            if r.modeled_tokens_per_second is not None:
                metrics[f"{prefix}/modeled_tokens_per_second"] = r.modeled_tokens_per_second
            if row.family == "fixed_k":
                metrics["fixed_k/k"] = float(row.param)
            if row.family == "ablated":
                metrics["head_ablated/threshold"] = float(row.param)
            if base is not None and base.tokens_per_second > 0 and row.family != "autoregressive":
                metrics[f"{prefix}/speedup"] = r.tokens_per_second / base.tokens_per_second
                if r.modeled_tokens_per_second and base.modeled_tokens_per_second:
                    metrics[f"{prefix}/modeled_speedup"] = r.modeled_tokens_per_second / base.modeled_tokens_per_second
        _log(trainer, metrics)


def _export_context_row(trainer: Trainer) -> int:
    """The ``context_row`` the run's :class:`ExportBundle` stage writes into the bundle (0 without one)."""
    export = next((cb for cb in trainer.callbacks if isinstance(cb, ExportBundle)), None)
    return export.context_row if export is not None else 0


def _print_sweep(result, best, prompts: int, by: str, prefix: str = ""):
    """Print a sweep's table and its h*; returns the autoregressive row (the table's reference), if any."""
    baseline = next(iter(result.family("autoregressive")), None)
    print(format_table(result.rows, baseline, title=f"{prefix}threshold sweep ({prompts} validation prompts)"))
    variant = f", unscored={best.variant}" if best.variant else ""
    print(f"{prefix}h* = {float(best.param):g}{variant} ({by} latency)", flush=True)
    return baseline


def closing_table(report: FitReport) -> str:
    """The closing comparison (autoregressive, best fixed K, SpecDec++ at h*, the head ablated) as a terminal table;
    '' if none."""
    if not report.closing:
        return ""
    baseline = next((r for r in report.closing if r.family == "autoregressive"), None)
    return format_table(report.closing, baseline, title=f"SpecDec++ vs. baselines on {report.closing_prompts}")


def _write_sweep(records: list[dict], folder: Path) -> Path:
    (folder / "sweep.json").write_text(json.dumps(records, indent=1) + "\n")
    path = folder / "sweep.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    return path


EXPORT_FIGURES = ("reliability.png", "pareto.png", "sweep.csv")
"""Files an export copies into the bundle when its stages made them (an earlier export's are removed otherwise)."""


def check_export_dir(folder: Path) -> None:
    """ValueError unless ``folder`` is missing, empty or a SpecDec++ bundle (which an export replaces): a model
    folder or anything else must never be written into."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ValueError(f"export.dir={str(folder)!r} is a file: name a folder for the bundle.")
    if not any(folder.iterdir()):
        return
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        config = None
    if not (isinstance(config, dict) and "format_version" in config and "head" in config):
        names = sorted(p.name for p in folder.iterdir())
        raise ValueError(
            f"export.dir={str(folder)!r} is not empty and holds no SpecDec++ bundle ({', '.join(names[:5])}"
            f"{', ...' if len(names) > 5 else ''}): choose a new or empty folder, or an earlier bundle to replace."
        )


class ExportBundle(EndOfFitStage):
    """Write the ``SpecDecPP`` bundle (head, calibration, h*, cost model, provenance, model card) and check that it
    loads with ``SpecDecPP.from_pretrained`` and generates."""

    run_config: dict[str, Any] | None = None
    """The full parsed run configuration, recorded in the bundle's provenance (set by the CLI)."""
    command: str | None = None
    """The command line of the run, for the model card (set by the CLI)."""

    def __init__(
        self,
        enabled: bool = True,
        dir: str | None = None,
        threshold: float | None = None,
        min_candidates: int = 2,
        max_candidates: int = 20,
        verify: bool = True,
        tree: dict[str, Any] | None = None,
        context_row: int = 0,
    ) -> None:
        """
        Args:
            enabled: Run this stage.
            dir: Bundle folder, conventionally ``checkpoints/<name>``.
            threshold: h when no sweep ran (otherwise the sweep's h* is used).
            min_candidates: Used when no sweep ran (otherwise the sweep's value).
            max_candidates: Used when no sweep ran (otherwise the sweep's value).
            verify: Reload the bundle with ``SpecDecPP.from_pretrained`` (reusing the loaded models) and generate.
            tree: The bundle's settings for ``generate(tree=True)``: keyword arguments of
                :class:`~accept_head.trees.growth.HeadTree` (``width``, ``top_k``, ``max_nodes``, ``siblings``,
                ``context_row``, ...), e.g. ``{context_row: 4}``; None: HeadTree's defaults.
            context_row: Tokens copied from the text that ``generate`` verifies beside each chain (the bundle's
                ``context_row``; 0: none).
        """
        if enabled and not dir:
            raise ValueError("export.dir is not set: name the bundle folder, e.g. --export.dir=checkpoints/<name>.")
        if enabled:
            check_export_dir(Path(dir).expanduser())
        if threshold is not None:
            check_thresholds([threshold])
        self.enabled, self.dir, self.threshold = enabled, dir, threshold
        self.min_candidates, self.max_candidates, self.verify = min_candidates, max_candidates, verify
        self.tree, self.context_row = dict(tree or {}), check_context_row(context_row)
        unknown = sorted(set(self.tree) - set(TREE_SETTINGS))
        if unknown:
            raise ValueError(f"export.tree settings {unknown} are unknown; use {', '.join(TREE_SETTINGS)}.")

    def run(self, trainer: Trainer, pl_module: LightningModule, report: FitReport, folder: Path) -> None:
        dm = _datamodule(trainer)
        threshold = report.threshold if report.threshold is not None else self.threshold
        if threshold is None:
            raise ValueError("No threshold to export: enable the sweep (sweep.enabled=true) or set --export.threshold.")
        bundle_dir = Path(self.dir).expanduser()
        target, tokenizer = dm.target(), dm.tokenizer()
        provenance = self._provenance(trainer, dm, report)
        bundle = SpecDecPP(
            target=target,
            draft=pl_module.draft,
            head=copy.deepcopy(pl_module.head).float().eval(),
            threshold=threshold,
            tokenizer=tokenizer,
            min_candidates=report.min_candidates if report.min_candidates is not None else self.min_candidates,
            max_candidates=report.max_candidates if report.max_candidates is not None else self.max_candidates,
            temperature=dm.sampling.temperature,
            calibration=report.calibration,
            greedy_calibration=report.greedy_calibration,
            cost_model=report.cost_model.to_dict() if report.cost_model is not None else None,
            provenance=provenance,
            target_spec=dm.target_spec,
            draft_spec=dm.draft,
            unscored=report.unscored,
            greedy_threshold=report.greedy_threshold,
            greedy_unscored=report.greedy_unscored,
            tree=self.tree,
            context_row=self.context_row,
        )
        check_export_dir(bundle_dir)
        bundle.save_pretrained(bundle_dir)
        (bundle_dir / "split.json").write_text(json.dumps(dm.split_record(), indent=1) + "\n")
        figures = [
            Path(report.artifacts[name]) for name in ("reliability", "pareto", "sweep_csv") if name in report.artifacts
        ]
        figures = [figure for figure in figures if figure.is_file()]
        for figure in figures:
            shutil.copy2(figure, bundle_dir / figure.name)
        for stale in set(EXPORT_FIGURES) - {figure.name for figure in figures}:  # an earlier export's, not this run's
            (bundle_dir / stale).unlink(missing_ok=True)
        card = model_card(str(self.dir), bundle, dm, report, provenance, dict(pl_module.hparams), self.command)
        (bundle_dir / "README.md").write_text(card)
        report.export_dir = str(bundle_dir)
        print(f"exported SpecDec++ bundle to {bundle_dir} (h* = {threshold:g})", flush=True)
        if self.verify:
            loaded = SpecDecPP.from_pretrained(bundle_dir, target=target, draft=pl_module.draft, tokenizer=tokenizer)
            prompt = dm.val_prompts(1)[0][1]
            out = loaded.generate(prompt, max_new_tokens=8, seed=0)
            print(f"bundle check: from_pretrained + generate -> {len(out.new_token_ids)} tokens", flush=True)

    def _provenance(self, trainer: Trainer, dm: AcceptanceDataModule, report: FitReport) -> dict[str, Any]:
        return {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "accept_head_version": __version__,
            "command": self.command,
            "config": self.run_config,
            "data_meta": dm.meta,
            "split": {k: v for k, v in dm.split_record().items() if k not in ("train", "val")} | {"file": "split.json"},
            "training": {"epochs": trainer.current_epoch, "steps": trainer.global_step},
            "val_metrics": report.val_metrics,
            "calibration": _choice_record(report.calibration_choice),
            "greedy_calibration": _choice_record(
                report.greedy_calibration_choice,
                dataset=dm.greedy_path,
                prompts=len(set(dm.split.get("greedy", [])) - set(report.calibration_excluded)),
            ),
            "cost_model_source": report.cost_model_source,
            "sampling": dm.sampling.to_dict(),
            "threshold_selection": report.threshold_selection,
            "sweep": report.sweep.to_records() if report.sweep is not None else None,
            "closing": {"prompts": report.closing_prompts, "rows": [row.to_dict() for row in report.closing]},
        }


def _choice_record(choice, **extra) -> dict | None:
    """A calibration choice as the bundle's provenance records it (None when no map was fitted)."""
    if choice is None:
        return None
    return {"chosen": choice.chosen, "scores": choice.scores, "evaluation": choice.evaluation, **extra}
