"""``python -m train fit --config configs/<name>.yaml`` (see :mod:`train.cli`)."""

from .cli import main

if __name__ == "__main__":
    main()
