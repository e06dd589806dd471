"""``python -m train.feature_draft all``: the target's own responses → features → vocab → fit → evaluate in one
command, on a tiny target on the CPU.

* ``all`` runs every stage and records each in ``all.json``; the exported draft decodes losslessly.
* The training responses come from every configured prompt source (mixed, not the first N of a concatenation) and
  never from a held-out prompt (the ``eval`` hash split or an ``eval_prompts`` prompt).
* A time budget stops ``all`` cleanly between shards; a second ``all`` resumes and ends with response shards
  identical to those of an uninterrupted run with the same seed and split.
* ``responses`` writes T=1 samples and a greedy response per prompt, sorted by prompt length inside a batch; the
  greedy ones are the target's own greedy continuations. A batch the device has no memory for is written in halves.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from time import monotonic
from unittest import mock

import pytest
import torch
import yaml
from tiny_models import make_llama, make_tokenizer
from train_helpers import run_cli, write_prompts

from accept_head import FixedK, autoregressive_generate, load_model, speculative_generate
from accept_head.core.prompts import split_of
from accept_head.training import feature_draft as feature_draft_module
from accept_head.training import feature_draft_recipe as stages
from accept_head.training import own_responses

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

SOURCES = ("alpha", "beta", "gamma")


def tiny_recipe(root: Path, work: str, **overrides) -> Path:
    """A recipe config over a tiny target and three prompt files; the held-out set is the ``eval`` hash split of
    the first file plus four prompts of a fourth one, which is also a training source."""
    if not (root / "target").exists():
        make_llama(root / "target", tokenizer=make_tokenizer(), seed=0)
        for i, name in enumerate((*SOURCES, "extra")):
            write_prompts(root / f"{name}.jsonl", 40, seed=i)
    cfg = {
        "target": {"path": str(root / "target"), "dtype": "float32"},
        "prompts": [{"path": str(root / f"{name}.jsonl"), "name": name} for name in (*SOURCES, "extra")],
        "eval_prompts": [
            {"path": str(root / "alpha.jsonl"), "name": "alpha", "split": "eval"},
            {"path": str(root / "extra.jsonl"), "name": "extra", "limit": 4},
        ],
        "work_dir": str(root / work),
        "output_dir": str(root / work / "draft"),
        "max_prompts": 12,
        "samples_per_prompt": 2,
        "max_new_tokens": 10,
        "generate_batch_size": 8,
        "sort_window": 2,
        "kept_vocab": 40,
        "vocab_sizes": [16, 40],
        "features_batch_tokens": 128,
        "batch_tokens": 256,
        "max_steps": 4,
        "val_every_steps": 2,
        "warmup_steps": 1,
        "eval_starts": 8,
        "eval_steps": 3,
        "timing_rounds": 1,
        "threads": 1,
    } | overrides
    path = root / f"{work}.yaml"
    path.write_text(yaml.safe_dump({"cfg": cfg}))
    return path


def shards(folder: Path, kind: str) -> list[dict]:
    return [torch.load(p, weights_only=True) for p in sorted((folder / "responses" / "shards").glob(f"{kind}-*.pt"))]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """One uninterrupted ``all``."""
    root = tmp_path_factory.mktemp("feature_draft_all")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        run_cli("all", "--config", str(tiny_recipe(root, "straight")))
    return root


def test_all_runs_every_stage_and_exports_a_lossless_draft(straight) -> None:
    record = json.loads((straight / "straight" / "all.json").read_text())
    (run,) = record["runs"]
    assert run["finished"] and list(run["stages"]) == ["responses", "features", "vocab", "fit", "evaluate"]
    assert json.loads((straight / "straight" / "draft" / "all.json").read_text()) == record
    assert run["stages"]["fit"]["result"]["steps"] == 4
    assert [row["step"] for row in run["stages"]["fit"]["result"]["learning_curve"]] == [1.0, 3.0]  # every 2 steps
    assert run["stages"]["responses"]["result"]["tokens"] > 0
    assert len(run["stages"]["evaluate"]["result"]["per_step"]) == 3
    target = load_model({"path": str(straight / "target"), "dtype": "float32"})
    draft = load_model({"path": str(straight / "straight" / "draft")})
    prompt = torch.tensor([[5, 9, 14, 22]])
    expected = autoregressive_generate(target, prompt, 12, temperature=0).sequences
    got = speculative_generate(target, draft, prompt, FixedK(3), 12, temperature=0).sequences
    assert torch.equal(got, expected)


def test_training_responses_mix_every_source_and_no_held_out_prompt(straight) -> None:
    work = straight / "straight"
    trained = [pid for shard in shards(work, "train") for pid in shard["prompt_id"]]
    held_out = {pid for shard in shards(work, "eval") for pid in shard["prompt_id"]}
    split = json.loads((work / "responses" / "split.json").read_text())
    assert set(split["train"]) == set(trained) and set(split["eval"]) == held_out
    # 12 prompts round-robin over four sources: three each (the first 12 of the concatenation would be alpha's).
    assert sorted(pid.split(":")[0] for pid in split["train"]) == sorted(["alpha", "beta", "gamma", "extra"] * 3)
    assert not held_out & set(trained)
    assert all(split_of(pid, 0) != "eval" for pid in trained)
    assert {pid.split(":")[0] for pid in held_out} == {"alpha", "extra"}
    # Fit reads only the features of the training shards; the held-out ones are its validation and evaluation.
    features = sorted(p.stem for p in (work / "features").glob("*.safetensors"))
    assert features == [f"eval-{i:05d}" for i in range(len(shards(work, "eval")))] + [
        f"train-{i:05d}" for i in range(len(shards(work, "train")))
    ]


def test_responses_hold_samples_and_the_targets_greedy_continuation(straight) -> None:
    target = load_model({"path": str(straight / "target"), "dtype": "float32"})
    rows = [
        (pid, p, r, int(s))
        for shard in shards(straight / "straight", "train")
        for pid, p, r, s in zip(shard["prompt_id"], shard["prompt_ids"], shard["response_ids"], shard["sample"])
    ]
    assert len(rows) == 12 * 3
    assert sorted(s for _, _, _, s in rows) == sorted([0, 1, own_responses.GREEDY] * 12)
    for shard in shards(straight / "straight", "train"):
        lengths = [len(p) for p in shard["prompt_ids"]]
        assert lengths == sorted(lengths)
    eos = make_tokenizer().eos_token_id
    for _, prompt, response, sample in rows:
        if sample == own_responses.GREEDY:
            expected = autoregressive_generate(target, prompt[None].long(), 10, temperature=0).sequences
            expected = expected[0, len(prompt) :].tolist()
            expected = expected[: expected.index(eos) + 1] if eos in expected else expected  # ends at its EOS
            assert response.tolist() == expected


def test_all_stops_at_its_time_budget_and_resumes_to_the_same_shards(straight, monkeypatch) -> None:
    """A clock that advances one second per reading and a 7-second budget stop ``all`` inside ``responses``;
    ``all`` with an hour's budget (on the real clock) then finishes. The response shards equal the uninterrupted
    run's (same seed, split)."""
    root = straight
    clock = itertools.count(0.0, 1.0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with monkeypatch.context() as mp:
        mp.setattr(stages, "monotonic", lambda: next(clock))
        mp.setattr(own_responses, "monotonic", lambda: next(clock))
        run_cli("all", "--config", str(tiny_recipe(root, "resumed", time_budget_s=7)))
    work = root / "resumed"
    (first,) = json.loads((work / "all.json").read_text())["runs"]
    assert not first["finished"] and first["stopped_before"] == "features"
    assert first["stages"]["responses"]["result"]["stopped_by_budget"]
    written = len(shards(work, "train"))
    assert 0 < written < len(shards(root / "straight", "train"))
    assert not (work / "features").exists()

    schedules = []  # time_schedule and min_lr_ratio reach fit's cosine (what adamw_cosine is given)
    real_cosine = feature_draft_module.adamw_cosine
    monkeypatch.setattr(
        feature_draft_module,
        "adamw_cosine",
        lambda *a, **k: schedules.append((a[4], k["deadline"])) or real_cosine(*a, **k),
    )
    resumed = tiny_recipe(root, "resumed", time_budget_s=3600, time_schedule=True, min_lr_ratio=0.25)
    began = monotonic()
    run_cli("all", "--config", str(resumed))  # fit under max_time
    ((floor, deadline),) = schedules
    assert floor == 0.25 and began + 3000 < deadline < began + 3600
    runs = json.loads((work / "all.json").read_text())["runs"]
    assert len(runs) == 2 and runs[1]["finished"]
    for kind in ("eval", "train"):
        ours, theirs = shards(work, kind), shards(root / "straight", kind)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert a["prompt_id"] == b["prompt_id"] and torch.equal(a["sample"], b["sample"])
            assert all(torch.equal(x, y) for x, y in zip(a["response_ids"], b["response_ids"]))
    assert json.loads((work / "draft" / "config.json").read_text())["extra"]["steps"] == 4


def test_another_seed_writes_other_samples_and_a_changed_plan_is_refused(straight, tmp_path) -> None:
    other = tiny_recipe(tmp_path, "other", seed=1)
    run_cli("responses", "--config", str(other))
    ours = [r for shard in shards(tmp_path / "other", "train") for r in shard["response_ids"]]
    theirs = [r for shard in shards(straight / "straight", "train") for r in shard["response_ids"]]
    assert any(len(a) != len(b) or not torch.equal(a, b) for a, b in zip(ours, theirs))
    for changed in ({"split_seed": 3}, {"generate_batch_size": 4}):  # either would mix shards of two plans
        with pytest.raises(ValueError, match="split.json"):
            run_cli("responses", "--config", str(tiny_recipe(tmp_path, "other", seed=1, **changed)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_all_on_cuda_with_a_static_cache(tmp_path) -> None:
    """The same recipe with the target on CUDA, generation through a static cache, Lightning on the GPU."""
    config = tiny_recipe(
        tmp_path,
        "cuda",
        target={"path": str(tmp_path / "target"), "dtype": "bfloat16", "device": "cuda"},
        accelerator="gpu",
        static_cache=True,
    )
    run_cli("all", "--config", str(config))
    (run,) = json.loads((tmp_path / "cuda" / "all.json").read_text())["runs"]
    assert run["finished"] and run["stages"]["responses"]["result"]["device"].startswith("cuda")


def test_static_cache_generation_gives_the_dynamic_caches_greedy_responses() -> None:
    """The fixed-shape cache path (what ``compile`` captures on CUDA) writes the same greedy responses as the
    dynamic one, prompts of different lengths in one left-padded batch, with a cache longer than needed."""
    target = make_llama(seed=0)
    prompts = [[1, 5, 6, 7, 8, 9], [1, 10, 11], [1, 12, 13, 14, 15, 16, 17, 18, 19], [1, 20]]
    greedy = torch.ones(len(prompts), dtype=torch.bool)
    settings = {"max_new_tokens": 12, "temperature": 1.0, "eos_token_ids": [3], "pad_token_id": 0}
    dynamic = own_responses.generate_responses(target, prompts, greedy, generator=torch.Generator(), **settings)
    static = own_responses.generate_responses(
        target, prompts, greedy, generator=torch.Generator(), static_cache=True, cache_length=40, **settings
    )
    assert static == dynamic and all(len(r) > 0 for r in dynamic)
    with pytest.raises(ValueError, match="cache_length=16"):
        own_responses.generate_responses(
            target, prompts, greedy, generator=torch.Generator(), static_cache=True, cache_length=16, **settings
        )


def test_a_shard_the_device_cannot_hold_at_once_is_written_in_halves(tmp_path, monkeypatch) -> None:
    """Out of device memory at more than two rows: the shard still holds every row, each the target's own greedy
    response (what one batch writes), in the shard's row order; one row that does not fit is an error."""
    from accept_head.core.prompts import EncodedPrompt

    target = make_llama(seed=0)
    ids = [[1, 5, 6, 7, 8, 9], [1, 10, 11], [1, 12, 13, 14], [1, 20], [1, 21, 22, 23, 24]]
    rows = [own_responses.ResponseRow(EncodedPrompt(f"p{i}", "s", p), own_responses.GREEDY) for i, p in enumerate(ids)]
    settings = {"max_new_tokens": 6, "temperature": 1.0, "eos_token_ids": [3], "pad_token_id": 0}
    whole = own_responses.generate_responses(target, ids, torch.ones(5, dtype=torch.bool), generator=torch.Generator(),
                                             **settings)  # fmt: skip
    real, sizes = own_responses.generate_responses, []

    def small_device(model, prompts, greedy, **kwargs):
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, prompts, greedy, **kwargs)

    monkeypatch.setattr(own_responses, "generate_responses", small_device)
    done = own_responses.write_response_shards(target, [rows], tmp_path, "train", seed=0, split_seed=0, **settings)
    shard = torch.load(tmp_path / "train-00000.pt", weights_only=True)
    assert done["written"] == 1 and sizes == [5, 2, 3, 1, 2]
    assert [r.tolist() for r in shard["response_ids"]] == whole and shard["prompt_id"] == [r.prompt.id for r in rows]

    monkeypatch.setattr(own_responses, "generate_responses", mock.Mock(side_effect=torch.OutOfMemoryError("one row")))
    with pytest.raises(torch.OutOfMemoryError):
        own_responses.write_response_shards(target, [rows[:1]], tmp_path / "one", "train", seed=0, split_seed=0,
                                            **settings)  # fmt: skip
    assert not (tmp_path / "one" / "train-00000.pt").exists()
