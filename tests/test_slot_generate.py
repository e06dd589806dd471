"""Continuous batching over a slot KV cache (:mod:`accept_head.models.slot_generate`), on tiny random float32 Llamas:

* greedy rows equal ``model.generate``'s greedy rows, through refills and the tail's compaction, and two controls
  that mix rows' caches (compaction that leaves the buffers behind; a mask that lets a refilled row see its slot's
  previous occupant) break that equality;
* T=1 samples follow the target's exact distribution of the first two tokens (χ²), and a broken sampler fails — also
  through the two-level sampler of the compiled steps, whose draws are the inverse CDF at the uniform across blocks;
* the same seed gives the same responses, another seed others;
* the hidden states and log-normalisers kept while writing equal a teacher-forced pass over the same tokens and change
  no response; a model whose logits are not its LM head over its decoder is refused;
* the recipe's ``responses`` stage with ``slots`` stopped by its time budget, or killed halfway through saving a
  shard, resumes to the same shards and features.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from stats_helpers import ALPHA, exact_joint, goodness_of_fit
from tiny_models import make_llama, make_tokenizer, small_vocab_llama
from train_helpers import run_cli, write_prompts

from accept_head.models import slot_generate as slots_module
from accept_head.models.slot_generate import sample_rows, sample_rows_blocked, slot_generate
from accept_head.training import feature_draft_recipe as stages
from accept_head.training import own_responses
from accept_head.training.draft_recipe import save_atomic

EOS = 3
LENGTHS = (3, 9, 5, 12, 4, 7, 2, 10, 6, 5, 8)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return make_llama(seed=0)


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(4, target.config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]


def reference(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """``model.generate``'s greedy response, through its first EOS."""
    ids = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0
    )[0, len(prompt) :].tolist()
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


def greedy_run(model, prompts, slots: int, new_tokens: int = 14) -> list[list[int]]:
    return slot_generate(
        model, prompts, [True] * len(prompts), max_new_tokens=new_tokens, temperature=1.0, eos_token_ids=[EOS],
        pad_token_id=0, generator=torch.Generator().manual_seed(0), slots=slots,
    )  # fmt: skip


@pytest.mark.parametrize("slots", [1, 3, 4, 16])
def test_greedy_rows_equal_generates_through_refills_and_compaction(target, prompts, slots) -> None:
    assert greedy_run(target, prompts, slots) == [reference(target, p, 14) for p in prompts]


def test_grouped_eager_attention_gives_the_same_greedy_rows(prompts) -> None:
    """The recipe's CPU config decodes with ``gqa_eager`` (grouped eager attention over the slots' additive mask)."""
    from accept_head.core.hf_compat import register_gqa_eager

    model = make_llama(seed=0)
    model.set_attn_implementation(register_gqa_eager())
    assert model.config._attn_implementation == register_gqa_eager()
    assert greedy_run(model, prompts, 4) == [reference(make_llama(seed=0), p, 14) for p in prompts]


def test_compiled_decode_steps_give_the_same_greedy_rows(target, prompts, monkeypatch) -> None:
    """``compile=True`` runs every full-width decode step through ``torch.compile`` (inductor, frozen weights) over
    the whole buffer — only the tail's narrower steps decode eagerly — and the greedy rows stay ``generate``'s."""
    calls, steps = [], []
    compiled = slots_module.compiled_forward(target)
    decode_step = slots_module._decode_step

    def counted(model):
        assert model is target
        return lambda **kwargs: calls.append(kwargs["attention_mask"].shape[-1]) or compiled(**kwargs)

    def recorded(forward, cache, *args):
        steps.append((cache.slots, args[-1]))  # (width, use_fast)
        return decode_step(forward, cache, *args)

    monkeypatch.setattr(slots_module, "compiled_forward", counted)
    monkeypatch.setattr(slots_module, "_decode_step", recorded)
    out = slot_generate(
        target, prompts, [True] * len(prompts), max_new_tokens=14, temperature=1.0, eos_token_ids=[EOS],
        pad_token_id=0, generator=torch.Generator().manual_seed(0), slots=4, compile=True,
    )  # fmt: skip
    assert out == [reference(target, p, 14) for p in prompts]
    full_width = [fast for width, fast in steps if width == 4]
    assert len(full_width) >= 10 and all(full_width) and len(calls) == len(full_width)
    assert set(calls) == {slots_module.LENGTH_STEP}  # each compiled step attends over the whole (64-position) buffer
    assert not any(fast for width, fast in steps if width < 4)


