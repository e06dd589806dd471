"""Losslessness: speculative sampling must reproduce the target's distribution exactly (SpecDec++ §2, Leviathan et
al. 2023 Thm 1).

Stub models with fixed logits over a vocabulary of 8 make the target's distribution over the first four generated
tokens exactly computable from the model itself. A χ² goodness-of-fit test compares thousands of seeded samples
against those exact probabilities — for the first two tokens and for tokens 3-4 (where an adaptive policy decides
whether a token is a drafted candidate or the target's bonus token). The same check rejects deliberately broken
verifiers, so a pass means something.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from stats_helpers import (
    ALPHA,
    accept_every_candidate,
    exact_joint,
    goodness_of_fit,
    resample_from_target_on_rejection,
)
from tiny_models import TableLM

import accept_head.chain.decoding as decoding
from accept_head import AcceptanceHead, FixedK, HeadThreshold, autoregressive_generate, speculative_generate
from accept_head.core.sampling import SamplingConfig, probabilities

VOCAB, POSITIONS = 8, 8
PROMPT = [0, 3, 5]
NEW_TOKENS = 4
SAMPLES = 2000

SAMPLINGS = {"T=1": SamplingConfig(1.0), "T=0.7,top_p=0.8": SamplingConfig(0.7, top_p=0.8)}


def table_pair() -> tuple[TableLM, TableLM]:
    """A target and a draft whose distributions overlap but differ markedly (both the accept and reject paths run)."""
    generator = torch.Generator().manual_seed(0)
    target_logits = 1.5 * torch.randn(POSITIONS, VOCAB, VOCAB, generator=generator)
    draft_logits = 0.5 * target_logits + torch.randn(POSITIONS, VOCAB, VOCAB, generator=generator)
    return TableLM(target_logits), TableLM(draft_logits)


def varied_head(hidden_size: int) -> AcceptanceHead:
    """A linear probe whose predicted acceptance differs strongly across (position, token), so K varies by sample."""
    generator = torch.Generator().manual_seed(1)
    head = AcceptanceHead(hidden_size, depth=0)
    with torch.no_grad():
        head.out.weight.copy_(2 * torch.randn(1, hidden_size, generator=generator))
        head.out.bias.fill_(1.0)
    return head


@torch.no_grad()
def exact_distribution(model: torch.nn.Module, prompt: list[int], sampling: SamplingConfig, n: int) -> torch.Tensor:
    """P(first n generated tokens) under target-only sampling, an (V,)*n float64 tensor, from the model's logits."""
    joint = torch.ones(())
    for prefix_len in range(n):
        steps = torch.zeros(joint.shape + (VOCAB,), dtype=torch.float64)
        for prefix in itertools.product(range(VOCAB), repeat=prefix_len):
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            steps[prefix] = probabilities(logits, sampling).double()
        joint = joint[..., None] * steps
    return joint


def sample_tokens(decode, samples: int = SAMPLES) -> tuple[torch.Tensor, list[int]]:
    """Run ``decode(generator)`` ``samples`` times; return the generated tokens (samples, NEW_TOKENS) and the
    number of candidates proposed in each first round."""
    generator = torch.Generator().manual_seed(1234)
    tokens, first_k = [], []
    for _ in range(samples):
        result = decode(generator)
        tokens.append(result.sequences[0, len(PROMPT) :])
        first_k.append(result.stats.proposed[0] if result.stats.proposed else 1)
    return torch.stack(tokens), first_k


def pair_counts(tokens: torch.Tensor, first: int) -> torch.Tensor:
    """(V, V) counts of (token ``first``, token ``first + 1``) over samples."""
    return torch.bincount(tokens[:, first] * VOCAB + tokens[:, first + 1], minlength=VOCAB * VOCAB).view(VOCAB, VOCAB)


@pytest.fixture(scope="module")
def models() -> tuple[TableLM, TableLM]:
    return table_pair()


@pytest.fixture(scope="module")
def exact(models) -> dict[str, torch.Tensor]:
    target, _ = models
    return {name: exact_distribution(target, PROMPT, cfg, NEW_TOKENS) for name, cfg in SAMPLINGS.items()}


def assert_matches_target(tokens: torch.Tensor, joint: torch.Tensor) -> None:
    p_first_two = goodness_of_fit(pair_counts(tokens, 0), joint.sum(dim=(2, 3)))
    p_next_two = goodness_of_fit(pair_counts(tokens, 2), joint.sum(dim=(0, 1)))
    assert p_first_two > ALPHA and p_next_two > ALPHA, (p_first_two, p_next_two)


