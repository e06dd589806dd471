"""``python -m data_gen --config configs/data_gen/<name>.yaml`` (see :mod:`data_gen.cli`)."""

from .cli import main

if __name__ == "__main__":
    main()
