"""The one module that touches version-sensitive transformers internals: cache cropping and grouped attention."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_llama
from transformers import DynamicCache

from accept_head._hf_compat import cache_length, crop_cache, growing_cache, register_gqa_eager


def test_cropped_cache_continues_exactly_like_a_fresh_prefix() -> None:
    model = make_llama(seed=0)
    ids = torch.tensor([[5, 9, 10, 11, 12, 13, 14, 15]])
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        assert cache_length(cache) == 8
        crop_cache(cache, 5)
        assert cache_length(cache) == 5
        continued = model(input_ids=torch.tensor([[40, 41]]), past_key_values=cache, use_cache=True).logits
        fresh = model(input_ids=torch.cat([ids[:, :5], torch.tensor([[40, 41]])], dim=1)).logits[:, -2:]
    torch.testing.assert_close(continued, fresh, atol=1e-5, rtol=1e-5)
    assert cache_length(None) == 0


def test_cropping_a_cache_beyond_its_length_is_an_internal_error() -> None:
    model = make_llama(seed=0)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 9, 10]]), past_key_values=cache, use_cache=True)
    crop_cache(cache, 3)  # a no-op
    assert cache_length(cache) == 3
    with pytest.raises(AssertionError, match="cannot crop a cache of 3 positions to 4"):
        crop_cache(cache, 4)


def test_grouped_eager_attention_equals_eager_attention_with_left_padding() -> None:
    eager = make_llama(seed=0)
    eager.set_attn_implementation("eager")
    grouped = make_llama(seed=0)
    grouped.set_attn_implementation(register_gqa_eager())
    ids = torch.tensor([[0, 0, 5, 9, 10], [5, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = eager(input_ids=ids, attention_mask=mask).logits
        actual = grouped(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(actual[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=1e-5)


def test_growing_cache_holds_what_dynamic_cache_holds_through_updates_crops_and_row_selection() -> None:
    grown, reference = growing_cache(), DynamicCache()
    assert isinstance(grown, DynamicCache)
    generator = torch.Generator().manual_seed(0)
    batch = 4
    for step in range(120):
        new = 5 if step == 0 else (3 if step % 7 == 0 else 1)
        keys = torch.randn(batch, 2, new, 8, generator=generator)
        values = torch.randn(batch, 2, new, 8, generator=generator)
        got, want = grown.update(keys, values, 0), reference.update(keys, values, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if step % 5 == 3:  # crops, as speculative decoding does after a rejection
            crop_cache(grown, cache_length(grown) - 2)
            crop_cache(reference, cache_length(reference) - 2)
        if step == 4:  # drop finished rows, as batched sampling does
            rows = torch.tensor([0, 2])
            grown.batch_select_indices(rows)
            reference.batch_select_indices(rows)
            batch = 2
    assert cache_length(grown) == cache_length(reference)


def test_a_model_decodes_the_same_with_a_growing_cache() -> None:
    model = make_llama(seed=0)
    model.set_attn_implementation(register_gqa_eager())
    ids = torch.tensor([[5, 9, 10, 11, 12], [5, 20, 21, 22, 23]])
    with torch.no_grad():
        outputs = []
        for cache in (growing_cache(), DynamicCache()):
            logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
            for token in range(30, 40):
                step = torch.full((2, 1), token)
                logits.append(model(input_ids=step, past_key_values=cache, use_cache=True).logits[:, -1])
            outputs.append(torch.stack(logits))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