POLICIES = {
    "FixedK(1)": lambda draft: FixedK(1),
    "FixedK(3)": lambda draft: FixedK(3),
    "HeadThreshold(h=0.5)": lambda draft: HeadThreshold(varied_head(draft.config.hidden_size), 0.5),
    # Stops on the draft's probability of the candidate it just drew: a stop rule that depends on the draw.
    "HeadThreshold(h=0.85,unscored)": lambda draft: HeadThreshold(
        varied_head(draft.config.hidden_size), 0.85, unscored="confidence"
    ),
}


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_speculative_sampling_matches_exact_target_distribution(models, exact, policy_name, sampling_name) -> None:
    target, draft = models
    policy, cfg = POLICIES[policy_name](draft), SAMPLINGS[sampling_name]
    tokens, first_k = sample_tokens(
        lambda generator: speculative_generate(
            target, draft, PROMPT, policy, NEW_TOKENS, cfg.temperature, cfg.top_k, cfg.top_p, generator=generator
        )
    )
    assert_matches_target(tokens, exact[sampling_name])
    if policy_name.startswith("HeadThreshold"):
        assert len(set(first_k)) > 1  # the head really varies K, so tokens 3-4 mix candidates and bonus tokens


def test_autoregressive_sampling_matches_exact_target_distribution(models, exact) -> None:
    target, _ = models
    cfg = SAMPLINGS["T=0.7,top_p=0.8"]
    tokens, _ = sample_tokens(
        lambda generator: autoregressive_generate(
            target, PROMPT, NEW_TOKENS, cfg.temperature, top_p=cfg.top_p, generator=generator
        )
    )
    assert_matches_target(tokens, exact["T=0.7,top_p=0.8"])


@pytest.mark.parametrize("broken_verify", [accept_every_candidate, resample_from_target_on_rejection])
def test_goodness_of_fit_check_rejects_a_broken_verifier(models, exact, monkeypatch, broken_verify) -> None:
    target, draft = models
    monkeypatch.setattr(decoding, "verify", broken_verify)
    tokens, _ = sample_tokens(
        lambda generator: speculative_generate(target, draft, PROMPT, FixedK(3), NEW_TOKENS, generator=generator)
    )
    joint = exact["T=1"]
    p_first_two = goodness_of_fit(pair_counts(tokens, 0), joint.sum(dim=(2, 3)))
    assert p_first_two < 1e-6


# ---- the joint distribution over a short horizon (every cell, not pair marginals) ------------------------------------

JOINT_VOCAB, JOINT_TOKENS = 4, 3
"""A vocabulary of 4 and 3 tokens: 64 cells, few enough for one χ² over the whole joint, so dependence between
tokens 2 and 3 — across a round boundary whenever a candidate is rejected — is tested too."""


@pytest.fixture(scope="module")
def joint_models() -> tuple[TableLM, TableLM, torch.Tensor]:
    """A vocabulary-4 table target and draft (as :func:`table_pair`) and the exact joint (4, 4, 4) at T = 1."""
    generator = torch.Generator().manual_seed(2)
    target_logits = 1.5 * torch.randn(POSITIONS, JOINT_VOCAB, JOINT_VOCAB, generator=generator)
    draft_logits = 0.5 * target_logits + torch.randn(POSITIONS, JOINT_VOCAB, JOINT_VOCAB, generator=generator)
    target = TableLM(target_logits)
    return target, TableLM(draft_logits), exact_joint(target, PROMPT, JOINT_TOKENS)


def joint_p_value(target, draft, policy, joint: torch.Tensor, samples: int) -> float:
    tokens, _ = sample_tokens(
        lambda generator: speculative_generate(target, draft, PROMPT, policy, JOINT_TOKENS, generator=generator),
        samples,
    )
    cells = (tokens[:, 0] * JOINT_VOCAB + tokens[:, 1]) * JOINT_VOCAB + tokens[:, 2]
    return goodness_of_fit(torch.bincount(cells, minlength=JOINT_VOCAB**JOINT_TOKENS), joint)


@pytest.mark.parametrize("k", [1, 2])  # the 3-token budget caps K at 2 (the target adds a token of its own)
def test_speculative_sampling_matches_the_exact_joint(joint_models, k: int) -> None:
    target, draft, joint = joint_models
    p_value = joint_p_value(target, draft, FixedK(k), joint, SAMPLES)
    assert p_value > ALPHA, p_value


@pytest.mark.parametrize("broken_verify", [accept_every_candidate, resample_from_target_on_rejection])
def test_joint_check_rejects_a_broken_verifier(joint_models, monkeypatch, broken_verify) -> None:
    target, draft, joint = joint_models
    monkeypatch.setattr(decoding, "verify", broken_verify)
    assert joint_p_value(target, draft, FixedK(2), joint, 500) < 1e-6
