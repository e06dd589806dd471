"""Shared fixtures: every test runs offline (pytest puts ``tests/`` on ``sys.path`` for ``tiny_models``)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the model hub: everything is built in code or read from local files."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
