"""What every ``python -m eval`` command shares: the cost model, output, and the ``Args:`` docstring section a long
command keeps beside it. The pair and the prompts come from the options the commands share,
:class:`accept_head.engine.pair_loading.PairOptions` and :class:`accept_head.core.prompts.PromptOptions`, and are
decoded by :mod:`accept_head.engine.runner`.

Nothing here runs at import time.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from ..core.costs import CostModel
from ..core.prompts import PromptOptions, PromptSet, PromptSource, chat_prompt_ids, load_prompts
from ..engine.measure import measure_costs
from ..engine.pair_loading import Pair, PairOptions, load_pair
from ..engine.runner import MethodSummary
from ..labelgen.output import make_writable_dir
from ..models.loading import check_draft_weights, load_model, load_tokenizer
from ..models.pairs import ModelSpec
from ..training.data import same_model

# ---- documentation -------------------------------------------------------------------------------------------------

Command = TypeVar("Command", bound=Callable)


def with_args_doc(section: str) -> Callable[[Command], Command]:
    """Append ``section``, a command's ``Args:`` docstring section kept beside it, to the decorated command's
    docstring, which jsonargparse reads as the command's ``--help``: for a command whose documented flags alone would
    outgrow the function that runs them."""

    def attach(command: Command) -> Command:
        """``command`` with ``section`` after its own docstring."""
        command.__doc__ = (command.__doc__ or "").rstrip() + "\n" + section
        return command

    return attach


# ---- cost model ----------------------------------------------------------------------------------------------------


def resolve_cost_model(source: str, pair: Pair, seed: int = 0, target_runtime: str = "eager") -> tuple[CostModel, str]:
    """The cost model ``source`` names: ``bundle`` (stored in the bundle; measured if absent), ``measure`` (measured
    now on this machine, head included, the target running as ``target_runtime``) or a path to a ``costs.json``.
    Returns it and where it came from. A bundle's stored model priced the eager target: for another runtime it is
    used with a warning naming the fix."""
    if source == "bundle":
        if pair.bundle is not None and pair.bundle.cost_model:
            if target_runtime != "eager":
                warnings.warn(
                    f"target_runtime={target_runtime!r}, but the bundle's cost model was measured with the eager "
                    "target: the modeled figures (and any choice made by them) price the wrong passes. Pass "
                    "--cost_model measure, or a costs.json from `python -m eval costs --target_runtime "
                    f"{target_runtime}`.",
                    stacklevel=2,
                )
            return CostModel.from_dict(pair.bundle.cost_model), "bundle"
        source = "measure"
    if source == "measure":
        head = pair.bundle.head if pair.bundle is not None else None
        return measure_costs(pair.target, pair.draft, head, seed=seed, target_runtime=target_runtime), "measured"
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"cost_model={source!r} is neither 'bundle', 'measure' nor an existing costs.json; "
            "write one with `python -m eval costs`."
        )
    return CostModel.from_dict(json.loads(path.read_text())), str(path)


# ---- output --------------------------------------------------------------------------------------------------------


def check_labelled_by(meta: dict, draft: ModelSpec | None, dataset: str | Path, who: str) -> None:
    """ValueError when the label dataset ``dataset`` (its ``meta``) was made with another draft than ``draft``, the
    one ``who`` (a head, a bundle) was trained for, or with the same folder before it was retrained in place: scores
    there would mean nothing. Nothing is checked where either side records no draft."""
    raw = meta.get("draft")
    if draft is None or not isinstance(raw, dict) or "path" not in raw:
        return
    labelled = ModelSpec(**raw)
    if not same_model(labelled, draft):
        raise ValueError(
            f"{who} was trained for the draft {draft.path!r} but {dataset} was labelled with {labelled.path!r}: "
            f"score it on labels of its own draft (python -m data_gen --draft.path {draft.path})."
        )
    check_draft_weights(meta.get("draft_weights"), draft.path, f"The dataset {dataset}")


def output_folder(output_dir: str | Path) -> Path:
    """Create ``output_dir`` (failing early, before any model is loaded, if it cannot be written)."""
    folder = Path(output_dir)
    make_writable_dir(folder)
    return folder


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    return a / b if a is not None and b else None


BOOTSTRAP_RESAMPLES = 2000
"""Prompt resamples behind each ratio's 95% interval (:func:`paired_ratio_interval`)."""


def ratios(summary: MethodSummary, autoregressive: MethodSummary | None, fixed_k: MethodSummary | None) -> dict:
    """``ratio_to_autoregressive`` / ``ratio_to_best_fixed_k`` of ``summary``'s median measured tokens/s, and the
    ``modeled_ratio_to_...`` of its modeled tokens/s (None where the baseline is missing); each with a ``..._ci95``
    from :func:`paired_ratio_interval` (None with fewer than two prompts)."""
    return ratios_to(summary, autoregressive, "autoregressive") | ratios_to(summary, fixed_k, "best_fixed_k")


def ratios_to(summary: MethodSummary, base: MethodSummary | None, name: str) -> dict:
    """:func:`compare`'s four numbers under the keys ``ratio_to_<name>``, ``modeled_ratio_to_<name>`` and their
    ``_ci95``."""
    return {key.replace("ratio", f"ratio_to_{name}", 1): value for key, value in compare(summary, base).items()}


