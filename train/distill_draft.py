"""Distill a small draft model from a target's own responses (the recipe behind ``checkpoints/smollm2-135m-draft``).

Resumable stages, each a subcommand::

    python -m train.distill_draft generate   --config configs/distill/smollm2-135m-draft.yaml
    python -m train.distill_draft fit        --config configs/distill/smollm2-135m-draft.yaml
    python -m train.distill_draft evaluate   --config configs/distill/smollm2-135m-draft.yaml
    python -m train.distill_draft model_card --config configs/distill/smollm2-135m-draft.yaml

The stages and the ``cfg:`` keys are :mod:`accept_head.training.distill_recipe`'s.
"""

from __future__ import annotations

from accept_head.core.cli import user_errors
from accept_head.training.distill_recipe import evaluate, fit, generate, model_card


def main() -> None:
    from jsonargparse import CLI

    with user_errors("python -m train.distill_draft"):  # one subcommand per stage, by name
        CLI([generate, fit, evaluate, model_card], as_positional=False, prog="python -m train.distill_draft")


if __name__ == "__main__":
    main()
