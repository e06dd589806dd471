"""Token mixing for head training (SpecDec++ §3.3).

The head must score draft tokens Y_i ~ q_i in contexts like those it meets at inference. Training contexts are built
by mixing: Z_i = X_i (the target's response token) with probability r, else Y_i (the draft's sample at that
position). The frozen draft reads (prompt, Z); positions holding Y_i carry the loss against the soft label of Y_i,
positions holding X_i carry none. The mixing is resampled every epoch from an explicitly seeded generator.
"""

from __future__ import annotations

import torch


def check_ratio(ratio: float) -> None:
    """Raise ValueError unless 0 <= ratio < 1 (at ratio 1 no position would hold a draft token)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(
            f"mix_ratio={ratio} must be in [0, 1): it is the probability that a position holds the target's token "
            "instead of the draft's, and at 1 no position would carry a loss. Set --data.mix_ratio (official: 0.15)."
        )


def mix_tokens(
    response_ids: torch.Tensor, draft_ids: torch.Tensor, ratio: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mix a target response X with draft samples Y position by position.

    response_ids, draft_ids: (..., N) LongTensors of the same shape. Returns ``(z, from_draft)``: z (..., N) with
    z_i = X_i with probability ``ratio`` else Y_i, and from_draft (..., N) bool, True where the coin chose Y_i
    (also when X_i happens to equal Y_i). ``generator`` is the only source of randomness.
    """
    check_ratio(ratio)
    if response_ids.shape != draft_ids.shape:
        raise ValueError(
            f"response_ids {tuple(response_ids.shape)} and draft_ids {tuple(draft_ids.shape)} must have one shape: "
            "the dataset must hold one draft sample per response position."
        )
    uniforms = torch.rand(response_ids.shape, generator=generator, device=generator.device)
    from_draft = (uniforms >= ratio).to(response_ids.device)
    return torch.where(from_draft, draft_ids, response_ids), from_draft
