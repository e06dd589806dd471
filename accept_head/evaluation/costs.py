"""``python -m eval costs``: measure t_draft, the head's time and t_target(K) on this machine (SpecDec++ eq. 2.1)."""

from __future__ import annotations

from ..acceptance.head import AcceptanceHead
from ..core.costs import CostModel
from ..core.records import machine_info, write_json
from ..core.tables import text_table
from ..engine.measure import measure_costs
from ..engine.pair_loading import PairOptions
from ..models.static_target import check_runtime
from .common import fmt, output_folder
from .plots import costs_plot


def costs(
    pair: PairOptions | None = None,
    ks: list[int] | None = None,
    context: int = 128,
    repeats: int = 15,
    warmup: int = 3,
    seed: int = 0,
    head_depth: int | None = None,
    target_runtime: str = "eager",
    output_dir: str = "eval_out/costs",
) -> dict:
    """Measure the cost model of a pair: one cached draft step (plus the head's scoring when a bundle is given) right
    after a target pass and right after another draft step (the rest of a round), one target pass verifying K
    candidates for every K and a one-token pass (the autoregressive step the speculative rows are compared with),
    each a median over ``repeats`` after ``warmup`` runs on a ``context``-token KV cache; fit t_target(K) = a + b·K
    over the K. Writes costs.json (load it with ``--cost_model``) and costs.png, and prints the table.

    Args:
        pair: The pair (a bundle's pair and head, or a target and a draft).
        ks: Candidate counts K to time (default 1..20).
        context: Tokens in the KV cache while timing.
        repeats: Timed runs per measurement (the median is kept, min and max reported).
        warmup: Untimed runs before each measurement.
        seed: Seed of the random token ids used as inputs.
        head_depth: Without a bundle, time a fresh head of this depth (its weights do not change its cost), so the
            head's overhead per draft step is measured before any head is trained.
        target_runtime: How the target runs (``eager``, ``static`` or ``compiled``, as ``eval bench
            --target_runtime``): price rounds for the runtime you decode with.
        output_dir: Folder for costs.json and costs.png.
    """
    ks = list(range(1, 21)) if ks is None else [int(k) for k in ks]
    if not ks or min(ks) < 1:
        raise ValueError(f"ks={ks} must be a non-empty list of K >= 1.")
    if repeats < 1 or warmup < 0 or context < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0 and context >= 1 (got {repeats}, {warmup}, {context}).")
    check_runtime(target_runtime)
    folder = output_folder(output_dir)
    pair = (pair or PairOptions()).load()
    head = pair.bundle.head if pair.bundle is not None else None
    if head is None and head_depth is not None:
        head = AcceptanceHead(pair.draft.config.hidden_size, depth=head_depth).to(pair.draft.device).eval()
    model: CostModel = measure_costs(
        pair.target, pair.draft, head, ks, context, repeats, warmup, seed, target_runtime=target_runtime
    )
    payload = {
        "command": "costs",
        "machine": machine_info(),
        "pair": pair.describe(),
        "settings": {"ks": ks, "context": context, "repeats": repeats, "warmup": warmup, "seed": seed}
        | {"target_runtime": target_runtime},
        "cost_model": model.to_dict(),
        "t_draft_over_t_target": model.t_draft / model.t_target(1),
        "t_draft_next_over_t_target": model.t_step / model.t_target(1),
        "head_over_draft_step": model.measured["head"]["median"] / model.measured["draft"]["median"],
        # a drafting step as decoding alternates them (a round's first after a target pass, the rest after a draft
        # step), averaged over a round of K steps, against a one-token target pass: issue 37's c
        "round_draft_step_over_t_single": {k: model.drafting(k) / k / model.t_target(0) for k in ks},
    }
    write_json(folder / "costs.json", payload)
    costs_plot(model, folder / "costs.png", title=f"costs on {payload['machine']['cpu'] or 'this machine'}")
    print_costs(model, payload, ks, head is not None)
    print(f"wrote {folder / 'costs.json'} and {folder / 'costs.png'}")
    return payload


def print_costs(model: CostModel, payload: dict, ks: list[int], with_head: bool) -> None:
    """Print what :func:`costs` measured: each pass's median, min and max, the fit, the head's share of a draft step
    (with a head) and a round's mean draft step against a one-token pass."""
    measured = model.measured

    def row(name: str, seconds: dict, digits: int, fit: str = "–") -> list[str]:
        return [name, *(fmt(seconds[stat] * 1e3, digits) for stat in ("median", "min", "max")), fit]

    rows = [row("draft step", measured["draft"], 2), row("head", measured["head"], 3)]
    rows += [row("next draft step", measured["draft_next"], 2), row("its head", measured["head_next"], 3)]
    rows += [row("target, 1 token", measured["single"], 2)]
    rows += [row(f"target K={k}", measured["target"][k], 2, fmt(model.t_target(k) * 1e3, 2)) for k in ks]
    print(
        text_table(
            ["pass", "median ms", "min ms", "max ms", "fit ms"],
            rows,
            title=f"t_target(K) = {model.t_target_a * 1e3:.2f} + {model.t_target_b * 1e3:.3f}·K ms "
            f"(R² {fmt(model.r2, 3)}), t_draft = {model.t_draft * 1e3:.2f} ms (the round's next steps "
            f"{model.t_step * 1e3:.2f} ms), one-token pass "
            f"{model.t_target(0) * 1e3:.2f} ms",
        )
    )
    if with_head:
        print(f"head: {100 * payload['head_over_draft_step']:.2f}% of a draft step")
    mean_step = ", ".join(f"K={k} {c:.3f}" for k, c in payload["round_draft_step_over_t_single"].items())
    print(f"a round's mean draft step over a one-token pass: {mean_step}")
