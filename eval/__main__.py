"""Command line of ``python -m eval`` (jsonargparse over the documented functions of :mod:`accept_head.evaluation`).

Examples::

    python -m eval bench --config configs/eval/bench.yaml
    python -m eval report --config configs/eval/report.yaml
    python -m eval ablate --config configs/eval/ablate.yaml
    python -m eval free_stop --config configs/eval/free_stop.yaml
    python -m eval costs --bundle checkpoints/smollm2-135m-specdecpp
    python -m eval costs --draft.path checkpoints/smollm2-135m-draft --head_depth 3   # head overhead, no bundle yet
    python -m eval decode_speed --config configs/eval/decode_speed-gpu.yaml   # autoregressive vs generate on a GPU
    python -m eval label_modes --dataset data/labels/label-modes/standalone-heldout
    python -m eval predictors --dataset data/labels/smollm2-feature-rollout \
        --heads '[checkpoints/smollm2-135m-specdecpp]' --split checkpoints/smollm2-135m-specdecpp
    python -m eval sweep --bundle B --prompts '[{path: humaneval, limit: 8}]' --temperatures '[0]'
    python -m eval calibration --bundle B --prompts '[{path: humaneval, limit: 8}]'
    python -m eval bench --help

The options several commands share, :class:`~accept_head.engine.pair_loading.PairOptions` (``pair``) and
:class:`~accept_head.core.prompts.PromptOptions` (``prompt_options``), are flat flags and top-level YAML keys
(``--bundle``, ``--target.path``, ``--prompt_mode``, ``--split_seed``), like the command's own parameters.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from dataclasses import fields

SKIPPED = {"free_stop": {"draft"}, "decode_speed": {"draft"}}
"""Shared options a command has no use for, left out of its flags: free_stop and decode_speed decode the target
alone."""


def commands() -> dict:
    """Subcommand name → function (imported when the command line is parsed, not when this module is)."""
    from accept_head.evaluation.ablate import ablate
    from accept_head.evaluation.bench import bench
    from accept_head.evaluation.calibration import calibration
    from accept_head.evaluation.costs import costs
    from accept_head.evaluation.decode_speed import decode_speed
    from accept_head.evaluation.free_stop import free_stop
    from accept_head.evaluation.label_modes import label_modes
    from accept_head.evaluation.predictors import predictors
    from accept_head.evaluation.report import report
    from accept_head.evaluation.sweep import sweep

    return {
        "calibration": calibration,
        "costs": costs,
        "decode_speed": decode_speed,
        "sweep": sweep,
        "bench": bench,
        "report": report,
        "ablate": ablate,
        "free_stop": free_stop,
        "label_modes": label_modes,
        "predictors": predictors,
    }


def option_groups() -> dict[str, type]:
    """Parameter name → the dataclass of shared options it takes, whose fields are the command's flags."""
    from accept_head.core.prompts import PromptOptions
    from accept_head.engine.pair_loading import PairOptions

    return {"pair": PairOptions, "prompt_options": PromptOptions}


def plain(text: str) -> str:
    """``text`` without reStructuredText markup, for a terminal: :role:`~a.b.c` → c, :role:`x` → x, ``x`` → x."""
    text = re.sub(r":\w+:`~[\w.]*?(\w+)`", r"\1", text)
    return re.sub(r":\w+:`([^`]+)`", r"\1", text).replace("``", "")


def summary(function) -> str:
    """The first paragraph of ``function``'s docstring, on one line, without markup."""
    return plain(" ".join((inspect.getdoc(function) or "").split("\n\n")[0].split()))


def build_parser(functions: dict, prog: str = "python -m eval"):
    """One sub-parser per command of ``functions`` (:func:`commands`): its shared option groups, then its own
    parameters, every flag at the top level."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(
        prog=prog, description=plain(__doc__.split("\n\n")[0]) if __doc__ else None, allow_abbrev=False
    )
    parser.add_argument("--config", action="config")
    subcommands = parser.add_subcommands(required=True)
    groups = option_groups()
    for name, function in functions.items():
        parameters = inspect.signature(function).parameters
        sub = ArgumentParser(description=summary(function), allow_abbrev=False)
        sub.add_argument("--config", action="config", help="A YAML file of this command's flags (top-level keys).")
        for key, options in groups.items():
            if key in parameters:
                sub.add_class_arguments(options, nested_key=None, skip=SKIPPED.get(name), sub_configs=True)
        sub.add_function_arguments(function, nested_key=None, as_group=False, skip=set(groups), sub_configs=True)
        subcommands.add_subcommand(name, sub, help=summary(function).split(". ")[0].removesuffix(".") + ".")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m eval"):
    """Parse the subcommand and its flags (``--config`` YAML files allowed) and run it; user errors exit with a
    one-line message. Returns what the command returns."""
    from jsonargparse import set_parsing_settings

    from accept_head.core.cli import user_errors

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    functions = commands()
    parser = build_parser(functions, prog)
    with user_errors(prog):
        parsed = parser.parse_args(list(argv) if argv is not None else None)
        name = parsed.subcommand
        kwargs = dict(vars(parser.instantiate(parsed)[name]))
        kwargs.pop("config", None)
        function = functions[name]
        parameters = inspect.signature(function).parameters
        for key, options in option_groups().items():
            if key in parameters:
                kwargs[key] = options(**{f.name: kwargs.pop(f.name) for f in fields(options) if f.name in kwargs})
        return function(**kwargs)


def script() -> None:
    """The ``accept-head-eval`` console script: :func:`main` under that name.

    Returns nothing: a console script exits with its function's return value, and a command's result is not a status.
    """
    main(prog="accept-head-eval")


if __name__ == "__main__":
    main()
