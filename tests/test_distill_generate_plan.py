"""``python -m train.distill_draft generate`` resumes only the plan its work folder was started with.

* Rerun with another held-out set (or seed, split seed, sampling), it refuses instead of reusing training shards that
  may hold prompts held out now, and leaves ``split.json`` and the shards as they were.
* Raising ``max_prompts`` continues the plan: a short last shard is written again whole, so every training prompt of
  the longer list is in the shards.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_pair
from train_helpers import write_prompts

from accept_head.core.prompts import PromptSource
from accept_head.models.pairs import ModelSpec
from accept_head.training.distill_recipe import DistillConfig, generate

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _ids(work, kind: str) -> list[str]:
    return [pid for path in sorted((work / "shards").glob(f"{kind}-*.pt")) for pid in torch.load(path)["prompt_id"]]


def _config(tmp_path, **overrides) -> DistillConfig:
    target, _ = make_pair(tmp_path)
    a, b = (write_prompts(tmp_path / f"{name}.jsonl", 40, seed=i) for i, name in enumerate("ab"))
    settings = dict(
        target=ModelSpec(path=str(target), dtype="float32"),
        prompts=[PromptSource(path=str(a), name="a")],
        eval_prompts=[PromptSource(path=str(b), name="b", limit=4)],
        work_dir=str(tmp_path / "work"),
        max_new_tokens=2,
        batch_size=4,
        max_prompts=8,
        topk=2,
    )
    return DistillConfig(**(settings | overrides))


def test_generate_refuses_shards_of_another_held_out_set(tmp_path) -> None:
    cfg = _config(tmp_path)
    generate(cfg)
    work = tmp_path / "work"
    split, trained = (work / "split.json").read_text(), _ids(work, "train")
    cfg.eval_prompts = [PromptSource(path=str(tmp_path / "a.jsonl"), name="a", limit=4)]  # now hold out some of a
    with pytest.raises(ValueError, match="records another eval"):
        generate(cfg)
    assert (work / "split.json").read_text() == split and _ids(work, "train") == trained


def test_generate_refuses_shards_of_another_seed(tmp_path) -> None:
    cfg = _config(tmp_path)
    generate(cfg)
    cfg.seed = 1
    with pytest.raises(ValueError, match="records another .*seed"):
        generate(cfg)


def test_raising_max_prompts_fills_the_short_last_shard(tmp_path) -> None:
    cfg = _config(tmp_path, max_prompts=6)
    generate(cfg)
    cfg.max_prompts = 12
    generate(cfg)
    split = json.loads((tmp_path / "work" / "split.json").read_text())
    assert len(split["train"]) == 12 and _ids(tmp_path / "work", "train") == split["train"]
