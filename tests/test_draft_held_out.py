"""``eval bench`` and ``eval report`` warn about, and bench.json records, test prompts that the draft's own recipe
held out (``extra.recipe.eval_prompts`` in a feature draft's config): its checkpoint was chosen on them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_data_gen import write_prompts
from tiny_models import make_tokenizer

from accept_head.core.prompts import PromptOptions
from accept_head.evaluation.common import draft_held_out


def pair_with_recipe(recipe: dict | None) -> SimpleNamespace:
    extra = {"recipe": recipe} if recipe is not None else {}
    return SimpleNamespace(draft=SimpleNamespace(config=SimpleNamespace(extra=extra)), tokenizer=make_tokenizer())


def test_test_prompts_inside_the_drafts_held_out_set_are_named(tmp_path) -> None:
    source = str(write_prompts(tmp_path / "prompts.jsonl", 200))
    held = {"path": source, "name": "p", "split": "eval", "limit": 3}
    pair = pair_with_recipe({"eval_prompts": [held], "seed": 0, "split_seed": 0})
    options = PromptOptions()
    inside = options.encode("test", [{"path": source, "name": "p", "split": "eval", "limit": 2}], pair.tokenizer)
    with pytest.warns(UserWarning, match="held out and chose its checkpoint"):
        shared = draft_held_out(pair, inside, options)
    assert shared == [p.id for p in inside.prompts] and len(shared) == 2

    past = options.encode("test", [{"path": source, "name": "p", "split": "eval", "offset": 3}], pair.tokenizer)
    assert draft_held_out(pair, past, options) == []  # the prompts past the recipe's limit chose nothing


def test_drafts_without_a_recipe_are_not_checked(tmp_path) -> None:
    source = str(write_prompts(tmp_path / "prompts.jsonl", 10))
    pair = pair_with_recipe(None)
    prompts = PromptOptions().encode("test", [{"path": source}], pair.tokenizer)
    assert draft_held_out(pair, prompts, PromptOptions()) == []
    missing = pair_with_recipe({"eval_prompts": [{"path": str(tmp_path / "gone.jsonl")}]})
    with pytest.warns(UserWarning, match="could not be read"):
        assert draft_held_out(missing, prompts, PromptOptions()) == []
