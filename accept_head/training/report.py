"""What the end-of-fit stages hand to each other: one :class:`FitReport` per ``fit``, held by the module."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..acceptance.calibration import Calibration, CalibrationChoice
from ..core.costs import CostModel
from ..engine.sweep import SweepResult, SweepRow


@dataclass
class FitReport:
    """Results of calibration, cost model, threshold sweep and export, filled in that order (each optional)."""

    calibration: Calibration | None = None
    """The kept calibration map (None: raw probabilities were best, or calibration was off)."""
    calibration_choice: CalibrationChoice | None = None
    greedy_calibration: Calibration | None = None
    """The map kept on greedy labels (``data.greedy_path``) for greedy decoding; None: the one map serves both."""
    greedy_calibration_choice: CalibrationChoice | None = None
    calibration_excluded: list[str] = field(default_factory=list)
    """Validation prompt ids left out of calibration because the closing comparison reports on them."""
    cost_model: CostModel | None = None
    cost_model_source: str | None = None
    """Where it was measured (:func:`~accept_head.core.records.where_measured`: the device, a CPU's model and
    capability, the threads and the dtype) or ``config``."""
    sweep: SweepResult | None = None
    threshold: float | None = None
    """h*: the threshold the bundle decodes with."""
    threshold_selection: str | None = None
    """How h* was chosen (criterion and prompts)."""
    min_candidates: int | None = None
    max_candidates: int | None = None
    unscored: str | None = None
    """HeadThreshold's ``unscored`` setting chosen with h* (None: Alg. 2)."""
    greedy_threshold: float | None = None
    """h* for greedy decoding, when the sweep also ran greedily (``sweep.greedy``); None: the one h* serves both."""
    greedy_unscored: str | None = None
    greedy_threshold_selection: str | None = None
    closing: list[SweepRow] = field(default_factory=list)
    """Autoregressive, best fixed K and SpecDec++ at h*, on held-out prompts."""
    closing_prompts: str = ""
    """Which prompts the closing table was measured on."""
    artifacts: dict[str, str] = field(default_factory=dict)
    """Name → path of files written next to the logs (reliability.png, pareto.png, sweep.csv, ...)."""
    val_metrics: dict[str, float] = field(default_factory=dict)
    """Validation metrics of the final head."""
    export_dir: str | None = None
