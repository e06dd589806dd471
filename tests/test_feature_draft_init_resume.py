"""``python -m train.feature_draft fit --cfg.init_draft D`` in a work folder that holds another fit's ``last.ckpt``
refuses, instead of resuming that checkpoint and exporting its weights as a continuation of ``D`` that trained no
step; the same fit resumes as before."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from test_feature_draft_all import run_cli, tiny_recipe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def test_fit_refuses_a_checkpoint_of_a_run_from_another_start(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tiny_recipe(tmp_path, "work", max_prompts=4, samples_per_prompt=1, timing_rounds=1)
    run_cli("all", "--config", str(config))
    shutil.copytree(tmp_path / "work" / "draft", tmp_path / "first")
    cfg = yaml.safe_load(config.read_text())["cfg"]
    cfg["max_steps"], cfg["lr"] = 6, cfg.get("lr", 1e-3) / 2
    config.write_text(yaml.safe_dump({"cfg": cfg}))
    with pytest.warns(UserWarning, match="lr=.* is not applied"):  # the checkpoint's optimizer keeps its own rate
        run_cli("fit", "--config", str(config))  # the same start: resumes to the longer schedule
    assert json.loads((tmp_path / "work" / "draft" / "config.json").read_text())["extra"]["steps"] == 6

    cfg |= {"init_draft": str(tmp_path / "first"), "output_dir": str(tmp_path / "next"), "max_steps": 4}
    config.write_text(yaml.safe_dump({"cfg": cfg}))
    with pytest.raises(ValueError, match="init_draft"):
        run_cli("fit", "--config", str(config))
    assert not (tmp_path / "next").exists()

    # Another kept vocabulary beside that checkpoint: named, not a size mismatch deep in Lightning's restore.
    cfg = yaml.safe_load(config.read_text())["cfg"] | {"kept_vocab": 16, "init_draft": None, "max_steps": 8}
    cfg["output_dir"] = str(tmp_path / "work" / "draft")
    config.write_text(yaml.safe_dump({"cfg": cfg}))
    with pytest.raises(ValueError, match="kept_vocab"):
        run_cli("fit", "--config", str(config))
