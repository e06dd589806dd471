"""Command line of ``python -m eval`` (jsonargparse over the documented functions of the ``eval`` modules).

Examples::

    python -m eval bench --config configs/eval/bench.yaml
    python -m eval report --config configs/eval/report.yaml
    python -m eval ablate --config configs/eval/ablate.yaml
    python -m eval free_stop --config configs/eval/free_stop.yaml
    python -m eval costs --bundle checkpoints/smollm2-135m-specdecpp
    python -m eval sweep --bundle B --prompts '[{path: humaneval, limit: 8}]' --temperatures '[0]'
    python -m eval calibration --bundle B --prompts '[{path: humaneval, limit: 8}]'
    python -m eval bench --help
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def commands() -> dict:
    """Subcommand name → function (imported lazily, so ``--help`` of one does not load the others' dependencies)."""
    from .ablate import ablate
    from .bench import bench
    from .calibration import calibration
    from .costs import costs
    from .free_stop import free_stop
    from .report import report
    from .sweep import sweep

    return {
        "calibration": calibration,
        "costs": costs,
        "sweep": sweep,
        "bench": bench,
        "report": report,
        "ablate": ablate,
        "free_stop": free_stop,
    }


def main(argv: Sequence[str] | None = None, prog: str = "python -m eval"):
    """Parse the subcommand and its flags (``--config`` YAML files allowed) and run it; user errors exit with a
    one-line message."""
    from jsonargparse import CLI, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        return CLI(
            commands(),
            args=list(argv) if argv is not None else None,
            as_positional=False,
            prog=prog,
            description=__doc__.split("\n\n")[0] if __doc__ else None,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err


def script() -> None:
    """The ``accept-head-eval`` console script: :func:`main` under that name.

    Returns nothing: a console script exits with its function's return value, and a command's result is not a status.
    """
    main(prog="accept-head-eval")


if __name__ == "__main__":
    main()
