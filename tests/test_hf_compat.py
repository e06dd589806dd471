"""The one module that touches version-sensitive transformers internals: cache cropping and grouped attention."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_llama
from transformers import DynamicCache

from accept_head._hf_compat import cache_length, crop_cache, register_gqa_eager


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