def test_the_compiled_forward_is_built_anew_once_the_weights_change() -> None:
    """Frozen weights are constants of the compiled graph: after an in-place update (what an optimizer step does) or
    a loaded state dict, :func:`compiled_forward` must not hand back the graph built on the old weights."""
    model = make_llama(seed=4)
    first = slots_module.compiled_forward(model)
    assert slots_module.compiled_forward(model) is first  # unchanged weights: the same compiled forward
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    second = slots_module.compiled_forward(model)
    assert second is not first
    model.load_state_dict(make_llama(seed=5).state_dict())
    assert slots_module.compiled_forward(model) is not second


def test_greedy_rows_mixed_with_sampled_ones_keep_their_argmax(target, prompts) -> None:
    greedy = [i % 2 == 0 for i in range(len(prompts))]
    out = slot_generate(
        target, prompts, greedy, max_new_tokens=10, temperature=1.0, eos_token_ids=[EOS], pad_token_id=0,
        generator=torch.Generator().manual_seed(3), slots=4,
    )  # fmt: skip
    for p, o, g in zip(prompts, out, greedy):
        assert (o == reference(target, p, 10)) or not g
        assert 1 <= len(o) <= 10


def test_rows_sharing_a_prompt_share_its_prefill_and_keep_generates_greedy_rows(target, prompts, monkeypatch) -> None:
    """A prompt taken by several rows of one refill is prefilled once (the batch holds each prompt once) and its keys
    and values copied to the other rows' slots; every row still decodes ``generate``'s greedy response. The control:
    a copy that leaves the slots as they were (the twin attends over nothing it was fed) changes them."""
    twice = [p for p in prompts for _ in range(2)] + [prompts[0]]
    prefilled, copied = [], []
    feed, copy = slots_module.SlotCache.feed, slots_module.SlotCache.copy_slots

    def recorded_feed(self, rows, positions, span):
        if positions.shape[1] > 1:  # a refill (every prompt here has two tokens or more; a decode step feeds one)
            prefilled.append(len(rows))
        return feed(self, rows, positions, span)

    monkeypatch.setattr(slots_module.SlotCache, "feed", recorded_feed)
    monkeypatch.setattr(
        slots_module.SlotCache, "copy_slots", lambda self, *a: copied.append(len(a[0])) or copy(self, *a)
    )
    expected = [reference(target, p, 14) for p in twice]
    assert greedy_run(target, twice, 8) == expected
    assert sum(prefilled) + sum(copied) == len(twice) and sum(copied) >= len(prompts) - 2  # a pair may straddle refills
    assert prefilled[0] == len(set(map(tuple, twice[:8])))  # the first refill's batch: its distinct prompts only
    assert slots_module.first_of_each_prompt([[1, 2], [3], [1, 2], [3], [4]]) == [0, 1, 0, 1, 4]
    monkeypatch.setattr(slots_module.SlotCache, "copy_slots", lambda self, *a: None)
    assert greedy_run(target, twice, 8) != expected


def test_compaction_that_keeps_the_wrong_buffers_mixes_rows(target, prompts, monkeypatch) -> None:
    """Control: were the tail's compaction to keep the first slots' keys and values instead of the live rows', rows
    would read each other's caches, and the greedy equality above catches it."""

    def first_slots(self, slots: torch.Tensor) -> None:
        self.keys, self.values = self.keys[: len(slots)], self.values[: len(slots)]

    monkeypatch.setattr(slots_module.SlotLayer, "keep", first_slots)
    assert greedy_run(target, prompts, 4) != [reference(target, p, 14) for p in prompts]


def test_a_mask_that_shows_a_slots_previous_occupant_mixes_rows(target, prompts, monkeypatch) -> None:
    """Control: a refilled slot still holds its previous row's keys past the new prompt; a mask that let the new
    row see every written position of its slot (not just its own) changes its greedy output."""

    def leaky(positions, span, dtype):
        return torch.zeros((positions.shape[0], 1, positions.shape[1], span), dtype=dtype)

    monkeypatch.setattr(slots_module, "attention_bias", leaky)
    assert greedy_run(target, prompts, 2) != [reference(target, p, 14) for p in prompts]


