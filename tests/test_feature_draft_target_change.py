"""``python -m train.feature_draft responses`` records which target wrote its pool: rerun in the same work folder with
another target, it refuses (the features, vocabulary and checkpoints there would train a draft for the first one)
instead of reporting the old shards as written; the same target resumes, and a pool written before the fingerprint
was recorded still resumes."""

from __future__ import annotations

import json

import pytest
import yaml
from test_feature_draft_all import run_cli, tiny_recipe
from tiny_models import make_llama, make_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def test_responses_refuse_a_pool_of_another_target(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tiny_recipe(tmp_path, "work", max_prompts=4, samples_per_prompt=1, max_new_tokens=4)
    run_cli("responses", "--config", str(config))
    split_path = tmp_path / "work" / "responses" / "split.json"
    assert "target_fingerprint" in json.loads(split_path.read_text())
    run_cli("responses", "--config", str(config))  # the same target resumes

    legacy = json.loads(split_path.read_text())
    legacy.pop("target_fingerprint")
    split_path.write_text(json.dumps(legacy) + "\n")
    run_cli("responses", "--config", str(config))  # a pool of an earlier version resumes too

    make_llama(tmp_path / "other-target", tokenizer=make_tokenizer(), seed=7)
    cfg = yaml.safe_load(config.read_text())
    cfg["cfg"]["target"]["path"] = str(tmp_path / "other-target")
    config.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="another target"):
        run_cli("responses", "--config", str(config))


def test_responses_refuse_features_left_by_a_deleted_pool(tmp_path, monkeypatch) -> None:
    """Deleting only the responses folder (what a refused rerun used to advise) left the old pool's feature shards,
    which `features` skipped and `fit` trained on; the new pool is refused until they are gone."""
    import shutil

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tiny_recipe(tmp_path, "work", max_prompts=4, samples_per_prompt=1, max_new_tokens=4)
    run_cli("responses", "--config", str(config))
    run_cli("features", "--config", str(config))
    shutil.rmtree(tmp_path / "work" / "responses")
    with pytest.raises(ValueError, match="feature shards"):
        run_cli("responses", "--config", str(tiny_recipe(tmp_path, "work", max_prompts=4, seed=1, max_new_tokens=4)))
    shutil.rmtree(tmp_path / "work" / "features")
    run_cli("responses", "--config", str(config))
