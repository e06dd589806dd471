"""``python -m accept_head chat --bundle <folder>`` (and ``overhead``): see :mod:`accept_head.specdecpp.chat`."""

from .specdecpp.chat import main

if __name__ == "__main__":
    raise SystemExit(main())
