"""Command line of ``python -m data_gen`` (jsonargparse over :class:`data_gen.config.DataGenConfig`).

Examples::

    python -m data_gen --config configs/data_gen/humaneval.yaml
    python -m data_gen --config configs/data_gen/humaneval.yaml --max_new_tokens 128 --target.device cuda:0
    python -m data_gen --target.path T --draft.path D --prompts '[{"path": "p.jsonl", "field": "instruction"}]' \\
        --output_dir out --max_new_tokens 32
    python -m data_gen --config big.yaml --shard 0/4      # ... up to --shard 3/4, one per process / GPU
    python -m data_gen --config big.yaml --merge          # join the four shard outputs
    python -m data_gen --config configs/data_gen/humaneval.yaml --print_config
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .config import DataGenConfig


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
    return parser


BOOLEAN_FLAGS = ("--merge", "--overwrite", "--progress")


def expand_bare_flags(argv: Sequence[str]) -> list[str]:
    """Let boolean flags stand alone: ``--merge`` means ``--merge true`` (jsonargparse wants the value)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        following = argv[i + 1].lower() if i + 1 < len(argv) else None
        if arg in BOOLEAN_FLAGS and following not in ("true", "false", "yes", "no", "1", "0"):
            out.append("true")
    return out


def parse_config(argv: Sequence[str] | None = None) -> DataGenConfig:
    """Parse command-line arguments (and config files) into a validated :class:`DataGenConfig`."""
    parser = build_parser()
    namespace = parser.parse_args(expand_bare_flags(sys.argv[1:] if argv is None else argv))
    init = parser.instantiate(namespace)
    fields = {name: init[name] for name in DataGenConfig.__dataclass_fields__}
    cfg = DataGenConfig(**fields)
    cfg.validate()
    return cfg


def run(cfg: DataGenConfig) -> dict:
    """Merge shard outputs (``--merge true``) or generate labels; return the dataset's meta dict."""
    from .generate import generate
    from .merge import merge

    return merge(cfg) if cfg.merge else generate(cfg)


def main(argv: Sequence[str] | None = None) -> dict:
    """Parse, run (generate or merge) and return the dataset's meta dict; user errors exit with a one-line message."""
    try:
        cfg = parse_config(argv)
        return run(cfg)
    except (ValueError, FileNotFoundError) as err:
        print(f"python -m data_gen: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
