"""Shared fixtures: every test runs offline (pytest puts ``tests/`` on ``sys.path`` for ``tiny_models``), and the
train tests share one tiny pair with its labels."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the model hub: everything is built in code or read from local files."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def train_setup(tmp_path_factory: pytest.TempPathFactory):
    """The tiny pair of :mod:`train_helpers`, 24 prompts and their data_gen labels, built once for every module that
    trains a head on it (test_train_cli, test_ablate). Read-only: tests write their runs elsewhere."""
    from train_helpers import tiny_setup

    return tiny_setup(tmp_path_factory.mktemp("tiny-train"))
