"""The recipe behind ``checkpoints/smollm2-135m-feature-draft``: a draft that reads the target (EAGLE-style).

Stages, each resumable, all driven by one YAML::

    python -m train.distill_draft generate --config <distill yaml>            # the target answers prompts (token ids)
    python -m train.feature_draft text     --config ...   # optional: more text (e.g. Python's stdlib) as sequences
    python -m train.feature_draft features --config configs/distill/smollm2-135m-feature-draft.yaml
    python -m train.feature_draft vocab    --config ...   # token frequencies; the target's mass covered per V
    python -m train.feature_draft fit      --config ...   # Lightning Trainer; resumes from checkpoints/last.ckpt
    python -m train.feature_draft evaluate --config ...   # per-step acceptance 1..8, cost ratio -> eval.json
    python -m train.feature_draft ablate   --config ...   # short runs with one loss term changed -> ablations.json
    python -m train.feature_draft model_card --config ... # README.md and learning_curve.png of the draft folder

The stages and the ``cfg:`` keys are :mod:`accept_head.training.feature_draft_recipe`'s.
"""

from __future__ import annotations

from accept_head.training.feature_draft_recipe import ablate, evaluate, features, fit, model_card, text, vocab


def main() -> None:
    from jsonargparse import CLI

    CLI([text, features, vocab, fit, evaluate, model_card, ablate], as_positional=False)  # subcommands by name


if __name__ == "__main__":
    main()
