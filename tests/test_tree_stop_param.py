"""A tree decoder's ``stop`` is a RowStop object handed over from code: a plain value from a config (``ngrammys: [{k:
2, stop: 0.5}]``) is refused by name before any model loads, instead of crashing the bench mid-run (the bench's own
check: tests/test_bench_learning_free.py)."""

from __future__ import annotations

import pytest

from accept_head.engine.free_stop import AdaptiveRowStop
from accept_head.engine.runner import tree_params


@pytest.mark.parametrize("kind", ["ngrammys", "lookahead"])
def test_a_stop_that_is_not_a_row_stop_is_refused(kind) -> None:
    with pytest.raises(ValueError, match=r"stop=0\.5 must be a RowStop object"):
        tree_params(kind, {"stop": 0.5})


def test_a_row_stop_object_is_kept() -> None:
    stop = AdaptiveRowStop.__new__(AdaptiveRowStop)  # any object with start / select / observe
    assert tree_params("ngrammys", {"stop": stop})["stop"] is stop
