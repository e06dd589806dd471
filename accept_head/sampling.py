"""The sampling transform shared by every decoder, label generator and baseline.

Speculative sampling is lossless only if the target distribution p and the draft distribution q are taken *after the
same* transform that decoding uses (temperature, top-k, top-p). Everything in this toolkit that turns logits into
probabilities goes through :func:`probabilities`, so the decoders, ``data_gen`` labels and the baselines agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution. ``temperature=0`` means greedy (a one-hot on the argmax)."""

    temperature: float = 1.0
    """Softmax temperature; 0 selects greedy decoding."""
    top_k: int | None = None
    """Keep only the k most likely tokens (None or 0: no top-k filter)."""
    top_p: float | None = None
    """Keep the smallest set of tokens whose probability mass reaches top_p (None or 1.0: no nucleus filter)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy).")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 or None disables it).")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 or None disables it).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)


def probabilities(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Apply the sampling transform to ``logits`` (..., V) and return float32 probabilities (..., V).

    Greedy (temperature 0) returns a one-hot on the argmax, so the speculative acceptance rule min(1, p/q) reduces to
    "accept iff argmax q == argmax p" and the residual (p - q)+ to the target's argmax.
    """
    logits = logits.float()
    if config.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / config.temperature
    if config.top_k:
        k = min(config.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first token is always kept).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= config.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row from ``probs`` (B, V) → (B,) LongTensor, using only the given generator."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
