"""The recipe behind ``checkpoints/smollm2-135m-feature-draft``: a draft that reads the target (EAGLE-style).

Stages, each resumable, all driven by one YAML; ``all`` runs responses → features → vocab → fit → evaluate within
the config's ``time_budget_s``::

    python -m train.feature_draft all      --config configs/distill/smollm2-135m-feature-draft-gpu.yaml
    python -m train.feature_draft responses --config ...  # the target's own responses (T=1 samples + greedy)
    python -m train.feature_draft bench_responses --config ...  # its generators' tok/s beside model.generate
    python -m train.feature_draft progress --config ...  # shards, rows and positions written so far
    python -m train.distill_draft generate --config <distill yaml>  # or: responses written by the standalone recipe
    python -m train.feature_draft text     --config ...   # optional: files (e.g. Python's stdlib) and written
                                                          # answers (written_responses) as teacher-forced text
    python -m train.feature_draft features --config configs/distill/smollm2-135m-feature-draft.yaml
    python -m train.feature_draft vocab    --config ...   # token frequencies; the target's mass covered per V
    python -m train.feature_draft fit      --config ...   # Lightning Trainer; resumes from checkpoints/last.ckpt
        [--cfg.init_draft <draft folder>]                 # or continues an exported draft on new data
    python -m train.feature_draft evaluate --config ...   # per-step acceptance 1..8, cost ratio -> eval.json
    python -m train.feature_draft ablate   --config ...   # short runs with one loss term changed -> ablations.json
    python -m train.feature_draft model_card --config ... # README.md and learning_curve.png of the draft folder

The stages and the ``cfg:`` keys are :mod:`accept_head.training.feature_draft_recipe`'s.
"""

from __future__ import annotations

from accept_head.core.cli import user_errors
from accept_head.training.feature_draft_recipe import (
    ablate,
    bench_responses,
    evaluate,
    features,
    fit,
    model_card,
    progress,
    responses,
    run_all,
    text,
    vocab,
)


def main() -> None:
    from jsonargparse import CLI

    stages = [responses, text, features, vocab, fit, evaluate, model_card, ablate, bench_responses, progress]
    commands = {"all": run_all} | {stage.__name__: stage for stage in stages}  # subcommands by name
    with user_errors("python -m train.feature_draft"):
        CLI(commands, as_positional=False, prog="python -m train.feature_draft")


if __name__ == "__main__":
    main()
