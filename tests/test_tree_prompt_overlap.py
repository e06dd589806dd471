"""``python -m train.trees`` refuses check prompts that are training prompts, also when the same file is listed
under another ``name`` (other prompt ids, the same prompts), before decoding anything."""

from __future__ import annotations

import json

import pytest
from tiny_models import tree_bundle

from accept_head.core.prompts import PromptSource
from accept_head.training import tree_recipe

COST = {"t_draft": 0.004, "t_target_a": 0.039, "t_target_b": 0.002}


def test_check_prompts_equal_to_training_prompts_under_another_name_are_refused(tmp_path, monkeypatch) -> None:
    bundle = tree_bundle(tmp_path, COST, {"width": 2, "top_k": 3, "max_depth": 4, "max_nodes": 12})
    prompts = tmp_path / "prompts.jsonl"
    texts = ["write a short poem", "explain python code", "count to ten", "sort this list"]
    prompts.write_text("".join(json.dumps({"instruction": t}) + "\n" for t in texts))

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded before refusing overlapping prompt sets")

    monkeypatch.setattr(tree_recipe, "collect_rounds", no_decoding)
    with pytest.raises(ValueError, match="overlap"):
        tree_recipe.run(
            bundle=str(bundle),
            prompts=[PromptSource(path=str(prompts), limit=2)],
            check_prompts=[PromptSource(path=str(prompts), name="check")],
            output_dir=str(tmp_path / "out"),
            max_new_tokens=4,
            temperatures=[0.0],
            prompt_options=tree_recipe.PromptOptions(prompt_mode="raw"),
        )
