"""Shared fixtures: every test runs offline (pytest puts ``tests/`` on ``sys.path`` for ``tiny_models``), the
train tests share one tiny pair with its labels, and the learning-free decoder tests two tiny targets and their
model bigrams."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

    from accept_head import ModelBigram


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


@pytest.fixture(scope="module")
def targets() -> dict[str, torch.nn.Module]:
    """Two tiny targets for the learning-free decoders (test_learning_free, test_free_stop), built per module:
    ``random`` (``make_llama(seed=0)``) and ``near_bigram`` (the same model through ``near_bigram``, where guesses are
    often right)."""
    from tiny_models import make_llama, near_bigram

    return {"random": make_llama(seed=0), "near_bigram": near_bigram(make_llama(seed=0))}


@pytest.fixture(scope="module")
def bigrams(targets: dict[str, torch.nn.Module]) -> dict[str, ModelBigram]:
    """The model bigram (top 10) of each of :func:`targets`."""
    from accept_head import ModelBigram

    return {name: ModelBigram.build(model, top=10, batch_size=32) for name, model in targets.items()}
