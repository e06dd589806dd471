"""What every command-line entry point does with a user error: one line naming it, exit status 2, no traceback."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def user_errors(prog: str) -> Iterator[None]:
    """Run a command's body; a ``ValueError`` or ``FileNotFoundError`` (a bad value, a missing or mismatched file:
    what the toolkit raises for its users' mistakes, with the fix in the message) exits with ``<prog>: error: ...``
    on stderr and status 2, as argparse's own errors do."""
    try:
        yield
    except (ValueError, FileNotFoundError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