def compare(summary: MethodSummary, base: MethodSummary | None) -> dict:
    """``summary`` over ``base``: ``ratio`` of median measured tokens/s, ``modeled_ratio`` of modeled tokens/s, and
    each one's ``_ci95`` (:func:`paired_ratio_interval`); None where there is no base."""
    return {
        "ratio": ratio(summary.median_tokens_per_second, base and base.median_tokens_per_second),
        "modeled_ratio": ratio(
            summary.pooled.modeled_tokens_per_second, base and base.pooled.modeled_tokens_per_second
        ),
        "ratio_ci95": base and paired_ratio_interval(summary, base, modeled=False),
        "modeled_ratio_ci95": base and paired_ratio_interval(summary, base, modeled=True),
    }


def paired_ratio_interval(
    summary: MethodSummary, base: MethodSummary, modeled: bool, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> list[float] | None:
    """95% interval of ``summary``'s tokens/s over ``base``'s from resampling the test prompts with replacement —
    both methods on the same resample (a paired bootstrap: a hard prompt is hard for every method), each resample's
    ratio pooled over its prompts (Σ tokens / Σ seconds, measured or ``modeled``). The spread between prompts, not
    the timing noise within one, is what it measures. None with fewer than two prompts or a prompt without a price."""
    a, b = summary.per_prompt, base.per_prompt
    if len(a) < 2 or len(a) != len(b):
        return None

    def totals(rows: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        rates = [r.modeled_tokens_per_second if modeled else r.tokens_per_second for r in rows]
        if any(not rate for rate in rates):
            return None
        tokens = torch.tensor([float(r.generated) for r in rows], dtype=torch.float64)
        return tokens, tokens / torch.tensor(rates, dtype=torch.float64)

    ta, tb = totals(a), totals(b)
    if ta is None or tb is None:
        return None
    picks = torch.randint(len(a), (resamples, len(a)), generator=torch.Generator().manual_seed(seed))
    rate_a = ta[0][picks].sum(1) / ta[1][picks].sum(1)
    rate_b = tb[0][picks].sum(1) / tb[1][picks].sum(1)
    low, high = torch.quantile(rate_a / rate_b, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [low, high]


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    """A number for a table ("–" for missing)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}{suffix}"


def interval_cell(interval: list[float] | None) -> str:
    """A ratio's 95% interval for a table ("–" for none)."""
    return "–" if interval is None else f"{interval[0]:.2f}–{interval[1]:.2f}"


def tokens_per_second_cells(method: dict) -> list[str]:
    """Table cells of a method dict's measured tokens/s: the median, and min–max over repeats."""
    tps = method["tokens_per_second"]
    return [fmt(tps["median"]), f"{fmt(tps['min'])}–{fmt(tps['max'])}"]


def load_target(options: PairOptions) -> Pair:
    """The target and its tokenizer (as a :class:`Pair`; its draft is not used): ``target`` if given, else the
    bundle's pair."""
    if options.target is None and options.bundle is None:
        raise ValueError("Pass --bundle PATH (its target is used) or --target.path.")
    if options.target is None:
        return load_pair(options.bundle, device=options.device, dtype=options.dtype)
    spec = ModelSpec.coerce(options.target)
    spec.device = options.device or spec.device
    spec.dtype = options.dtype or spec.dtype
    return Pair(load_model(spec), None, load_tokenizer(spec), target_spec=spec)


def draft_held_out(pair: Pair, prompt_set: PromptSet, options: PromptOptions) -> list[str]:
    """The ids of the prompts of ``prompt_set`` (prompts a result is reported on) that the draft's own recipe held
    out, with a warning naming them: a feature draft records its recipe's ``eval_prompts`` (``config.json``'s
    ``extra.recipe``), on which the recipe's runs were compared and a checkpoint chosen, so a result on them is a
    validation figure, not a test one. Drafts that record none give []; held-out sources that cannot be read from
    here are skipped with a warning."""
    recipe = (getattr(getattr(pair.draft, "config", None), "extra", None) or {}).get("recipe") or {}
    if not recipe.get("eval_prompts"):
        return []
    try:
        held = load_prompts(
            [PromptSource(**s) for s in recipe["eval_prompts"]],
            seed=recipe.get("seed", 0),
            split_seed=recipe.get("split_seed", 0) or 0,
        )
    except (FileNotFoundError, ValueError) as err:
        warnings.warn(f"the draft's held-out prompts could not be read ({err}); not checked against the test prompts.")
        return []
    mode, system = options.prompt_mode, options.system_prompt
    held_ids = {tuple(chat_prompt_ids(pair.tokenizer, p.text, mode, system)) for p in held}
    shared = [p.id for p in prompt_set.prompts if tuple(p.ids) in held_ids]
    if shared:
        warnings.warn(
            f"{len(shared)} of the {len(prompt_set.prompts)} prompts of {prompt_set.name!r} (e.g. {shared[:3]}) are "
            "among the prompts the draft's recipe held out and chose its checkpoint on (its config.json, "
            "extra.recipe.eval_prompts): results on them are not test results. Choose prompts outside them, e.g. "
            "past the recipe's per-source limit of each `eval` split (configs/eval/bench-clean.yaml does so for the "
            "embedded pair).",
            stacklevel=2,
        )
    return shared