def test_samples_follow_the_targets_exact_distribution_and_a_broken_sampler_fails(monkeypatch) -> None:
    """3,000 rows of one prompt, their first two tokens at T=1, against the target's exact joint (a vocabulary of
    8: 64 cells); the control draws its uniforms squared."""
    model, prompt, rows = small_vocab_llama(seed=2), [1, 5, 2], 3000
    exact = exact_joint(model, prompt, 2)

    def pair_counts() -> torch.Tensor:
        out = slot_generate(
            model, [prompt] * rows, [False] * rows, max_new_tokens=2, temperature=1.0, eos_token_ids=[],
            pad_token_id=0, generator=torch.Generator().manual_seed(11), slots=64,
        )  # fmt: skip
        counts = torch.zeros(8, 8)
        for a, b in out:
            counts[a, b] += 1
        return counts

    assert goodness_of_fit(pair_counts(), exact) > ALPHA
    real = slots_module.sample_rows
    monkeypatch.setattr(slots_module, "sample_rows", lambda lo, t, g, u: real(lo, t, g, u**2))
    assert goodness_of_fit(pair_counts(), exact) < ALPHA


def test_sample_rows_takes_the_inverse_cdf_at_the_uniform() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    cuts = {0.05: 0, 0.15: 1, 0.29: 1, 0.31: 2, 0.61: 3, 0.999: 3}
    for u, token in cuts.items():
        assert int(sample_rows(logits, 1.0, torch.tensor([False]), torch.tensor([u]))) == token
    assert int(sample_rows(logits, 1.0, torch.tensor([True]), torch.tensor([0.05]))) == 3


@pytest.mark.parametrize("block", [1, 2, 3, 8])
def test_the_blocked_sampler_takes_the_inverse_cdf_at_the_uniform_across_blocks(block) -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    cuts = {0.0: 0, 0.05: 0, 0.15: 1, 0.29: 1, 0.31: 2, 0.61: 3, 0.999: 3, 1 - 1e-9: 3}
    for u, token in cuts.items():
        drawn = sample_rows_blocked(logits, 1.0, torch.tensor([False]), torch.tensor([u]), block=block)
        assert int(drawn) == token, (u, block)
    hot = sample_rows_blocked(logits * 0.05, 0.05, torch.tensor([False]), torch.tensor([0.35]), block=block)
    assert int(hot) == 2  # the temperature divides the logits back
    assert int(sample_rows_blocked(logits, 1.0, torch.tensor([True]), torch.tensor([0.05]), block=block)) == 3


def test_the_blocked_sampler_never_draws_a_token_of_zero_weight() -> None:
    """Tokens at −inf (and a whole block of them) are never drawn, whatever the uniform, down to the last ulp."""
    inf = float("-inf")
    logits = torch.tensor([[inf, 0.0, inf, inf, inf, inf, -1.0, inf, inf]])
    uniforms = torch.tensor(
        [0.0, 0.3, 0.7310585, 0.7310586, 0.9, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))]
    )
    drawn = sample_rows_blocked(logits.expand(6, -1), 1.0, torch.zeros(6, dtype=torch.bool), uniforms, block=2)
    assert set(drawn.tolist()) == {1, 6}


def test_the_blocked_samplers_draws_follow_the_exact_probabilities_and_a_broken_one_fails() -> None:
    """30,000 draws over a vocabulary of 11 in blocks of 3 (the last one padded), at T = 1 and T = 0.7, against the
    exact softmax (χ²); the control draws its uniforms squared."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 11, generator=gen) * 1.5
    for temperature in (1.0, 0.7):
        uniforms = torch.rand(30000, generator=gen)
        rows, greedy = logits.expand(30000, -1), torch.zeros(30000, dtype=torch.bool)
        exact = torch.softmax(logits[0].double() / temperature, -1)
        counts = torch.bincount(sample_rows_blocked(rows, temperature, greedy, uniforms, block=3), minlength=11)
        assert goodness_of_fit(counts, exact) > ALPHA
        broken = torch.bincount(sample_rows_blocked(rows, temperature, greedy, uniforms**2, block=3), minlength=11)
        assert goodness_of_fit(broken, exact) < ALPHA


def test_compiled_steps_sample_through_the_blocked_sampler_from_the_targets_distribution(monkeypatch) -> None:
    """``compile=True`` draws the full-width steps' tokens with the two-level sampler (here uncompiled stand-ins for
    the compiled forward and sampler, blocks of 3 over a vocabulary of 8): the first two tokens of 3,000 rows follow
    the target's exact joint (χ²)."""
    import functools

    used = []
    monkeypatch.setattr(slots_module, "compiled_forward", lambda module: module)
    blocked = functools.partial(sample_rows_blocked, block=3)
    monkeypatch.setattr(slots_module, "compiled_sampler", lambda: used.append(1) or blocked)
    model, prompt, rows = small_vocab_llama(seed=2), [1, 5, 2], 3000
    out = slot_generate(
        model, [prompt] * rows, [False] * rows, max_new_tokens=2, temperature=1.0, eos_token_ids=[],
        pad_token_id=0, generator=torch.Generator().manual_seed(11), slots=64, compile=True,
    )  # fmt: skip
    counts = torch.zeros(8, 8)
    for a, b in out:
        counts[a, b] += 1
    assert len(used) >= rows // 64 and goodness_of_fit(counts, exact_joint(model, prompt, 2)) > ALPHA


