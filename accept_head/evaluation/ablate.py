"""``python -m eval ablate``: what each ingredient of the head is worth — depth, w_rej, training-set size,
calibration, min/max candidates — one factor at a time, on the same labels, prompts and cost model.

Every variant is one ``python -m train fit`` of the base config with a few overrides (the same command a user would
type; W&B and the bundle export are switched off). Each is scored on the validation split it trained beside: the
head's AUC / ECE / Brier, the ECE after the kept calibration, and SpecDec++'s modeled tokens/s at its best h on the
same validation prompts and seeds, priced by one fixed cost model (the bundle's), so that differences come from the
stop decisions alone and not from the machine's load. The first variant also decodes the autoregressive target and
fixed-K baselines. Results are written per variant as they finish (a rerun skips the finished ones), then
``ablate.json``, ``ablate.png`` and, with ``--markdown``, a page.
"""

from __future__ import annotations

import gc
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.records import machine_info, write_json
from ..core.tables import markdown_table, text_table
from .common import fmt, output_folder, ratio


@dataclass
class Variant:
    """One run of the ablation: a name and ``python -m train fit`` overrides of the base config."""

    name: str
    args: list[str] = field(default_factory=list)
    """e.g. ``["--model.depth=1"]`` or ``["--data.train_fraction=0.25"]``."""
    note: str = ""
    """What the variant changes, for the table (default: the overrides)."""


DEFAULT_VARIANTS = [Variant("recipe", [], "the config as committed")]


@dataclass
class SweepSettings:
    """How every variant's head is decoded after training: the ``settings`` of ablate.json, as given."""

    thresholds: list[float]
    unscored: list[str | None]
    fixed_k: list[int]
    prompts: int
    max_new_tokens: int
    seed: int


def _fit_args(
    config: str, variant: Variant, folder: Path, cost_model: dict, sweep: SweepSettings, baselines: bool
) -> list[str]:
    """The ``python -m train fit`` command line of one variant (a fixed cost model, no export, no W&B)."""
    runs = folder / "runs"
    overrides = {
        "trainer": {
            "logger": [
                {
                    "class_path": "lightning.pytorch.loggers.CSVLogger",
                    "init_args": {"save_dir": str(runs), "name": variant.name},
                }
            ],
            "default_root_dir": str(runs / variant.name),
            "enable_progress_bar": False,
        },
        "cost_model": {
            "enabled": True,
            "measure": False,
            "t_draft": cost_model["t_draft"],
            "t_target_a": cost_model["t_target_a"],
            "t_target_b": cost_model.get("t_target_b", 0.0),
            "t_draft_next": cost_model.get("t_draft_next"),
            "t_head": cost_model.get("t_head"),
            "t_head_next": cost_model.get("t_head_next"),
        },
        "sweep": {
            "enabled": True,
            "thresholds": [float(h) for h in sweep.thresholds],
            "unscored": list(sweep.unscored),
            "fixed_k": [int(k) for k in sweep.fixed_k] if baselines else [],
            "autoregressive": baselines,
            "ablated": baselines,  # the head's rule on the draft's own q: the head removed altogether
            "prompts": sweep.prompts,
            "eval_prompts": 0,
            "max_new_tokens": sweep.max_new_tokens,
            "select": "modeled",
            "seed": sweep.seed,
            "progress": False,
        },
        "export": {"enabled": False},
    }
    path = runs / f"{variant.name}.overrides.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(overrides, indent=1) + "\n")  # JSON is YAML
    # The variant's own flags come last, so a variant may change the sweep too (e.g. --sweep.min_candidates=2).
    return ["fit", "--config", config, "--config", str(path), *variant.args]


_ROW_KEYS = ("label", "family", "param", "variant", "modeled_tokens_per_second", "tokens_per_second")
_ROW_KEYS += ("verification_rate", "discard_rate", "mean_proposed", "mean_accepted")
"""What a variant's result keeps of each sweep row (:meth:`~accept_head.engine.sweep.SweepRow.to_dict`)."""


def _row_dict(row) -> dict[str, Any]:
    full = row.to_dict()
    return {key: full[key] for key in _ROW_KEYS}


def _labelled(row) -> int:
    """Labelled positions of a training row: a token-level row's response, a rollout row's candidates."""
    return len(row.response_ids) if hasattr(row, "response_ids") else len(row)


