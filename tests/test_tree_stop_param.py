"""A tree decoder's ``stop`` is a RowStop object handed over from code: a plain value from a config (``ngrammys: [{k:
2, stop: 0.5}]``) is refused by name before any model loads, instead of crashing the bench mid-run."""

from __future__ import annotations

import pytest
import yaml

from accept_head.engine.free_stop import AdaptiveRowStop
from accept_head.engine.runner import tree_params
from eval.__main__ import main


@pytest.mark.parametrize("kind", ["ngrammys", "lookahead"])
def test_a_stop_that_is_not_a_row_stop_is_refused(kind) -> None:
    with pytest.raises(ValueError, match=r"stop=0\.5 must be a RowStop object"):
        tree_params(kind, {"stop": 0.5})


def test_a_row_stop_object_is_kept() -> None:
    stop = AdaptiveRowStop.__new__(AdaptiveRowStop)  # any object with start / select / observe
    assert tree_params("ngrammys", {"stop": stop})["stop"] is stop


def test_the_bench_refuses_it_before_loading_any_model(tmp_path, capsys) -> None:
    config = {
        "bundle": str(tmp_path / "no-such-bundle"),
        "prompts": [{"path": "humaneval"}],
        "validation_prompts": [{"path": "humaneval"}],
        "ngrammys": [{"k": 2, "stop": 0.5}],
        "output_dir": str(tmp_path / "bench"),
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--config", str(path)])
    assert exit_info.value.code == 2
    assert "ngrammys[0]: ngrammys parameter stop=0.5 must be a RowStop object" in capsys.readouterr().err
