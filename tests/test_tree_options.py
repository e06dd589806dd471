"""``python -m train.trees`` checks its options before loading anything: one line naming the bad value."""

from __future__ import annotations

import sys
from unittest import mock

import pytest

from accept_head.training.tree_recipe import run
from train import trees


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperatures": [0.7, 1.0]}, r"each mode at most once"),
        ({"temperatures": [0, 0]}, r"each mode at most once"),
        ({"temperatures": []}, r"each mode at most once"),
        ({"temperatures": [-1]}, r"temperature"),
        ({"max_nodes": 0}, r"max_nodes=0"),
        ({"cost_model": "/nonexistent/costs.json"}, r"costs\.json"),
    ],
)
def test_bad_options_are_refused_before_the_bundle_loads(tmp_path, options, message) -> None:
    # The bundle folder does not exist: an option check that came after loading would fail on it instead.
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        run(str(tmp_path / "missing-bundle"), prompts=[], check_prompts=[], **options)


def test_the_command_line_prints_one_line(tmp_path, capsys) -> None:
    argv = ["python -m train.trees", "--bundle", str(tmp_path), "--prompts", "[]", "--check_prompts", "[]"]
    with mock.patch.object(sys, "argv", [*argv, "--max_nodes", "0"]), pytest.raises(SystemExit) as exit_:
        trees.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "python -m train.trees: error: max_nodes=0 must be >= 1 (the largest tree priced offline)."
