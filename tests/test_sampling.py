"""The shared sampling transform agrees with transformers' own logits warpers (what ``generate`` samples from)."""

from __future__ import annotations

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from accept_head.core.sampling import SamplingConfig, argmax, probabilities, sample, sample_one


def hf_probabilities(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The distribution ``generate(do_sample=True, ...)`` draws from: temperature, then top-k, then top-p."""
    scores = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, None, None), (0.7, None, 0.8), (1.3, 5, None), (0.5, 10, 0.9)]
)
def test_sampling_transform_matches_transformers_warpers(temperature, top_k, top_p) -> None:
    logits = 3 * torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    ours = probabilities(logits, SamplingConfig(temperature, top_k, top_p))
    torch.testing.assert_close(ours, hf_probabilities(logits, temperature, top_k, top_p))
    torch.testing.assert_close(ours.sum(-1), torch.ones(16))


def test_greedy_transform_is_one_hot_on_the_argmax() -> None:
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    probs = probabilities(logits, SamplingConfig(0.0))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 10).float())
    assert SamplingConfig(0.0).greedy and not SamplingConfig(0.1).greedy


def test_top_p_always_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0]])  # top token holds 98% of the mass
    probs = probabilities(logits, SamplingConfig(1.0, top_p=0.5))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_sample_uses_only_the_given_generator() -> None:
    probs = torch.full((1, 100), 0.01)
    draws = [int(sample(probs, torch.Generator().manual_seed(7))[0]) for _ in range(3)]
    assert len(set(draws)) == 1
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
    ],
)
def test_invalid_sampling_settings_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**fields)


def test_one_row_draws_what_the_batched_sampler_draws() -> None:
    """sample_one(row) is sample(row[None])[0] from the same generator state, draw for draw — over rows with zeros
    (a pruned or filtered vocabulary), a near one-hot and an unnormalised residual (p − q)+ — and leaves the
    generator where the batched call leaves it."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.rand(50, generator=gen).pow(4) for _ in range(4)]
    rows[1][10:] = 0.0
    rows[2] = torch.full((50,), 1e-9).index_fill_(0, torch.tensor([7]), 1.0)
    rows[3] = (rows[3] - 0.3).clamp_min(0.0)  # a residual: not normalised
    for row in rows:
        one, batched = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        draws = [sample_one(row, one) for _ in range(300)]
        assert draws == [int(sample(row[None], batched)[0]) for _ in range(300)]
        assert torch.equal(one.get_state(), batched.get_state())
        assert all(row[d] > 0 for d in draws) and len(set(draws)) > (1 if row is not rows[2] else 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_equals_torch_argmax_ties_included(dtype) -> None:
    """The decoders' argmax (float32 compare for reduced-precision logits) picks what ``Tensor.argmax`` picks, the
    first maximum on ties — rows with many exact ties, as bf16 logits have."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (64, 300), generator=generator).to(dtype)  # every row has tied maxima
    logits[5] = 3  # a row of one value: index 0
    assert torch.equal(argmax(logits), logits.argmax(-1))
    assert int(argmax(logits[5])) == 0
    assert torch.equal(argmax(logits, dim=0), logits.argmax(0))