def test_the_same_seed_gives_the_same_responses_and_another_seed_others(target, prompts) -> None:
    def run(seed: int) -> list[list[int]]:
        return slot_generate(
            target, prompts, [False] * len(prompts), max_new_tokens=10, temperature=1.0, eos_token_ids=[EOS],
            pad_token_id=0, generator=torch.Generator().manual_seed(seed), slots=4,
        )  # fmt: skip

    assert run(5) == run(5) and run(5) != run(6)


@pytest.mark.parametrize("twins", [False, True])
def test_features_kept_while_writing_equal_a_teacher_forced_pass_and_change_no_response(target, prompts, twins) -> None:
    """(``twins``: every prompt twice in a row, as a recipe's sampled and greedy rows of one prompt come: the second
    shares the first's prefill, and both keep the prompt's states.)"""
    from accept_head.models.features import final_hidden_states

    if twins:
        prompts = [p for p in prompts for _ in range(2)]
    greedy = [i % 3 == 0 for i in range(len(prompts))]
    settings = dict(max_new_tokens=10, temperature=1.0, eos_token_ids=[EOS], pad_token_id=0, slots=4)
    plain = slot_generate(target, prompts, greedy, generator=torch.Generator().manual_seed(4), **settings)
    out, kept = slot_generate(
        target, prompts, greedy, generator=torch.Generator().manual_seed(4), features=True, **settings
    )  # fmt: skip
    assert out == plain
    lm_head = target.get_output_embeddings()
    for prompt, response, (hidden, lse) in zip(prompts, out, kept):
        forced = final_hidden_states(target, torch.tensor([prompt + response[:-1]]))[0]
        assert hidden.shape == forced.shape == (len(prompt) + len(response) - 1, target.config.hidden_size)
        torch.testing.assert_close(hidden, forced, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse, lm_head(forced).logsumexp(-1), atol=1e-4, rtol=1e-4)


