"""A label-generation run from YAML files and flags: parse them into a :class:`DataGenConfig`, then generate or merge.

``python -m data_gen`` is this module behind a command line; head training calls it directly when its label dataset
does not exist yet (:func:`accept_head.training.data.run_data_gen`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from .config import DataGenConfig

BOOLEAN_FLAGS = ("--merge", "--overwrite", "--progress")
"""Flags that may stand alone on the command line (``--merge`` means ``--merge true``)."""


def build_parser(prog: str = "python -m data_gen"):
    """The argument parser: every :class:`DataGenConfig` field is a top-level flag / YAML key."""
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    # The field docstrings of the config dataclasses are the --help text.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(
        prog=prog,
        description=(
            "Run a target/draft pair on prompt sets and write token-level acceptance labels (SpecDec++ §3.3) as a "
            "Hugging Face dataset with a meta.json. Every key can come from --config YAML files or the command line."
        ),
        default_config_files=None,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file (later flags override it).")
    parser.add_class_arguments(DataGenConfig, nested_key=None, as_group=False, fail_untyped=True)
    for flag in BOOLEAN_FLAGS:  # the value is optional: a flag alone takes ``const``
        action = parser._option_string_actions[flag]
        action.nargs, action.const = "?", True
    return parser


def parse_arguments(parser, argv: Sequence[str] | None):
    """Parse ``argv`` (default ``sys.argv[1:]``) with ``parser``; return the instantiated namespace and its config.

    The config is validated; the namespace also holds any arguments the caller added to the parser.
    """
    namespace = parser.parse_args(sys.argv[1:] if argv is None else argv)
    init = parser.instantiate(namespace)
    cfg = DataGenConfig(**{name: init[name] for name in DataGenConfig.__dataclass_fields__})
    cfg.validate()
    return init, cfg


def parse_config(argv: Sequence[str] | None = None) -> DataGenConfig:
    """Parse command-line arguments (and config files) into a validated :class:`DataGenConfig`."""
    return parse_arguments(build_parser(), argv)[1]


def run(cfg: DataGenConfig) -> dict[str, Any]:
    """Merge shard outputs (``--merge true``) or generate labels; return the dataset's meta dict."""
    from .generate import generate
    from .merge import merge

    return merge(cfg) if cfg.merge else generate(cfg)
