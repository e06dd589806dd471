"""Tree labels, the C2T classifier and the tree-trained head (:mod:`accept_head.training.tree_recipe`)::

python -m train.trees --config configs/trees/smollm2-135m.yaml
"""

from __future__ import annotations

from accept_head.core.cli import user_errors
from accept_head.training.tree_recipe import run


def main() -> None:
    from jsonargparse import CLI

    with user_errors("python -m train.trees"):
        CLI(run, as_positional=False, prog="python -m train.trees")


if __name__ == "__main__":
    main()