def test_features_with_compile_run_the_decoders_whole_buffer_steps_through_the_fast_path(target, prompts, monkeypatch):
    """``compile=True`` with features routes the full-width steps through the compiled decoder-and-LM-head module
    (here a recording stand-in, so the test pays no compilation): the same responses and states as eager."""
    seen = []
    monkeypatch.setattr(
        slots_module, "compiled_forward", lambda module: lambda **kw: seen.append(module) or module(**kw)
    )
    settings = dict(max_new_tokens=14, temperature=1.0, eos_token_ids=[EOS], pad_token_id=0, slots=4, features=True)
    greedy = [True] * len(prompts)
    eager = slot_generate(target, prompts, greedy, generator=torch.Generator().manual_seed(0), **settings)
    fast = slot_generate(target, prompts, greedy, generator=torch.Generator().manual_seed(0), compile=True, **settings)
    assert len(seen) >= 10 and all(isinstance(module, slots_module.DecoderWithHead) for module in seen)
    assert seen[0].decoder is target.get_decoder() and seen[0].head is target.get_output_embeddings()
    assert fast[0] == eager[0] == [reference(target, p, 14) for p in prompts]
    for (a, a_lse), (b, b_lse) in zip(fast[1], eager[1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a_lse, b_lse, atol=1e-4, rtol=1e-4)


def soft_capped_gemma2(cap: float | None = 5.0) -> torch.nn.Module:
    """A tiny random Gemma2, whose logits are soft-capped after its LM head (unless ``cap`` is None)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=cap,
    )  # fmt: skip
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).eval()


def test_logits_after_the_lm_head_are_told_apart() -> None:
    from accept_head.models.features import lm_head_gives_logits, logits_from_decoder

    assert not lm_head_gives_logits(soft_capped_gemma2()) and not logits_from_decoder(soft_capped_gemma2())
    assert lm_head_gives_logits(soft_capped_gemma2(None)) and logits_from_decoder(soft_capped_gemma2(None))
    assert lm_head_gives_logits(make_llama(seed=0)) and logits_from_decoder(make_llama(seed=0))


def test_features_are_refused_for_logits_that_are_not_the_lm_head_over_the_decoder() -> None:
    with pytest.raises(ValueError, match="Gemma2ForCausalLM's logits to be its LM head"):
        slot_generate(
            soft_capped_gemma2(), [[5, 6, 7]], [True], max_new_tokens=4, temperature=1.0, eos_token_ids=[EOS],
            pad_token_id=0, generator=torch.Generator(), features=True,
        )  # fmt: skip


def test_the_features_stage_refuses_a_soft_capped_target(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = str(responses_config(tmp_path, "capped", max_prompts=2, response_features=False))
    run_cli("responses", "--config", config)
    monkeypatch.setattr(stages, "load_model", lambda spec: soft_capped_gemma2())
    with pytest.raises(ValueError, match="Gemma2ForCausalLM's logits are not its LM head"):
        run_cli("features", "--config", config)
    assert not list((tmp_path / "capped" / "features").glob("*.safetensors"))


def test_bad_settings_are_refused_naming_the_value(target, prompts) -> None:
    settings = dict(max_new_tokens=4, eos_token_ids=[EOS], pad_token_id=0, generator=torch.Generator())
    with pytest.raises(ValueError, match="temperature=0"):
        slot_generate(target, prompts, [True] * len(prompts), temperature=0, **settings)
    with pytest.raises(ValueError, match=r"got 0, 0.125, 4"):
        slot_generate(target, prompts, [True] * len(prompts), temperature=1.0, slots=0, **settings)
    with pytest.raises(ValueError, match="one `greedy` flag per prompt"):
        slot_generate(target, prompts, [True], temperature=1.0, **settings)


def responses_config(root: Path, work: str, **overrides) -> Path:
    if not (root / "target").exists():
        make_llama(root / "target", tokenizer=make_tokenizer(), seed=0)
        for i, name in enumerate(("alpha", "beta")):
            write_prompts(root / f"{name}.jsonl", 30, seed=i)
    cfg = {
        "target": {"path": str(root / "target"), "dtype": "float32"},
        "prompts": [{"path": str(root / f"{name}.jsonl"), "name": name} for name in ("alpha", "beta")],
        "eval_prompts": [{"path": str(root / "alpha.jsonl"), "name": "alpha", "split": "eval"}],
        "work_dir": str(root / work),
        "max_prompts": 10,
        "samples_per_prompt": 2,
        "max_new_tokens": 8,
        "generate_batch_size": 6,
        "sort_window": 2,
        "slots": 4,
        "threads": 1,
    } | overrides
    path = root / f"{work}.yaml"
    path.write_text(yaml.safe_dump({"cfg": cfg}))
    return path


def test_the_responses_stage_with_slots_resumes_to_the_same_shards(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_cli("responses", "--config", str(responses_config(tmp_path, "straight")))
    clock = itertools.count(0.0, 1.0)
    with monkeypatch.context() as mp:
        mp.setattr(stages, "monotonic", lambda: next(clock))
        mp.setattr(own_responses, "monotonic", lambda: next(clock))
        run_cli("responses", "--config", str(responses_config(tmp_path, "resumed", responses_budget_s=4)))
    folder = tmp_path / "resumed" / "responses"
    assert json.loads((folder / "meta.json").read_text())["stopped_by_budget"]
    assert json.loads((folder / "split.json").read_text())["slots"] == 4
    run_cli("responses", "--config", str(responses_config(tmp_path, "resumed")))
    for kind in ("eval", "train"):
        ours = sorted((folder / "shards").glob(f"{kind}-*.pt"))
        theirs = sorted((tmp_path / "straight" / "responses" / "shards").glob(f"{kind}-*.pt"))
        assert [p.name for p in ours] == [p.name for p in theirs] and ours
        for a, b in zip(ours, theirs):
            a, b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
            assert a["prompt_id"] == b["prompt_id"] and torch.equal(a["sample"], b["sample"])
            assert all(torch.equal(x, y) for x, y in zip(a["response_ids"], b["response_ids"]))
    present = stages.progress(
        stages.FeatureDraftRecipe(**yaml.safe_load(responses_config(tmp_path, "resumed").read_text())["cfg"])
    )
    meta = json.loads((folder / "meta.json").read_text())
    assert present == meta["present"] and present["train"]["rows"] == 10 * 3  # 10 prompts x (2 samples + greedy)
    assert present["train"]["positions"] == present["train"]["prompt"] + present["train"]["response"] > 0
    with pytest.raises(ValueError, match="split.json"):  # slots draw other samples than one batch per shard
        run_cli("responses", "--config", str(responses_config(tmp_path, "resumed", slots=None)))


class Killed(BaseException):
    """A kill: no ``except Exception`` on the way up catches it."""


def killed_saving(name: str):
    """``save_atomic`` killed halfway through saving the file ``name``: half its bytes written, then the kill."""

    def killed(obj, path: Path, save=torch.save) -> None:
        def half_then_killed(obj, tmp: str) -> None:
            save(obj, tmp)
            data = Path(tmp).read_bytes()
            Path(tmp).write_bytes(data[: len(data) // 2])
            raise Killed

        save_atomic(obj, path, half_then_killed if path.name == name else save)

    return killed


def test_the_responses_stage_killed_mid_shard_resumes_to_the_same_shards(tmp_path, monkeypatch) -> None:
    """Killed while saving a response shard whose features are already written, then while saving a features shard,
    each time leaving half a file behind, the stage resumes to the response and features shards of a run never
    killed, tensor for tensor; no half-written file is taken for a shard."""
    from safetensors.torch import load_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_cli("responses", "--config", str(responses_config(tmp_path, "straight", max_prompts=6)))
    config = str(responses_config(tmp_path, "killed", max_prompts=6))
    shards, features = tmp_path / "killed" / "responses" / "shards", tmp_path / "killed" / "features"
    for name, folder in (("train-00001.pt", shards), ("train-00002.safetensors", features)):
        with monkeypatch.context() as mp:
            mp.setattr(own_responses, "save_atomic", killed_saving(name))
            with pytest.raises(Killed):
                run_cli("responses", "--config", config)
        stem = name.split(".")[0]
        assert (folder / f"{name}.tmp").exists() and not (shards / f"{stem}.pt").exists()
        assert (features / f"{stem}.safetensors").exists() == (folder == shards)  # features come before their shard
    run_cli("responses", "--config", config)
    straight = tmp_path / "straight"
    for folder in (shards, features):  # every file, no temporary left
        names = sorted(p.name for p in folder.iterdir())
        assert names == sorted(p.name for p in (straight / folder.relative_to(tmp_path / "killed")).iterdir())
        assert any(n.startswith("train-00002.") for n in names)
    for path in shards.iterdir():
        a, b = (torch.load(p, weights_only=True) for p in (path, straight / "responses" / "shards" / path.name))
        assert a["prompt_id"] == b["prompt_id"] and torch.equal(a["sample"], b["sample"])
        assert all(torch.equal(x, y) for x, y in zip(a["response_ids"], b["response_ids"], strict=True))
    for path in features.iterdir():
        a, b = load_file(path), load_file(straight / "features" / path.name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_progress_on_a_machine_without_shards_says_so(tmp_path, capsys) -> None:
    config = yaml.safe_load(responses_config(tmp_path, "empty").read_text())["cfg"]
    assert stages.progress(stages.FeatureDraftRecipe(**config)) == {}
    out = capsys.readouterr().out
    assert "no response shards under" in out and str(tmp_path / "empty") in out and "0 positions" in out


def test_the_responses_stage_writes_the_features_a_teacher_forced_stage_would(tmp_path, monkeypatch) -> None:
    """With ``slots`` each shard's features come with it, and ``features`` then has nothing to do; they equal that
    stage's teacher-forced pass over the same shards, less each row's last position."""
    from safetensors.torch import load_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = str(responses_config(tmp_path, "kept", max_prompts=6))
    run_cli("responses", "--config", config)
    kept = tmp_path / "kept" / "features"
    names = sorted(p.stem for p in (tmp_path / "kept" / "responses" / "shards").glob("*.pt"))
    assert sorted(p.stem for p in kept.glob("*.safetensors")) == names and names
    mtimes = {p.name: p.stat().st_mtime_ns for p in kept.glob("*.safetensors")}
    run_cli("features", "--config", config)
    assert {p.name: p.stat().st_mtime_ns for p in kept.glob("*.safetensors")} == mtimes  # nothing left to do
    kept.rename(tmp_path / "kept" / "written")
    run_cli("features", "--config", config)  # now teacher-forced, from the same response shards
    for name in names:
        ours = load_file(tmp_path / "kept" / "written" / f"{name}.safetensors")
        forced = load_file(kept / f"{name}.safetensors")
        rows: dict[tuple, list] = {}  # the teacher-forced rows by their tokens, less each row's last position
        for a, b in itertools.pairwise(forced["offsets"].tolist()):
            key = tuple(forced["tokens"][a : b - 1].tolist())
            rows.setdefault(key, []).append((forced["features"][a : b - 1], forced["lse"][a : b - 1]))
        assert len(ours["offsets"]) == len(forced["offsets"]) and ours["prompt_lengths"].min() > 0
        for a, b in itertools.pairwise(ours["offsets"].tolist()):
            features, lse = rows[tuple(ours["tokens"][a:b].tolist())].pop()
            torch.testing.assert_close(ours["features"][a:b].float(), features.float(), atol=0.02, rtol=0.02)
            torch.testing.assert_close(ours["lse"][a:b], lse, atol=1e-3, rtol=1e-3)


def test_data_gen_responses_writes_the_shards_as_a_hugging_face_dataset(tmp_path, monkeypatch, capsys) -> None:
    from datasets import load_from_disk

    from data_gen.cli import main as data_gen

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = str(responses_config(tmp_path, "hf", max_prompts=6))
    data_gen(["responses", "--config", config, "--output_dir", str(tmp_path / "out")])
    dataset = load_from_disk(str(tmp_path / "out"))
    assert set(dataset) == {"train", "eval"}
    for kind, split in dataset.items():
        rows = []
        for path in sorted((tmp_path / "hf" / "responses" / "shards").glob(f"{kind}-*.pt")):
            shard = torch.load(path, weights_only=True)
            rows += list(zip(shard["prompt_id"], shard["response_ids"], shard["sample"].tolist()))
        assert len(split) == len(rows) > 0
        for row, (prompt_id, response, sample) in zip(split, rows):
            assert (row["prompt_id"], row["response_ids"], row["sample"]) == (prompt_id, response.tolist(), sample)
            assert row["source"] == prompt_id.rsplit(":", 1)[0] in {"alpha", "beta"}
    assert len(dataset["train"]) == 6 * 3  # 6 prompts x (2 samples + greedy)
    with pytest.raises(SystemExit):  # nothing written there and told not to generate: a one-line error
        data_gen(["responses", "--config", config, "--cfg.work_dir", str(tmp_path / "empty"), "--generate", "false"])
    assert "No response shards under" in capsys.readouterr().err


def response_shards(root: Path, work: str, **overrides) -> dict[str, Path]:
    """Run the responses stage over 6 prompts into ``root/work``; its shard files by name."""
    run_cli("responses", "--config", str(responses_config(root, work, max_prompts=6, **overrides)))
    return {p.name: p for p in sorted((root / work / "responses" / "shards").glob("*.pt"))}


def test_first_train_shard_writes_the_later_shards_with_the_same_rows_and_draws(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    every, later = response_shards(tmp_path, "all"), response_shards(tmp_path, "later", first_train_shard=2)
    assert sorted(later) == sorted(n for n in every if n.startswith("eval-") or n >= "train-00002.pt")
    assert any(n.startswith("train-") for n in later) and "train-00001.pt" in every
    for name, path in later.items():
        a, b = torch.load(path, weights_only=True), torch.load(every[name], weights_only=True)
        assert a["prompt_id"] == b["prompt_id"] and torch.equal(a["sample"], b["sample"])
        assert all(torch.equal(x, y) for x, y in zip(a["response_ids"], b["response_ids"]))
    for work, first in (("all", 0), ("later", 2)):  # progress counts the rows this run plans: all written
        capsys.readouterr()
        run_cli("progress", "--config", str(responses_config(tmp_path, work, first_train_shard=first)))
        written, planned = re.search(r"train: \d+ shards, (\d+)/(\d+) rows", capsys.readouterr().out).groups()
        assert written == planned
    with pytest.raises(ValueError, match="first_train_shard=-1"):
        run_cli("responses", "--config", str(responses_config(tmp_path, "bad", first_train_shard=-1)))


def test_a_response_seed_draws_fresh_training_samples_and_keeps_the_held_out_shards(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first, fresh = response_shards(tmp_path, "first"), response_shards(tmp_path, "fresh", response_seed=7)
    assert sorted(first) == sorted(fresh) and any(n.startswith("train-") for n in fresh)
    sampled_differ = 0
    for name in fresh:
        a, b = torch.load(fresh[name], weights_only=True), torch.load(first[name], weights_only=True)
        assert a["prompt_id"] == b["prompt_id"] and torch.equal(a["sample"], b["sample"])  # the same rows
        for sample, x, y in zip(a["sample"].tolist(), a["response_ids"], b["response_ids"]):
            if name.startswith("eval-") or sample < 0:  # held out, or a greedy row: what `seed` wrote
                assert torch.equal(x, y), (name, sample)
            else:
                sampled_differ += not torch.equal(x, y)
    assert sampled_differ > 0  # fresh draws for the training samples
    split = json.loads((tmp_path / "fresh" / "responses" / "split.json").read_text())
    assert split["response_seed"] == 7 and "response_seed" not in json.loads(
        (tmp_path / "first" / "responses" / "split.json").read_text()
    )
    with pytest.raises(ValueError, match="split.json"):  # another seed's draws never join this pool
        run_cli("responses", "--config", str(responses_config(tmp_path, "fresh", max_prompts=6, response_seed=8)))


def test_bench_responses_times_the_three_generators_on_the_same_rows(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_cli("bench_responses", "--config", str(responses_config(tmp_path, "bench")), "--rows", "9")
    result = json.loads((tmp_path / "bench" / "bench_responses.json").read_text())
    assert result["settings"]["rows"] == 9 and result["settings"]["batch_size"] == 6
    assert set(result["tokens_per_second"]) == {"generate", "batch", "slots"}
    for passes in result["passes"].values():
        assert 9 <= passes["tokens"][0] <= 9 * 8 and passes["seconds"][0] > 0
    assert result["ratio_to_generate"]["generate"] == 1.0 and result["machine"]["cpu_capability"]


def test_bench_responses_compile_adds_the_compiled_generator_timed_after_compiling(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(slots_module, "LENGTH_STEP", 8)  # steps reach the whole (short) cache: the compiled ones run
    config = responses_config(tmp_path, "bench")
    run_cli("bench_responses", "--config", str(config), "--rows", "9", "--compile", "true")
    result = json.loads((tmp_path / "bench" / "bench_responses.json").read_text())
    assert set(result["tokens_per_second"]) == {"generate", "batch", "slots", "slots_compiled"}
    compiled = result["passes"]["slots_compiled"]
    assert compiled["compile_seconds"] > 0 and 9 <= compiled["tokens"][0] <= 9 * 8
    only = "[slots_features, slots_features_compiled]"  # the responses stage's own path, compiled and not
    run_cli("bench_responses", "--config", str(config), "--rows", "9", "--compile", "true", "--features", "true",
            "--generators", only)  # fmt: skip
    result = json.loads((tmp_path / "bench" / "bench_responses.json").read_text())
    assert set(result["passes"]) == {"slots_features", "slots_features_compiled"}
    assert result["passes"]["slots_features_compiled"]["compile_seconds"] > 0


def test_bench_responses_features_times_the_data_stage_both_ways(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_cli(
        "bench_responses", "--config", str(responses_config(tmp_path, "bench")), "--rows", "9", "--features", "true"
    )
    result = json.loads((tmp_path / "bench" / "bench_responses.json").read_text())
    assert set(result["tokens_per_second"]) == {"generate", "batch", "slots", "slots_then_forced", "slots_features"}
    for name in ("slots_then_forced", "slots_features"):  # every generator draws its own samples
        assert 9 <= result["passes"][name]["tokens"][0] <= 9 * 8 and result["passes"][name]["seconds"][0] > 0
    only = ["--generators", '["slots_then_forced", "slots_features"]']
    run_cli(
        "bench_responses",
        "--config",
        str(responses_config(tmp_path, "bench")),
        "--rows",
        "9",
        "--features",
        "true",
        *only,
    )
    result = json.loads((tmp_path / "bench" / "bench_responses.json").read_text())
    assert set(result["passes"]) == {"slots_then_forced", "slots_features"}
    assert result["ratio_to_slots_then_forced"]["slots_then_forced"] == 1.0
    with pytest.raises(ValueError, match=r"generators \['slots_features', 'slots_then_forced'\] are not among"):
        run_cli("bench_responses", "--config", str(responses_config(tmp_path, "bench")), "--rows", "9", *only)


def test_the_responses_stage_hands_compile_to_the_slot_generator(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = []

    def recording(*args, compile=False, **kwargs):
        seen.append(compile)
        return slot_generate(*args, **kwargs)

    monkeypatch.setattr(own_responses, "slot_generate", recording)
    run_cli("responses", "--config", str(responses_config(tmp_path, "compiled", compile=True, max_prompts=4)))
    assert seen and all(seen)
    with pytest.raises(ValueError, match="compile=true needs static_cache=true or slots"):
        run_cli("responses", "--config", str(responses_config(tmp_path, "batch", compile=True, slots=None)))