def run_variant(args: list[str]) -> dict[str, Any]:
    """Fit one variant in this process and read its :class:`~accept_head.training.report.FitReport`."""
    import torch

    from ..training.cli import cli_main

    threads = torch.get_num_threads()
    cli = cli_main(args)
    torch.set_num_threads(threads)  # Lightning may change it; keep every variant alike
    report, dm = cli.model.fit_report, cli.datamodule
    sweep = report.sweep
    best = sweep.best("threshold", "modeled")
    choice = report.calibration_choice
    out = {
        "train_prompts": len(dm.split["train"]),
        "train_positions": int(sum(_labelled(row) for row in dm.train_set.rows)),
        "val_prompts": len(dm.split["val"]),
        "val": dict(report.val_metrics),
        "calibration": (
            {"chosen": choice.chosen, "scores": choice.scores, "evaluation": choice.evaluation} if choice else None
        ),
        "h_star": best.param,
        "unscored": best.variant,
        "best": _row_dict(best),
        "rows": [_row_dict(row) for row in sweep.rows],
        "sweep_prompts": sweep.prompts,
    }
    del cli, report, dm
    gc.collect()
    return out


def ablate(
    train_config: str = "configs/smollm2-135m-specdecpp.yaml",
    variants: list[Variant] | None = None,
    bundle: str | None = "checkpoints/smollm2-135m-specdecpp",
    cost_model: str | None = None,
    thresholds: list[float] = [0.4, 0.6, 0.8],  # noqa: B006 (jsonargparse reads the default)
    unscored: list[str | None] = ["confidence"],  # noqa: B006
    fixed_k: list[int] = [1, 2, 3],  # noqa: B006
    prompts: int = 16,
    max_new_tokens: int = 96,
    seed: int = 0,
    output_dir: str = "eval_out/ablate",
    markdown: str | None = None,
    resume: bool = True,
) -> dict:
    """Train and score one head per variant; print and write the comparison.

    Args:
        train_config: The ``python -m train fit`` config every variant starts from.
        variants: The runs (name + overrides); the first is the reference the others are compared with and also
            decodes the autoregressive and fixed-K baselines.
        bundle: Take the fixed cost model from this bundle's ``config.json`` (the one its h* was chosen with).
        cost_model: Or from a ``costs.json`` of ``python -m eval costs`` (overrides ``bundle``).
        thresholds: Grid of h each variant is decoded with; its best is reported.
        unscored: HeadThreshold variants swept with every h (``null``: Alg. 2; ``confidence``).
        fixed_k: Fixed-K baselines (decoded once, with the first variant).
        prompts: Validation prompts decoded per policy (the first ones of the seeded validation order).
        max_new_tokens: New tokens per prompt.
        seed: Per-prompt sampling seed of the sweep (rerun the reference with another seed to see the noise).
        output_dir: Folder for per-variant results, ablate.json, ablate.png and the training logs.
        markdown: Also write this Markdown page (e.g. docs/ablations.md), its figure next to it.
        resume: Skip variants whose result file exists with the same command line.
    """
    variants = list(variants) if variants else list(DEFAULT_VARIANTS)
    _check(variants, train_config, prompts, max_new_tokens)
    costs, cost_source = _cost_model(bundle, cost_model)
    folder = output_folder(output_dir)
    sweep = SweepSettings(thresholds, unscored, fixed_k, prompts, max_new_tokens, seed)
    results = [
        _run_or_resume(train_config, variant, folder, costs, sweep, index == 0, resume)
        for index, variant in enumerate(variants)
    ]
    payload = {
        "command": "ablate",
        "machine": machine_info(),
        "train_config": train_config,
        "cost_model": costs,
        "cost_model_source": cost_source,
        "settings": asdict(sweep),
        "variants": [asdict(v) for v in variants],
        "results": results,
    }
    write_json(folder / "ablate.json", payload)
    figure = ablate_plot(results, folder / "ablate.png")
    header, rows = _table(results)
    print(text_table(header, rows, title=_title(payload)))
    if markdown:
        _write_page(Path(markdown), payload, header, rows)
    print(f"wrote {folder / 'ablate.json'} and {figure}")
    return payload


