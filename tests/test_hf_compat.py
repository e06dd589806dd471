"""The one module that touches version-sensitive transformers internals: cache cropping and grouped attention."""

from __future__ import annotations

import inspect

import pytest
import torch
from tiny_models import make_llama
from transformers import DynamicCache

from accept_head.core.hf_compat import OUTPUT_CACHE_FIELD, cache_kwargs, cache_length, crop_cache, register_gqa_eager


def test_cropped_cache_continues_exactly_like_a_fresh_prefix() -> None:
    model = make_llama(seed=0)
    ids = torch.tensor([[5, 9, 10, 11, 12, 13, 14, 15]])
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=ids, **cache_kwargs(model, cache))
        assert cache_length(cache) == 8
        crop_cache(cache, 5)
        assert cache_length(cache) == 5
        continued = model(input_ids=torch.tensor([[40, 41]]), **cache_kwargs(model, cache)).logits
        fresh = model(input_ids=torch.cat([ids[:, :5], torch.tensor([[40, 41]])], dim=1)).logits[:, -2:]
    torch.testing.assert_close(continued, fresh, atol=1e-5, rtol=1e-5)
    assert cache_length(None) == 0


def test_the_cache_goes_under_the_name_each_forward_takes() -> None:
    """transformers 5.24 renames forward's ``past_key_values`` to ``cache`` (the old name is removed in 5.40); a
    model whose forward still names ``past_key_values`` (older releases, remote code) gets that name, and a
    ``**kwargs`` wrapper the installed release's name."""
    cache = DynamicCache()

    class OldStyle(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False): ...

    class Wrapper(torch.nn.Module):
        def forward(self, *args, **kwargs): ...

    llama = make_llama(seed=0)
    expected = "cache" if "cache" in inspect.signature(type(llama).forward).parameters else "past_key_values"
    assert cache_kwargs(llama, cache) == {expected: cache, "use_cache": True}
    assert cache_kwargs(OldStyle(), cache, use_cache=False) == {"past_key_values": cache, "use_cache": False}
    assert cache_kwargs(Wrapper(), cache) == {OUTPUT_CACHE_FIELD: cache, "use_cache": True}


def test_cropping_a_cache_beyond_its_length_is_an_internal_error() -> None:
    model = make_llama(seed=0)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 9, 10]]), **cache_kwargs(model, cache))
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
