"""Helpers for the ``python -m train`` tests: a tiny pair, a label dataset written by the real data_gen, configs.

Everything is built offline in a temporary folder: the tiny random Llama pair of :mod:`tiny_models`, a JSONL file of
prompts over its word vocabulary, and labels from ``data_gen`` (the same code path ``prepare_data`` uses).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import yaml
from tiny_models import WORDS, make_llama, make_pair, make_tokenizer

REPO = Path(__file__).resolve().parents[1]


@dataclass
class TinySetup:
    root: Path
    target: Path
    draft: Path
    prompts: Path
    labels: Path

    def data_gen_config(self, **overrides: Any) -> dict[str, Any]:
        """A data_gen config (as a mapping) for the tiny pair; ``output_dir`` is set by the caller."""
        config = {
            "target": {"path": str(self.target), "dtype": "float32"},
            "draft": {"path": str(self.draft), "dtype": "float32"},
            "prompts": [{"path": str(self.prompts)}],
            "max_new_tokens": 16,
            "batch_size": 32,
            "label_mode": "sample",  # token mixing unless a test asks for rollout (the default)
            "seed": 0,
            "progress": False,
        }
        config.update(overrides)
        return config


def write_prompts(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            words = [rng.choice(WORDS[:60]) for _ in range(rng.randint(3, 10))]
            f.write(json.dumps({"instruction": " ".join(words)}) + "\n")
    return path


def run_data_gen(config: dict[str, Any], output_dir: Path) -> Path:
    from accept_head.labelgen.run import parse_config, run

    run(parse_config(["--config", json.dumps({**config, "output_dir": str(output_dir)})]))
    return output_dir


def tiny_setup(root: Path, n_prompts: int = 24) -> TinySetup:
    """The tiny pair, ``n_prompts`` prompts and their labels under ``root``."""
    target, draft = make_pair(root)
    prompts = write_prompts(root / "prompts.jsonl", n_prompts)
    setup = TinySetup(root=root, target=target, draft=draft, prompts=prompts, labels=root / "labels")
    run_data_gen(setup.data_gen_config(), setup.labels)
    return setup


def other_draft(root: Path) -> Path:
    """A second draft (same tokenizer, different weights) for mismatch tests."""
    folder = root / "other-draft"
    if not folder.exists():
        make_llama(folder, tokenizer=make_tokenizer(), seed=5, num_layers=1, hidden_size=16)
    return folder


def train_config(setup: TinySetup, run_dir: Path, *, stages: bool = True, **sections: dict) -> dict[str, Any]:
    """A complete ``python -m train fit`` config for the tiny pair; ``sections`` update top-level sections."""
    config: dict[str, Any] = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 2,
            "log_every_n_steps": 1,
            "enable_model_summary": False,
            "enable_progress_bar": False,
            "default_root_dir": str(run_dir),
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(run_dir), "name": "tiny"},
            },
        },
        "model": {"depth": 1, "w_rej": 3.0, "lr": 0.01},
        "data": {
            "path": str(setup.labels),
            "draft": {"path": str(setup.draft), "dtype": "float32"},
            "val_size": 6,
            "batch_size": 4,
        },
        "calibration": {"enabled": stages},
        "cost_model": {"enabled": stages, "ks": [1, 2, 4], "repeats": 2, "warmup": 1, "context": 16},
        "sweep": {
            "enabled": stages,
            "thresholds": [0.3, 0.7],
            "unscored": [None, "confidence"],
            "fixed_k": [1, 2],
            "prompts": 2,
            "eval_prompts": 2,
            "max_new_tokens": 8,
            "progress": False,
        },
        "export": {"enabled": stages, "dir": str(run_dir / "bundle")},
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def write_config(config: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_cli(*argv: str) -> None:
    """``python -m train.feature_draft`` with ``argv``; a user error it printed as one line is raised again, as the
    ValueError or FileNotFoundError it was, for the test to match."""
    from train import feature_draft

    with mock.patch.object(sys, "argv", ["python -m train.feature_draft", *argv]):
        try:
            feature_draft.main()
        except SystemExit as exit_:
            if isinstance(exit_.__cause__, (ValueError, FileNotFoundError)):
                raise exit_.__cause__ from None
            raise