def _check(variants: list[Variant], train_config: str, prompts: int, max_new_tokens: int) -> None:
    """Refuse, naming the fix, variant names that cannot name a result file, a missing config or an empty sweep."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique (got {names}): each names its result file.")
    bad = [n for n in names if not n or "/" in n or n.startswith(".")]
    if bad:
        raise ValueError(f"variant names {bad} cannot be file names; use letters, digits, '-' and '_'.")
    if not Path(train_config).is_file():
        raise FileNotFoundError(
            f"train_config={train_config!r} does not exist; point --train_config at a python -m train fit config."
        )
    if prompts < 1 or max_new_tokens < 1:
        raise ValueError(f"prompts={prompts} and max_new_tokens={max_new_tokens} must be >= 1.")


def _run_or_resume(
    config: str, variant: Variant, folder: Path, costs: dict, sweep: SweepSettings, baselines: bool, resume: bool
) -> dict[str, Any]:
    """One variant's result: read back when ``resume`` finds it done with the same command line, else trained and
    scored now and written to ``variants/<name>.json``."""
    args = _fit_args(config, variant, folder, costs, sweep, baselines)
    path = folder / "variants" / f"{variant.name}.json"
    if resume and path.is_file():
        done = json.loads(path.read_text())
        if done.get("args") == args:
            print(f"[ablate] {variant.name}: already done ({path})", flush=True)
            return done
    print(f"[ablate] {variant.name}: python -m train {' '.join(args)}", flush=True)
    result = {"name": variant.name, "note": variant.note or " ".join(variant.args) or "–", "args": args}
    result |= run_variant(args)
    write_json(path, result)
    return result


def _write_page(page: Path, payload: dict, header: list[str], rows: list[list[str]]) -> None:
    """Write the Markdown page ``page`` with its figure and a copy of ablate.json in the folder of the same name."""
    figure = page.with_suffix("").with_name(page.stem) / "ablate.png"
    ablate_plot(payload["results"], figure)
    write_json(figure.with_name("ablate.json"), payload)
    page.write_text(_page(payload, header, rows, figure.relative_to(page.parent)))
    print(f"wrote {page} and {figure}")


def _cost_model(bundle: str | None, cost_model: str | None) -> tuple[dict, str]:
    from ..core.costs import CostModel

    if cost_model is not None:
        if not Path(cost_model).is_file():
            raise FileNotFoundError(f"cost_model={cost_model!r} does not exist; write one with python -m eval costs.")
        model, source = CostModel.from_dict(json.loads(Path(cost_model).read_text())), cost_model
    elif bundle is not None:
        config = Path(bundle) / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"bundle={bundle!r} has no config.json; pass a SpecDec++ bundle or --cost_model.")
        stored = json.loads(config.read_text()).get("cost_model")
        if not stored:
            raise ValueError(f"bundle={bundle!r} stores no cost model; pass --cost_model costs.json.")
        model, source = CostModel.from_dict(stored), f"{bundle} (config.json)"
    else:
        raise ValueError("ablate needs a fixed cost model: give --bundle or --cost_model (a costs.json).")
    keys = ("t_draft", "t_target_a", "t_target_b", "t_draft_next", "t_head", "t_head_next")
    return {key: getattr(model, key) for key in keys}, source


def _baselines(results: list[dict]) -> tuple[dict | None, dict | None, dict | None]:
    """The autoregressive row, the best fixed-K row and the best head-ablated row (the threshold rule on the draft's
    own q; by modeled tokens/s) of the reference run."""
    rows = results[0]["rows"] if results else []
    ar = next((r for r in rows if r["family"] == "autoregressive"), None)

    def best(family: str) -> dict | None:
        grid = [r for r in rows if r["family"] == family]
        return max(grid, key=lambda r: r["modeled_tokens_per_second"] or 0.0) if grid else None

    return ar, best("fixed_k"), best("ablated")


def _table(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    ar, best_k, ablated = _baselines(results)
    header = [
        "variant",
        "change",
        "train prompts",
        "AUC",
        "ECE raw",
        "ECE cal.",
        "h*",
        "cand./round",
        "modeled tok/s",
        "× best K",
        "measured tok/s",
    ]

    def vs_best_k(row: dict) -> str:
        return fmt(ratio(row["modeled_tokens_per_second"], best_k and best_k["modeled_tokens_per_second"]), 3, "×")

    rows = []
    for res in results:
        val, best = res["val"], res["best"]
        cal = res.get("calibration") or {}
        kept = (cal.get("scores") or {}).get(cal.get("chosen") or "raw", {})
        rows.append(
            [
                res["name"],
                res["note"],
                str(res["train_prompts"]),
                fmt(val.get("auc"), 3),
                fmt(val.get("ece"), 3),
                fmt(kept.get("ece"), 3) + (f" ({cal['chosen']})" if cal.get("chosen") else ""),
                f"{res['h_star']:g}" + (" +conf" if res.get("unscored") else ""),
                fmt(best["mean_proposed"], 2),
                fmt(best["modeled_tokens_per_second"], 1),
                vs_best_k(best),
                fmt(best["tokens_per_second"], 1),
            ]
        )
    for base in (ar, best_k, ablated):
        if base is not None:
            rows.append(
                [
                    base["label"],
                    "baseline (reference run)" + (": the head removed, its rule on q" if base is ablated else ""),
                    *[""] * 5,  # no head: no training prompts, AUC, ECEs or h*
                    fmt(base["mean_proposed"], 2) if base["family"] != "autoregressive" else "–",
                    fmt(base["modeled_tokens_per_second"], 1),
                    vs_best_k(base),
                    fmt(base["tokens_per_second"], 1),
                ]
            )
    return header, rows


def _title(payload: dict) -> str:
    s, c = payload["settings"], payload["cost_model"]
    return (
        f"ablation on {s['prompts']} validation prompts, up to {s['max_new_tokens']} new tokens, best of h in "
        f"{s['thresholds']}; cost model t_draft {1e3 * c['t_draft']:.2f} ms, t_target(K) = "
        f"{1e3 * c['t_target_a']:.2f} + {1e3 * c['t_target_b']:.3f}·K ms ({payload['cost_model_source']})"
    )


def _cpu(machine: dict) -> str:
    """The CPU of a page's ``machine`` record: model name, family/model numbers and torch capability (pages written
    before those were recorded say so)."""
    family = machine.get("cpu_family_model")
    capability = machine.get("cpu_capability")
    return (
        f"{machine['cpu']}"
        + (f", family/model {family}" if family else "")
        + (f", `cpu_capability` {capability}" if capability else ", capability not recorded")
    )


def _page(payload: dict, header: list[str], rows: list[list[str]], figure: Path) -> str:
    s = payload["settings"]
    command = payload["machine"].get("command") or "python -m eval ablate"
    lines = [
        "# Ablations of the acceptance head",
        "",
        f"Generated by `{command}` on {payload['machine']['date']} ({_cpu(payload['machine'])}, "
        f"{payload['machine']['torch_threads']} torch threads). Nothing on this page is typed by hand.",
        "",
        f"Each row is one `python -m train fit --config {payload['train_config']}` with the overrides in `change`, "
        "scored on the validation split of the same labels: AUC, ECE and the calibrated ECE on all validation "
        f"positions (token-mixed contexts, the calibration cross-fitted by prompt), and SpecDec++ at its best h in "
        f"{s['thresholds']} (unscored {s['unscored']}) on the first {s['prompts']} validation prompts, up to "
        f"{s['max_new_tokens']} new tokens, sampling seed {s['seed']}. Throughput is *modeled* with one fixed "
        f"cost model for every row ({payload['cost_model_source']}), so rows differ only by their stop decisions; "
        "`measured tok/s` is wall clock on a shared 2-core machine and is noisier. `× best K` divides by the best "
        "fixed K of the reference run (same prompts and seeds).",
        "",
        markdown_table(header, rows, "ll" + "r" * (len(header) - 2)),
        "",
        f"![modeled throughput per variant]({figure.as_posix()})",
        "",
    ]
    return "\n".join(lines)


def ablate_plot(results: list[dict], path: str | Path) -> Path:
    """Horizontal bars: SpecDec++'s modeled tokens/s per variant, with the reference run's baselines as lines."""
    from ..acceptance.plots import new_figure, save_figure

    ar, best_k, ablated = _baselines(results)
    fig = new_figure(6.4, 0.45 * len(results) + 1.6)
    ax = fig.subplots()
    values = [r["best"]["modeled_tokens_per_second"] or 0.0 for r in results]
    ax.barh(range(len(results)), values, color="tab:red")
    ax.set_yticks(range(len(results)), [r["name"] for r in results])
    ax.invert_yaxis()
    for base, style in ((best_k, "--"), (ablated, "-."), (ar, ":")):
        if base is not None and base["modeled_tokens_per_second"]:
            ax.axvline(base["modeled_tokens_per_second"], color="black", linestyle=style, label=base["label"])
    finite = [v for v in values if v and math.isfinite(v)]
    if finite:
        shown = finite + [b["modeled_tokens_per_second"] for b in (ar, best_k, ablated) if b]
        ax.set_xlim(0.9 * min(shown), 1.05 * max(shown))
    ax.set_xlabel("SpecDec++ modeled tokens/s at its best h")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("one factor at a time", fontsize=10)
    return save_figure(fig, path)
