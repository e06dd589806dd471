"""``target_runtime="static"`` on model families other than Llama: it decodes the target's own greedy text where a
:class:`~accept_head.models.static_target.StaticTarget` can hold the target, and refuses, naming the fix, where it
cannot — never a silent change of the output.

* Gemma, Qwen3, Phi and GPT-2 targets decode their own greedy text over the static cache (float32).
* A sliding window set by ``config.sliding_window`` alone (Mistral, Phi-3: no ``config.layer_types``) is refused as
  ``layer_types`` sliding layers are: transformers' ``StaticCache`` builds sliding layers for it, which the decoders'
  roll-back cannot crop (before: a wrong greedy text, or an IndexError). A window at least as long as the cache never
  slides, and such a target still decodes its own greedy text over the static cache (Phi-3-mini's 2047).
* Logits that are not the LM head over the decoder's output (Cohere's ``logit_scale``, Gemma-2's soft-capping with
  full-attention layers) are refused: the static pass applies the head itself, so at T > 0 it sampled another
  distribution (greedy output hid it, the transforms being monotone).
* A target whose attention cannot run over a ``StaticCache`` at all (Falcon with ALiBi) is refused with a
  ValueError when the cache is built, not a shape error in the middle of a decode.
"""

from __future__ import annotations

import pytest
import torch
import transformers as hf

from accept_head import FixedK, autoregressive_generate, speculative_generate
from accept_head.models.static_target import StaticTarget

VOCAB = 64
LLAMA_LIKE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3, tie_word_embeddings=False,
    pad_token_id=0,
)  # fmt: skip


def build(config_class, model_class, seed: int = 0, **options) -> torch.nn.Module:
    config = config_class(**options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).float().eval()
    model.generation_config.eos_token_id = None
    return model


def noisy(model: torch.nn.Module) -> torch.nn.Module:
    """A draft: ``model`` with 30% relative noise on every weight (accepts some candidates, rejects others)."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in draft.parameters():
            scale = float(param.std()) if param.numel() > 1 else 0.0
            param.add_(torch.randn(param.shape, generator=generator) * 0.3 * scale)
    return draft


def greedy_reference(target: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)[0].tolist()


SUPPORTED = {
    "gemma": lambda: build(hf.GemmaConfig, hf.GemmaForCausalLM, head_dim=8, **LLAMA_LIKE),
    "qwen3": lambda: build(hf.Qwen3Config, hf.Qwen3ForCausalLM, head_dim=8, **LLAMA_LIKE),
    "phi": lambda: build(
        hf.PhiConfig,
        hf.PhiForCausalLM,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        initializer_range=0.3,
    ),
    "gpt2": lambda: build(hf.GPT2Config, hf.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4),
}


@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_static_runtime_decodes_the_targets_greedy_text_on_other_families(family: str) -> None:
    target = SUPPORTED[family]()
    draft = noisy(target)
    for prompt in ([7], [5, 9, 10, 11, 40, 41, 12, 13, 14, 15, 16]):
        want = greedy_reference(target, prompt, 20)
        got = speculative_generate(target, draft, prompt, FixedK(4), 20, temperature=0, target_runtime="static")
        assert got.sequences[0].tolist() == want


def mistral(seed: int = 0) -> torch.nn.Module:
    return build(hf.MistralConfig, hf.MistralForCausalLM, seed, sliding_window=4, **LLAMA_LIKE)


def phi3(seed: int = 0) -> torch.nn.Module:
    return build(hf.Phi3Config, hf.Phi3ForCausalLM, seed, sliding_window=4, **LLAMA_LIKE)


def test_a_window_as_long_as_the_cache_is_kept() -> None:
    target = build(hf.Phi3Config, hf.Phi3ForCausalLM, sliding_window=2047, **LLAMA_LIKE)
    prompt = [5, 9, 10, 11, 40, 41, 12, 13, 14, 15, 16]
    got = speculative_generate(target, noisy(target), prompt, FixedK(4), 20, temperature=0, target_runtime="static")
    assert got.sequences[0].tolist() == greedy_reference(target, prompt, 20)


@pytest.mark.parametrize("make", [mistral, phi3], ids=["mistral", "phi3"])
def test_a_sliding_window_without_layer_types_is_refused(make) -> None:
    target = make()
    assert getattr(target.config, "layer_types", None) is None and target.config.sliding_window == 4
    with pytest.raises(ValueError, match="has sliding-window layers.*which a StaticTarget does not roll back"):
        speculative_generate(target, noisy(target), [7], FixedK(4), 20, temperature=0, target_runtime="static")
    with pytest.raises(ValueError, match="target_runtime='eager'"):
        autoregressive_generate(target, [7], 4, temperature=0, target_runtime="static")
    # The eager runtime decodes it, windows and all.
    want = greedy_reference(target, [7], 20)
    assert speculative_generate(target, noisy(target), [7], FixedK(4), 20, temperature=0).sequences[0].tolist() == want


def cohere() -> torch.nn.Module:
    return build(hf.CohereConfig, hf.CohereForCausalLM, logit_scale=0.25, **LLAMA_LIKE)


def soft_capped_gemma2() -> torch.nn.Module:
    return build(
        hf.Gemma2Config, hf.Gemma2ForCausalLM, head_dim=8, query_pre_attn_scalar=8, final_logit_softcapping=2.0,
        layer_types=["full_attention", "full_attention"], **LLAMA_LIKE,
    )  # fmt: skip


@pytest.mark.parametrize("make", [cohere, soft_capped_gemma2], ids=["cohere", "gemma2"])
def test_logits_after_the_lm_head_are_refused(make) -> None:
    target = make()
    with pytest.raises(ValueError, match="logits are not its LM head applied to its decoder's output"):
        StaticTarget(target, 32)
    with pytest.raises(ValueError, match="target_runtime='eager'"):
        speculative_generate(target, target, [1, 2, 3], FixedK(2), 4, temperature=1.0, target_runtime="static")


def test_a_target_whose_attention_cannot_use_a_static_cache_is_refused_up_front() -> None:
    target = build(
        hf.FalconConfig, hf.FalconForCausalLM, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, alibi=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="cannot run over a preallocated StaticCache.*target_runtime='eager'"):
        autoregressive_generate(target, [7], 8, temperature=0, target_runtime="static")
