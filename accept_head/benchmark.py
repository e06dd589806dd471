"""Run decoders over prompt sets and aggregate their statistics — shared by the threshold sweep and ``eval``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .cost_model import CostModel
from .decoding import DecodeStats, GenerationResult, autoregressive_generate, speculative_generate
from .policies import StopPolicy
from .seeds import seeded_generator


@dataclass
class PolicyResult:
    """Aggregate of one policy over a prompt set (sums over prompts, then ratios)."""

    name: str
    generated: int
    target_calls: int
    draft_calls: int
    discarded: int
    rounds: int
    seconds: float
    verification_rate: float
    discard_rate: float
    mean_accepted: float
    mean_proposed: float
    tokens_per_second: float
    modeled_tokens_per_second: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def aggregate(name: str, stats: Sequence[DecodeStats], cost_model: CostModel | None = None) -> PolicyResult:
    """Pool the runs of one policy (:meth:`DecodeStats.__add__`) and price the pooled counts with ``cost_model``."""
    total = sum(stats, DecodeStats())
    if cost_model is None:
        modeled = None
    elif total.proposed:
        modeled = cost_model.modeled_tokens_per_second(total.generated, total.draft_calls, total.proposed)
    else:  # autoregressive: one target call per token, no draft
        modeled = total.generated / (total.target_calls * cost_model.t_target(0)) if total.target_calls else 0.0
    return PolicyResult(
        name=name,
        generated=total.generated,
        target_calls=total.target_calls,
        draft_calls=total.draft_calls,
        discarded=total.discarded,
        rounds=len(total.proposed),
        seconds=total.total_time,
        verification_rate=total.verification_rate,
        discard_rate=total.discard_rate,
        mean_accepted=total.mean_accepted,
        mean_proposed=sum(total.proposed) / max(len(total.proposed), 1),
        tokens_per_second=total.tokens_per_second,
        modeled_tokens_per_second=modeled,
    )


Decoder = Callable[[torch.Tensor, torch.Generator], GenerationResult]


def speculative_decoder(
    target, draft, policy: StopPolicy, max_new_tokens: int, eos_token_id, temperature: float = 1.0, **sampling
) -> Decoder:
    def run(ids: torch.Tensor, generator: torch.Generator) -> GenerationResult:
        return speculative_generate(
            target,
            draft,
            ids,
            policy,
            max_new_tokens,
            temperature,
            eos_token_id=eos_token_id,
            generator=generator,
            **sampling,
        )

    return run


def autoregressive_decoder(target, max_new_tokens: int, eos_token_id, temperature: float = 1.0, **sampling) -> Decoder:
    def run(ids: torch.Tensor, generator: torch.Generator) -> GenerationResult:
        return autoregressive_generate(
            target, ids, max_new_tokens, temperature, eos_token_id=eos_token_id, generator=generator, **sampling
        )

    return run


def run_prompts(decoder: Decoder, prompts: Sequence[Sequence[int]], seed: int = 0) -> list[DecodeStats]:
    """Decode every prompt (batch size 1) with a per-prompt seeded generator; return each prompt's stats."""
    return [decoder(torch.tensor([list(ids)]), seeded_generator(seed, 0, i)).stats for i, ids in enumerate(prompts)]
